"""`billingctl users show|freeze|unfreeze`."""

from __future__ import annotations

import typer

from billingctl.cli.context import command, exit_if_partial, get_ctx, noun

app = noun("Users: credits, lane locks, frozen state.")


@command(app, "show")
def users_show(user_id: str):
    """Credits (with the ledger sum), lane locks and frozen state."""
    from billingctl.services.users import show_user

    cli = get_ctx()
    cli.output.result(show_user(cli.container, user_id))


@command(app, "freeze")
def users_freeze(user_id: str, reason: str = typer.Option(..., "--reason"),
                 void_invoices: bool = typer.Option(False, "--void-invoices", help="Void pending invoices."),
                 notify: bool = typer.Option(False, "--notify", help="Notify the user."),
                 yes: bool = typer.Option(False, "--yes")):
    """Disable further payments for a user (idempotent, audited)."""
    from billingctl.domain.errors import Refused
    from billingctl.services.users import freeze

    cli = get_ctx()
    if not yes and not cli.dry_run:
        raise Refused("freeze is destructive: add --yes (or --dry-run)")
    result = freeze(cli.container, user_id, reason, cli.actor, void_invoices=void_invoices, notify=notify,
                    dry_run=cli.dry_run)
    cli.output.result(result)
    exit_if_partial(result)  # a void the provider refused


@command(app, "unfreeze")
def users_unfreeze(user_id: str, reason: str = typer.Option(..., "--reason"), yes: bool = typer.Option(False, "--yes")):
    """Allow payments again (audited); then `orphans retry` each payment held while frozen."""
    from billingctl.domain.errors import Refused
    from billingctl.services.users import unfreeze

    cli = get_ctx()
    if not yes and not cli.dry_run:
        raise Refused("unfreeze re-enables payments: add --yes (or --dry-run)")
    cli.output.result(unfreeze(cli.container, user_id, reason, cli.actor, dry_run=cli.dry_run))
