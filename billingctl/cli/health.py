"""`billingctl health`: the one screen an on-call engineer opens first."""

from __future__ import annotations

import typer

from billingctl.cli.context import command, get_ctx
from billingctl.cli.exitcodes import EXTERNAL, REFUSED


def register(app: typer.Typer) -> None:
    @command(app, "health")
    def health(watch: float = typer.Option(None, "--watch", metavar="SECONDS", min=1,
                                           help="Repeat every SECONDS until Ctrl-C (exit code of the last)."),
               count: int = typer.Option(0, "--count", hidden=True, help="With --watch: stop after N reports.")):
        """Database, migrations, Redis, breakers, pending work, jobs; non-zero exit when anything needs
        attention (3) or an outside system fails (4). Example: billingctl health --watch 10"""
        import time

        cli = get_ctx()
        shown = 0
        while True:
            code = _report(cli)
            shown += 1
            if watch is None or (count and shown >= count):
                break
            try:
                time.sleep(watch)
            except KeyboardInterrupt:
                break
        if code:
            raise typer.Exit(code)


def _report(cli) -> int:
    from billingctl.services.health import health_report

    report = health_report(cli.container)
    if cli.json:
        cli.output.result(report)
    else:
        rows = [
            {"check": c["name"], "status": "ok" if c["ok"] else "ATTENTION", "detail": c["detail"]}
            for c in report["checks"]
        ]
        cli.output.table(rows, title=f"billing health at {time_now()}")
    if report["ok"]:
        return 0
    external = any(c["external"] and not c["ok"] for c in report["checks"])
    return EXTERNAL if external else REFUSED


def time_now() -> str:
    from datetime import UTC, datetime

    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
