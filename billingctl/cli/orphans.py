"""`billingctl orphans`: the settled-payments poller and the manual review of orphaned payments."""

from __future__ import annotations

from typing import Literal

import typer

from billingctl.cli.context import command, exit_if_partial, get_ctx, noun
from billingctl.domain.lifecycle import ORPHAN

app = noun("Orphaned payments (settled for a cancelled subscription).")

OrphanState = Literal[ORPHAN.states]


@command(app, "run")
def run():
    """The settled-payments poller (every minute): record missed payments, recover orphans."""
    from billingctl.services.orphans import run_orphans

    cli = get_ctx()
    if cli.dry_run:
        from billingctl.services.orphans import _read_cursor

        cursor = _read_cursor(cli.container)
        seen = [p.id for p in cli.container.orchestrator.list_payments("SETTLED", from_date=cursor)]
        cli.output.result({"dry_run": True, "cursor": cursor, "settled_payments_to_check": seen})
        return

    with cli.output.progress("checking settled payments") as advance:
        result = run_orphans(cli.container, progress=advance)
    cli.output.result(result)
    exit_if_partial(result)


@command(app, "list")
def list_(state: OrphanState = typer.Option(None, "--state",
        help="Where the payment stands.")):
    """Orphaned payments and where each stands."""
    from billingctl.services.orphans import list_orphans

    cli = get_ctx()
    rows = list_orphans(cli.container, state)
    cli.output.table(rows, ["payment_id", "user_id", "item_price_id", "status", "attempts", "next_attempt_at",
                            "last_error", "resolution"], title="orphaned payments", data=rows)


@command(app, "show")
def show(payment_id: str):
    """The payment, the user, the plan, the attempts and what the user holds now."""
    from billingctl.services.orphans import show as show_orphan

    cli = get_ctx()
    cli.output.result(show_orphan(cli.container, payment_id))


@command(app, "retry")
def retry(payment_id: str):
    """Run one recovery attempt now."""
    from billingctl.services.orphans import retry as retry_orphan

    cli = get_ctx()
    if cli.dry_run:
        cli.output.result({"dry_run": True, "payment_id": payment_id})
        return
    cli.output.result(retry_orphan(cli.container, payment_id, cli.actor))


@command(app, "resolve")
def resolve(payment_id: str,
            create_subscription: bool = typer.Option(False, "--create-subscription"),
            refund: bool = typer.Option(False, "--refund"),
            mark_handled: bool = typer.Option(False, "--mark-handled"),
            reason: str = typer.Option(..., "--reason"), yes: bool = typer.Option(False, "--yes")):
    """Resolve by hand: create the subscription, refund, or mark handled (audited)."""
    from billingctl.domain.errors import InvalidInput, Refused
    from billingctl.services.orphans import resolve as resolve_orphan

    cli = get_ctx()
    chosen = [name for name, on in (("create-subscription", create_subscription), ("refund", refund),
                                    ("mark-handled", mark_handled)) if on]
    if len(chosen) != 1:
        raise InvalidInput("choose exactly one of --create-subscription, --refund, --mark-handled")
    if not yes and not cli.dry_run:
        raise Refused("resolve is destructive: add --yes (or --dry-run)")
    cli.output.result(resolve_orphan(cli.container, payment_id, chosen[0], reason, cli.actor, dry_run=cli.dry_run))
