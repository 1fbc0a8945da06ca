"""`billingctl trace USER|PAYMENT|SUBSCRIPTION|INVOICE`: one timeline across the three sets of books."""

from __future__ import annotations

import typer

from billingctl.cli.context import command, get_ctx


def register(app: typer.Typer) -> None:
    @command(app, "trace")
    def trace_cmd(any_id: str = typer.Argument(..., metavar="ID",
                                               help="A user, payment, subscription or invoice id.")):
        """One customer's timeline across our books, the provider's and the orchestrator's, each place they
        disagree flagged with the reconcile check that names it (exit 5 when one does)."""
        from billingctl.cli.exitcodes import PARTIAL
        from billingctl.services.trace import trace

        cli = get_ctx()
        report = trace(cli.container, any_id)
        if cli.json:
            cli.output.result(report)
        else:
            cli.output.table(report["timeline"], ["at", "source", "what", "ids", "flag"],
                             title=f"trace of {report['user_id']}")
            for section, shown in report["not_shown"].items():
                cli.output.info(f"only the first {shown} rows of the {section} shown: more are left out")
            cli.output.info("the books agree" if report["agree"] else
                            f"{len(report['disagreements'])} disagreement(s): "
                            + ", ".join(sorted({d['check'] for d in report['disagreements']})))
        if not report["agree"]:
            raise typer.Exit(PARTIAL)
