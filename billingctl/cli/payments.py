"""`billingctl activate`, `billingctl payments …`, `billingctl lock …`, `billingctl users show`."""

from __future__ import annotations

from typing import Literal

import typer

from billingctl.cli.context import command, get_ctx

payments_app = typer.Typer(help="Payment recording.",
                  no_args_is_help=True, rich_markup_mode=None)
lock_app = typer.Typer(help="The per-lane processor lock.",
                  no_args_is_help=True, rich_markup_mode=None)
users_app = typer.Typer(help="Users: credits, lane locks, frozen state.",
                  no_args_is_help=True, rich_markup_mode=None)


def register(app: typer.Typer) -> None:
    app.add_typer(payments_app, name="payments")
    app.add_typer(lock_app, name="lock")
    app.add_typer(users_app, name="users")
    app.add_typer(renewals_app, name="renewals")
    app.add_typer(fraud_app, name="fraud")

    @command(app, "activate")
    def activate(subscription_id: str = typer.Argument(None, help="The subscription to activate."),
                 pending: bool = typer.Option(False, "--pending", help="Retry every pending activation.")):
        """Activate a pending subscription whose payment is recorded (refused when it is not)."""
        from billingctl.cli.exitcodes import PARTIAL
        from billingctl.domain.errors import InvalidInput
        from billingctl.services import payments

        cli = get_ctx()
        if pending:
            rows = payments.pending_activations(cli.container)
            if cli.dry_run:
                cli.output.table(rows, title="pending activations")
                return
            result = payments.retry_pending(cli.container)
            cli.output.result(result)
            if result["failed"]:
                raise typer.Exit(PARTIAL)
            return
        if not subscription_id:
            raise InvalidInput("give a SUBSCRIPTION_ID or --pending")
        result = payments.activate_subscription(cli.container, subscription_id, dry_run=cli.dry_run)
        cli.output.result(result, human=f"{subscription_id}: {result['outcome']}")


@command(payments_app, "record")
def record(payment_id: str = typer.Argument(..., help="The orchestrator payment id.")):
    """Record a settled payment by id (safe to re-run: a recorded payment is a no-op)."""
    from billingctl.services.payments import record_payment_by_id

    cli = get_ctx()
    if cli.dry_run:
        payment = cli.container.orchestrator.get_payment(payment_id)
        cli.output.result({"dry_run": True, "payment_id": payment_id, "status": payment.get("status")})
        return
    result = record_payment_by_id(cli.container, payment_id)
    cli.output.result(result, human=f"{payment_id}: {result['outcome']}, credits applied {result['credits_applied']}")


@command(lock_app, "show")
def lock_show(user_id: str):
    """The user's SFW and NSFW processor locks."""
    from billingctl.services.processor_lock import show

    cli = get_ctx()
    cli.output.result(show(cli.container, user_id))


@command(lock_app, "clear")
def lock_clear(user_id: str, lane: Literal["sfw", "nsfw"] = typer.Option(..., "--lane",
                                                     help="The lane."),
               reason: str = typer.Option(..., "--reason", help="Why (goes to the audit log)."),
               yes: bool = typer.Option(False, "--yes", help="Confirm.")):
    """Clear a wrong lock; refused when the user transacted successfully on the stored processor."""
    from billingctl.domain.errors import Refused
    from billingctl.services.processor_lock import clear

    cli = get_ctx()
    if not yes and not cli.dry_run:
        raise Refused("lock clear is destructive: add --yes (or --dry-run to see the plan)")
    result = clear(cli.container, user_id, lane, reason, cli.actor, dry_run=cli.dry_run)
    cli.output.result(result)


@command(lock_app, "repair")
def lock_repair(user_id: str, lane: Literal["sfw", "nsfw"] = typer.Option(..., "--lane",
                                                      help="The lane.")):
    """Re-lock from the orchestrator's payment history (outcome locked, no_history or unavailable)."""
    from billingctl.cli.exitcodes import EXTERNAL
    from billingctl.services.processor_lock import repair

    cli = get_ctx()
    result = repair(cli.container, user_id, lane, cli.actor)
    cli.output.result(result)
    if result["outcome"] == "unavailable":
        raise typer.Exit(EXTERNAL)


@command(lock_app, "backfill-mid")
def lock_backfill_mid():
    """Fill the NSFW merchant account of legacy NMI-type users only; never a processor column."""
    from billingctl.services.processor_lock import backfill_mid

    cli = get_ctx()
    result = backfill_mid(cli.container, cli.actor, dry_run=cli.dry_run)
    cli.output.result(result, human=f"filled {len(result['filled'])}, without history "
                                    f"{len(result['without_history'])}{' (dry run)' if cli.dry_run else ''}")


@command(users_app, "show")
def users_show(user_id: str):
    """Credits (with the ledger sum), lane locks and frozen state."""
    from billingctl.services.users import show_user

    cli = get_ctx()
    cli.output.result(show_user(cli.container, user_id))


@command(users_app, "freeze")
def users_freeze(user_id: str, reason: str = typer.Option(..., "--reason"),
                 void_invoices: bool = typer.Option(False, "--void-invoices", help="Void pending invoices."),
                 notify: bool = typer.Option(False, "--notify", help="Notify the user."),
                 yes: bool = typer.Option(False, "--yes")):
    """Disable further payments for a user (idempotent, audited)."""
    from billingctl.domain.errors import Refused
    from billingctl.services.users import freeze

    cli = get_ctx()
    if not yes and not cli.dry_run:
        raise Refused("freeze is destructive: add --yes (or --dry-run)")
    cli.output.result(freeze(cli.container, user_id, reason, cli.actor, void_invoices=void_invoices, notify=notify,
                             dry_run=cli.dry_run))


@command(users_app, "unfreeze")
def users_unfreeze(user_id: str, reason: str = typer.Option(..., "--reason"), yes: bool = typer.Option(False, "--yes")):
    """Allow payments again (audited); then `orphans retry` each payment held while frozen."""
    from billingctl.domain.errors import Refused
    from billingctl.services.users import unfreeze

    cli = get_ctx()
    if not yes and not cli.dry_run:
        raise Refused("unfreeze re-enables payments: add --yes (or --dry-run)")
    cli.output.result(unfreeze(cli.container, user_id, reason, cli.actor, dry_run=cli.dry_run))


renewals_app = typer.Typer(help="Renewals and dunning.",
                  no_args_is_help=True, rich_markup_mode=None)
fraud_app = typer.Typer(help="Fraud watches.",
                  no_args_is_help=True, rich_markup_mode=None)


@command(renewals_app, "run")
def renewals_run():
    """The dunning tick: one attempt per due renewal invoice."""
    from billingctl.cli.exitcodes import PARTIAL
    from billingctl.cli.output import progress
    from billingctl.services.renewals import run_renewals

    cli = get_ctx()
    with progress("renewal invoices") as advance:
        result = run_renewals(cli.container, dry_run=cli.dry_run, progress=advance)
    cli.output.result(result)
    if result["errors"]:
        raise typer.Exit(PARTIAL)


@command(renewals_app, "list")
def renewals_list(user: str = typer.Option(None, "--user"), invoice: str = typer.Option(None, "--invoice"),
                  limit: int = typer.Option(100, "--limit")):
    """Attempts, statuses, decline codes and the next attempt."""
    from billingctl.services.renewals import list_attempts

    cli = get_ctx()
    rows = list_attempts(cli.container, user, invoice, limit)
    cli.output.table(rows, ["invoice_id", "user_id", "attempt_no", "status", "decline_code", "processor",
                            "created_at", "next_attempt_at"], title="dunning attempts", data=rows)


@command(fraud_app, "velocity")
def fraud_velocity():
    """The velocity watch (every minute): alert on over 10 charges or 1000 units a minute."""
    from billingctl.services.users import velocity_watch

    cli = get_ctx()
    cli.output.result(velocity_watch(cli.container))
