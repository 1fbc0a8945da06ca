"""`billingctl activate`, `billingctl payments …`, `billingctl lock …`, `billingctl users show`."""

from __future__ import annotations

import typer

from billingctl.cli.context import command, get_ctx

payments_app = typer.Typer(help="Payment recording.", no_args_is_help=True)
lock_app = typer.Typer(help="The per-lane processor lock.", no_args_is_help=True)
users_app = typer.Typer(help="Users: credits, lane locks, frozen state.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(payments_app, name="payments")
    app.add_typer(lock_app, name="lock")
    app.add_typer(users_app, name="users")

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
        if cli.dry_run:
            cli.output.result({"dry_run": True, "subscription_id": subscription_id})
            return
        result = payments.activate_subscription(cli.container, subscription_id)
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
def lock_clear(user_id: str, lane: str = typer.Option(..., "--lane", help="sfw or nsfw"),
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
def lock_repair(user_id: str, lane: str = typer.Option(..., "--lane", help="sfw or nsfw")):
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
