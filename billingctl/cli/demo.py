"""`billingctl demo`: the newcomer's first run on the embedded default (SQLite, sandbox providers)."""

from __future__ import annotations

import os
import sys

import typer

from billingctl.cli.context import command, get_ctx


def register(app: typer.Typer) -> None:
    @command(app, "demo")
    def demo():
        """Walk through the main job on the sandbox: checkout, settle, webhooks, pollers, renewal, orphans."""
        from billingctl.cli.exitcodes import PARTIAL
        from billingctl.demo import run_demo

        # The story lets a month pass on the embedded sandbox: every part of it (ours, the webhooks' app) reads
        # the sandbox's clock, which is real time until the story moves it.
        os.environ.setdefault("BILLING_CLOCK", "sandbox")
        cli = get_ctx()
        if not cli.log_level_given:
            # The story shows the expected warnings (lost webhooks, orphans) in its own words: no log lines
            # in the middle of it unless asked for with --log-level.
            from billingctl.adapters.logs import set_level

            set_level("ERROR")
        report = run_demo(cli.container, say=cli.output.info, rich=not cli.json and sys.stderr.isatty())
        if cli.json:
            cli.output.result(report)
        else:
            rows = [{"user": u, "credits": v["credits"], "ledger_sum": v["ledger_sum"], "purchases": v["purchases"],
                     "sfw_lock": v["sfw_processor"], "nsfw_lock": v["nsfw_processor"]}
                    for u, v in report["users"].items()]
            cli.output.table(rows, title="final state")
        if not report["reconcile_ok"]:
            raise typer.Exit(PARTIAL)
