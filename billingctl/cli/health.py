"""`billingctl health`: the one screen an on-call engineer opens first."""

from __future__ import annotations

import typer

from billingctl.cli.context import command, get_ctx
from billingctl.cli.exitcodes import EXTERNAL, REFUSED


def register(app: typer.Typer) -> None:
    @command(app, "health")
    def health():
        """Database, migrations, Redis; non-zero exit when anything needs attention."""
        from billingctl.services.health import health_report

        cli = get_ctx()
        report = health_report(cli.container)
        if cli.json:
            cli.output.result(report)
        else:
            rows = [
                {"check": c["name"], "status": "ok" if c["ok"] else "ATTENTION", "detail": c["detail"]}
                for c in report["checks"]
            ]
            cli.output.table(rows, title="billing health")
        if not report["ok"]:
            external = any(c["external"] and not c["ok"] for c in report["checks"])
            raise typer.Exit(EXTERNAL if external else REFUSED)
