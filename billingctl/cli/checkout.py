"""`billingctl checkout cleanup`."""

from __future__ import annotations

import typer

from billingctl.cli.context import command, get_ctx, noun

app = noun("Checkouts.")


@command(app, "cleanup")
def cleanup():
    """Cancel expired pending checkouts older than a day (never one with a purchase)."""
    from billingctl.cli.exitcodes import PARTIAL
    from billingctl.services.checkout import cleanup_expired

    cli = get_ctx()
    result = cleanup_expired(cli.container, dry_run=cli.dry_run)
    cli.output.result(result)
    if result.get("failed"):
        raise typer.Exit(PARTIAL)
