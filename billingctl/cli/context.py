"""What every command shares: the output sink, global flags, a lazily built container, and the
one decorator that turns errors into exit codes."""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field
from datetime import datetime

import typer

from billingctl.cli.exitcodes import EXTERNAL, UNEXPECTED, exit_code_for
from billingctl.cli.output import Output
from billingctl.domain.errors import BillingError, is_database_outage, is_schema_behind


@dataclass
class CliContext:
    json: bool = False
    dry_run: bool = False
    output: Output = field(default_factory=Output)
    log_level_given: bool = False
    _container: object = None

    @property
    def container(self):
        if self._container is None:
            from billingctl.bootstrap import bootstrap
            from billingctl.sandbox.delivery import provide_receiver

            provide_receiver(_public_app)  # the in-process sandbox's webhooks go to the public app
            self._container = bootstrap()
        return self._container

    def close(self) -> None:
        """The container the command built, if it built one: its pools, Redis and HTTP clients closed."""
        if self._container is not None:
            container, self._container = self._container, None
            container.close()

    @property
    def actor(self) -> str:
        return os.environ.get("SUDO_USER") or os.environ.get("USER") or "operator"


def _public_app():
    from webhooks_app import create_public_app  # loaded only when the sandbox delivers a webhook

    return create_public_app


_current = CliContext()


def set_ctx(cli: CliContext) -> CliContext:
    """Called once per invocation by the root callback."""
    global _current
    _current = cli
    return cli


def get_ctx() -> CliContext:
    return _current


def exit_if_partial(result) -> None:
    """Exit 5 when items of a batch failed (its typed outcome says how many; the document was printed)."""
    from billingctl.cli.exitcodes import PARTIAL
    from billingctl.domain.batch import failed_items

    if failed_items(result):
        raise typer.Exit(PARTIAL)


def noun(help_text: str) -> typer.Typer:
    """The Typer app of one noun (`billingctl users …`): its help, and its help again when run bare."""
    return typer.Typer(help=help_text, no_args_is_help=True, rich_markup_mode=None)


def command(app: typer.Typer, name: str | None = None, **kwargs):
    """Register a command whose errors become one stderr line and the table's exit code."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kw):
            cli = get_ctx()
            try:
                return fn(*args, **kw)
            except typer.Exit:
                raise
            except BillingError as exc:
                partial = exc.details.get("result")
                if cli.json and partial is not None:
                    # A partial failure (exit 4 or 5) still gives a script the document of what was done.
                    from billingctl.cli.output import dumps

                    sys.stdout.write(dumps(partial) + "\n")
                cli.output.error(exc.message)
                raise typer.Exit(exit_code_for(exc)) from None
            except KeyboardInterrupt:
                cli.output.error("interrupted")
                raise typer.Exit(130) from None
            except Exception as exc:
                if is_schema_behind(exc):  # before the outage test: SQLite's "no such table" is operational
                    from billingctl.adapters.db.migrate import behind_message

                    behind = behind_message(cli.container.settings.database_url)
                    if behind is not None:  # at the code's revision, a missing table is a crash like any
                        cli.output.error(behind)
                        raise typer.Exit(EXTERNAL) from None
                if is_database_outage(exc):
                    cli.output.error(f"database unavailable: {str(exc).splitlines()[0][:200]}")
                    raise typer.Exit(EXTERNAL) from None
                cli.output.error(f"unexpected {type(exc).__name__}: {exc}")
                if os.environ.get("BILLING_DEBUG") or not sys.stderr.isatty():
                    _log_crash(exc, f"{fn.__module__.rsplit('.', 1)[-1]} {name or fn.__name__}", kw)
                raise typer.Exit(UNEXPECTED) from None

        return app.command(name, **kwargs)(wrapper)

    return decorate


def _log_crash(exc: BaseException, command: str, arguments: dict) -> None:
    """An unexpected error, as one log record with its traceback, the command and its arguments (a job's
    name among them): a JSON line for the journal or syslog (cron, systemd), readable at a terminal with
    BILLING_DEBUG (issue 38 item 5)."""
    import logging

    shown = {k: v for k, v in arguments.items() if isinstance(v, str | int | float | bool)}
    job = shown.get("name") if command == "jobs run" else None
    logging.getLogger("billingctl.cli").error(
        "command crashed: %s: %s", type(exc).__name__, exc, exc_info=(type(exc), exc, exc.__traceback__),
        extra={"command": command, "arguments": shown, **({"job": job} if job else {})})


_RELATIVE = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(value: str | None) -> datetime | None:
    """An ISO 8601 time, or a span back from now: `90s`, `15m`, `1h`, `2d`, `1w`."""
    import re
    from datetime import UTC, timedelta

    from billingctl.domain.clock import parse_time
    from billingctl.domain.errors import InvalidInput

    if not value:
        return None
    relative = re.fullmatch(r"([0-9]{1,6})([smhdw])", value.strip())
    if relative:
        return datetime.now(UTC) - timedelta(seconds=int(relative.group(1)) * _RELATIVE[relative.group(2)])
    try:
        return parse_time(value)
    except (ValueError, OverflowError, OSError):
        raise InvalidInput(f"--since must be an ISO 8601 time or a span like 1h or 2d, not {value!r}") from None
