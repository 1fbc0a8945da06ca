"""`billingctl reconcile`: check the invariants, print each violation, exit 5 when there is one."""

from __future__ import annotations

import typer

from billingctl.cli.context import command, exit_if_partial, get_ctx


def register(app: typer.Typer) -> None:
    @command(app, "reconcile")
    def reconcile_cmd(since: str = typer.Option(None, "--since", metavar="TIME",
                                                help="ISO 8601 or a span (1h, 2d): payments settled since.")):
        """Payments recorded once, ledger and credits consistent, subscriptions as at the provider."""
        from billingctl.cli.context import parse_since
        from billingctl.services.reconcile import reconcile

        cli = get_ctx()
        with cli.output.progress("reconciling") as advance:
            report = reconcile(cli.container, parse_since(since), progress=advance)
        if cli.json:
            cli.output.result(report)
        elif report["violations"]:
            cli.output.table(report["violations"], ["check", "payment_id", "user_id", "subscription_id", "detail"],
                             title="reconcile: violations")
        else:
            from billingctl.cli.output import human

            cli.output.result(report, human=f"reconcile: clean (checked {human(report['checked'])})")
        exit_if_partial(report)
