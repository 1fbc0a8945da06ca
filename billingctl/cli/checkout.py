"""`billingctl checkout cleanup`."""

from __future__ import annotations

from billingctl.cli.context import command, exit_if_partial, get_ctx, noun

app = noun("Checkouts.")


@command(app, "cleanup")
def cleanup():
    """Cancel expired pending checkouts older than a day (never one with a purchase); capture a checkout
    authorization left uncaptured past its limit, or void it when no longer owed."""
    from billingctl.services.checkout import cleanup_expired

    cli = get_ctx()
    result = cleanup_expired(cli.container, dry_run=cli.dry_run)
    cli.output.result(result)
    exit_if_partial(result)
