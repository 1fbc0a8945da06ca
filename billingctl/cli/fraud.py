"""`billingctl fraud velocity`."""

from __future__ import annotations

from billingctl.cli.context import command, get_ctx, noun

app = noun("Fraud watches.")


@command(app, "velocity")
def fraud_velocity():
    """The velocity watch (every minute): alert on over 10 charges or 1000 units a minute."""
    from billingctl.services.users import velocity_watch

    cli = get_ctx()
    cli.output.result(velocity_watch(cli.container))
