"""`billingctl payments record` and `billingctl payments refund`."""

from __future__ import annotations

import typer

from billingctl.cli.context import command, get_ctx, noun

app = noun("Payment recording.")


@command(app, "record")
def record(payment_id: str = typer.Argument(..., help="The orchestrator payment id."),
           yes: bool = typer.Option(False, "--yes", help="Record it even when another payment already pays "
                                    "its invoice (a second term is credited).")):
    """Record a settled payment by id (safe to re-run: a recorded payment is a no-op)."""
    from billingctl.services.payments import record_payment_by_id

    cli = get_ctx()
    if cli.dry_run:
        payment = cli.container.orchestrator.get_payment(payment_id)
        cli.output.result({"dry_run": True, "payment_id": payment_id, "status": payment.status})
        return
    result = record_payment_by_id(cli.container, payment_id, confirmed=yes)
    cli.output.result(result, human=f"{payment_id}: {result['outcome']}, credits applied {result['credits_applied']}")


@command(app, "refund")
def refund(payment_id: str = typer.Argument(..., help="The orchestrator payment id."),
           reason: str = typer.Option(..., "--reason", help="Why (kept in the audit log)."),
           yes: bool = typer.Option(False, "--yes", help="Refund for real (it moves money).")):
    """Refund what is left of a captured payment at the orchestrator and reverse its credits once (audited;
    safe to re-run)."""
    from billingctl.domain.errors import Refused
    from billingctl.services.payments import refund_by_operator

    cli = get_ctx()
    if not yes and not cli.dry_run:
        raise Refused("refund moves money: add --yes (or --dry-run)")
    result = refund_by_operator(cli.container, payment_id, reason, cli.actor, dry_run=cli.dry_run)
    cli.output.result(result, human=None if cli.dry_run else
                      f"{payment_id}: {result['outcome']}, {result['refunded']} {result['currency_code']} refunded, "
                      f"credits reversed {result['credits_reversed_total']}")
