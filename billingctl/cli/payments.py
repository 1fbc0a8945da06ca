"""`billingctl payments record`."""

from __future__ import annotations

import typer

from billingctl.cli.context import command, get_ctx, noun

app = noun("Payment recording.")


@command(app, "record")
def record(payment_id: str = typer.Argument(..., help="The orchestrator payment id.")):
    """Record a settled payment by id (safe to re-run: a recorded payment is a no-op)."""
    from billingctl.services.payments import record_payment_by_id

    cli = get_ctx()
    if cli.dry_run:
        payment = cli.container.orchestrator.get_payment(payment_id)
        cli.output.result({"dry_run": True, "payment_id": payment_id, "status": payment.status})
        return
    result = record_payment_by_id(cli.container, payment_id)
    cli.output.result(result, human=f"{payment_id}: {result['outcome']}, credits applied {result['credits_applied']}")
