"""`billingctl renewals run|list`: renewals and dunning."""

from __future__ import annotations

import typer

from billingctl.cli.context import command, exit_if_partial, get_ctx, noun

app = noun("Renewals and dunning.")


@command(app, "run")
def renewals_run():
    """The dunning tick: one attempt per due renewal invoice."""
    from billingctl.services.renewals import run_renewals

    cli = get_ctx()
    with cli.output.progress("renewal invoices") as advance:
        result = run_renewals(cli.container, dry_run=cli.dry_run, progress=advance)
    cli.output.result(result)
    exit_if_partial(result)


@command(app, "list")
def renewals_list(user: str = typer.Option(None, "--user"), invoice: str = typer.Option(None, "--invoice"),
                  limit: int = typer.Option(100, "--limit")):
    """Attempts, statuses, decline codes and the next attempt."""
    from billingctl.services.renewals import list_attempts

    cli = get_ctx()
    rows = list_attempts(cli.container, user, invoice, limit)
    cli.output.table(rows, ["invoice_id", "user_id", "payment_id", "attempt_no", "status", "decline_code", "processor",
                            "created_at", "next_attempt_at"], title="dunning attempts", data=rows)
