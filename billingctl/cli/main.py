"""Entry point of `billingctl`. Keep imports light: heavy libraries load inside commands."""

from __future__ import annotations

import typer

from billingctl import __version__
from billingctl.cli.context import CliContext, command, set_ctx
from billingctl.cli.output import Output

app = typer.Typer(
    name="billingctl",
    help="Billing operations toolkit: every operation of the billing service, for people and jobs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: Typer's Rich help renderer doubles the start-up time
)


@app.callback()
def _root(
    ctx: typer.Context,
    json_output: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; change nothing."),
    log_level: str = typer.Option(None, "--log-level", envvar="BILLING_LOG_LEVEL",
                                  help="Log level (default WARNING; INFO for `jobs run`)."),
):
    from billingctl.adapters.logs import configure_logging

    configure_logging((log_level or "WARNING").upper())
    ctx.obj = set_ctx(CliContext(json=json_output, dry_run=dry_run, output=Output(json_output),
                                 log_level_given=log_level is not None))


@command(app, "version")
def version():
    """Print the version."""
    from billingctl.cli.context import get_ctx

    get_ctx().output.result({"version": __version__}, human=f"billingctl {__version__}")


def _register() -> None:
    from billingctl.cli import (
        alerts,
        checkout,
        db,
        demo,
        events,
        health,
        jobs,
        media,
        orphans,
        payments,
        reconcile,
        sandbox,
    )

    app.add_typer(db.app, name="db")
    app.add_typer(alerts.app, name="alerts")
    app.add_typer(sandbox.app, name="sandbox")
    app.add_typer(orphans.app, name="orphans")
    app.add_typer(media.app, name="media")
    app.add_typer(jobs.app, name="jobs")
    health.register(app)
    demo.register(app)
    payments.register(app)
    checkout.register(app)
    events.register(app)
    reconcile.register(app)


_register()


def main() -> None:
    app()
