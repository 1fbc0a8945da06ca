"""`billingctl demo`: the newcomer's first run on the embedded default (SQLite, sandbox providers)."""

from __future__ import annotations

import typer

from billingctl.cli.context import command, get_ctx


def register(app: typer.Typer) -> None:
    @command(app, "demo")
    def demo():
        """Create the embedded database and walk through the main job on the sandbox."""
        from billingctl.demo import run_demo

        cli = get_ctx()
        report = run_demo(cli.container, say=cli.output.info)
        cli.output.result(report, human="demo finished: " + ", ".join(f"{k}={v}" for k, v in report.items()))
