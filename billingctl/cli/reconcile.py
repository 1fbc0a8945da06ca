"""`billingctl reconcile`: check the invariants, print each violation, exit 5 when there is one.
`billingctl reconcile ack CHECK SUBJECT --reason R` acknowledges one judged violation (`unack` takes it
back, `acks` lists them)."""

from __future__ import annotations

from typing import Literal

import typer

from billingctl.cli.context import command, exit_if_partial, get_ctx

Action = Literal["ack", "unack", "acks"]
IDS = ("invoice_id", "payment_id", "payment_ids", "order_id", "subscription_id", "subscription_ids", "user_id",
       "dispute_id", "ledger_id", "invoice_ids", "item_price_id")


def ids(violation: dict) -> str:
    """Every id a violation names, for the human table: what the next command needs."""
    parts = []
    for key in IDS:
        value = violation.get(key)
        if value:
            shown = ",".join(value) if isinstance(value, list) else value
            parts.append(f"{key.removesuffix('_ids').removesuffix('_id')}={shown}")
    return " ".join(parts)


def register(app: typer.Typer) -> None:
    @command(app, "reconcile")
    def reconcile_cmd(
            action: Action = typer.Argument(None, help="ack: acknowledge a judged violation; unack: take it "
                                            "back; acks: list them. Without it: run the checks."),
            check: str = typer.Argument(None, help="The violation's check (ack, unack)."),
            subject: str = typer.Argument(None, help="The violation's first id, as `reconcile` shows it."),
            since: str = typer.Option(None, "--since", metavar="TIME",
                                      help="ISO 8601 or a span (1h, 2d): read the external books since then."),
            full: bool = typer.Option(False, "--full", help="Read the whole refund window and every "
                                      "subscription (a full pass runs weekly by itself)."),
            reason: str = typer.Option(None, "--reason", help="Why the violation is known (ack).")):
        """Check the three sets of books: payments, ledger, credits, invoices, subscriptions."""
        cli = get_ctx()
        if action is not None:
            return _acknowledgements(cli, action, check, subject, reason)
        from billingctl.cli.context import parse_since
        from billingctl.domain.errors import InvalidInput
        from billingctl.services.reconcile import reconcile

        if full and since:
            raise InvalidInput("--full and --since exclude each other")
        with cli.output.progress("reconciling") as advance:
            report = reconcile(cli.container, parse_since(since), progress=advance, full=full)
        if cli.json:
            cli.output.result(report)
        elif report["violations"]:
            cli.output.table([{**v, "ids": ids(v)} for v in report["violations"]], ["check", "ids", "detail"],
                             title="reconcile: violations")
        else:
            from billingctl.cli.output import human

            cli.output.result(report, human=f"reconcile: clean (checked {human(report['checked'])})")
        if report["acknowledged"] and not cli.json:
            cli.output.info(f"{len(report['acknowledged'])} acknowledged violation(s) not counted "
                            "(`billingctl reconcile acks`)")
        exit_if_partial(report)


def _acknowledgements(cli, action: str, check: str | None, subject: str | None, reason: str | None) -> None:
    from billingctl.domain.errors import InvalidInput
    from billingctl.services.reconcile import acks

    if action == "acks":
        cli.output.table(acks.listing(cli.container), ["check_name", "subject", "reason", "actor", "created_at"])
        return
    if not check or not subject:
        raise InvalidInput(f"reconcile {action} needs CHECK and SUBJECT (the violation's first id)")
    if cli.dry_run:
        cli.output.result({"dry_run": True, "action": action, "check": check, "subject": subject, "reason": reason})
        return
    cli.output.result(acks.acknowledge(cli.container, check, subject, reason or "", cli.actor,
                                       remove=action == "unack"))
