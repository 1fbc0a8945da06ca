"""`billingctl fraud velocity`."""

from __future__ import annotations

import typer

from billingctl.cli.context import command, get_ctx

app = typer.Typer(help="Fraud watches.",
                  no_args_is_help=True, rich_markup_mode=None)



@command(app, "velocity")
def fraud_velocity():
    """The velocity watch (every minute): alert on over 10 charges or 1000 units a minute."""
    from billingctl.services.users import velocity_watch

    cli = get_ctx()
    cli.output.result(velocity_watch(cli.container))
