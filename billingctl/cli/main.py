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
    context_settings={"help_option_names": ["-h", "--help"]},
)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Global flags: accepted before or after the sub-command (moved to the front before parsing).
GLOBAL_FLAGS = ("--json", "--dry-run")
GLOBAL_OPTIONS = ("--log-level", "--output")


def hoist_global_flags(argv: list[str]) -> list[str]:
    """`billingctl health --json` works like `billingctl --json health`; a `--` ends the scan."""
    front, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest.extend(argv[i:])
            break
        name = arg.split("=", 1)[0]
        if arg in GLOBAL_FLAGS:
            front.append(arg)
        elif name in GLOBAL_OPTIONS and "=" in arg:
            front.append(arg)
        elif arg in GLOBAL_OPTIONS and i + 1 < len(argv):
            front.extend(argv[i:i + 2])
            i += 1
        else:
            rest.append(arg)
        i += 1
    return front + rest


def _version(value: bool) -> None:
    if value:
        typer.echo(f"billingctl {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    ctx: typer.Context,
    json_output: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; change nothing."),
    log_level: str = typer.Option(None, "--log-level", envvar="BILLING_LOG_LEVEL", metavar="LEVEL",
                                  help=f"Log level: {', '.join(LOG_LEVELS)} (default WARNING; INFO for "
                                       "`jobs run`)."),
    output: str = typer.Option(None, "--output", metavar="FORMAT",
                               help="table (on a terminal), tsv (through a pipe) or json."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
):
    from billingctl.adapters.logs import configure_logging
    from billingctl.cli.output import OUTPUTS

    if log_level is not None and log_level.upper() not in LOG_LEVELS:
        raise typer.BadParameter(f"{log_level!r} is not one of {', '.join(LOG_LEVELS)}", param_hint="--log-level")
    if output is not None and output not in OUTPUTS:
        raise typer.BadParameter(f"{output!r} is not one of {', '.join(OUTPUTS)}", param_hint="--output")
    configure_logging((log_level or "WARNING").upper())
    json_mode = json_output or output == "json"
    ctx.obj = set_ctx(CliContext(json=json_mode, dry_run=dry_run, output=Output(json_mode, output),
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
    import sys

    app(args=hoist_global_flags(sys.argv[1:]), prog_name="billingctl")
