"""`billingctl subscriptions show|cancel`, and `activate`, `sync`, `sync-all`, `invalidate`."""

from __future__ import annotations

import typer

from billingctl.cli.context import command, exit_if_partial, get_ctx, noun, parse_since

app = noun("Subscriptions (the provider is the source of truth).")


def register_root_commands(root: typer.Typer) -> None:
    """The commands of this noun that sit at the top level (`billingctl poll`, `billingctl activate`)."""
    command(root, "activate")(activate)
    command(root, "sync")(sync_cmd)
    command(root, "sync-all")(sync_all_cmd)
    command(root, "invalidate")(invalidate_cmd)


@command(app, "show")
def subscriptions_show(subscription_id: str, customer: str = typer.Option(..., "--customer")):
    """The subscription as the customer's API sees it (cached; stale while the breaker is open)."""
    from billingctl.services.subscriptions import get_for_user

    cli = get_ctx()
    cli.output.result(get_for_user(cli.container, customer, subscription_id))


@command(app, "cancel")
def subscriptions_cancel(subscription_id: str, reason: str = typer.Option(..., "--reason"),
                         yes: bool = typer.Option(False, "--yes")):
    """Cancel at the provider; an errored call that took effect is a success."""
    from billingctl.domain.errors import Refused
    from billingctl.services.sync import cancel_subscription

    cli = get_ctx()
    if not yes and not cli.dry_run:
        raise Refused("cancel is destructive: add --yes (or --dry-run)")
    cli.output.result(cancel_subscription(cli.container, subscription_id, reason, cli.actor, dry_run=cli.dry_run))


def activate(subscription_id: str = typer.Argument(None, help="The subscription to activate."),
             pending: bool = typer.Option(False, "--pending", help="Retry every pending activation.")):
    """Activate a pending subscription whose payment is recorded (refused when it is not)."""
    from billingctl.domain.errors import InvalidInput
    from billingctl.services import payments

    cli = get_ctx()
    if pending:
        rows = payments.pending_activations(cli.container)
        if cli.dry_run:
            cli.output.table(rows, title="pending activations")
            return
        result = payments.retry_pending(cli.container)
        cli.output.result(result)
        exit_if_partial(result)
        return
    if not subscription_id:
        raise InvalidInput("give a SUBSCRIPTION_ID or --pending")
    result = payments.activate_subscription(cli.container, subscription_id, dry_run=cli.dry_run)
    cli.output.result(result, human=f"{subscription_id}: {result['outcome']}")


def sync_cmd(subscription_id: str):
    """Re-read one subscription from the provider and overwrite the local copy (prints the difference)."""
    from billingctl.services.sync import sync_subscription

    cli = get_ctx()
    result = sync_subscription(cli.container, subscription_id, dry_run=cli.dry_run)
    if cli.json:
        cli.output.result(result)
        return
    rows = [{"field": k, "local": v["local"], "provider": v["provider"]} for k, v in result["differences"].items()]
    if rows:
        cli.output.table(rows, title=f"{subscription_id}{' (dry run)' if cli.dry_run else ''}")
    else:
        cli.output.result(result, human=f"{subscription_id}: in step with the provider")


def sync_all_cmd(since: str = typer.Option(..., "--since", metavar="TIME",
                                           help="ISO 8601 or a span (1h, 2d): subscriptions updated since.")):
    """Sync every subscription changed since a time (resumable)."""
    from billingctl.services.sync import sync_all

    cli = get_ctx()
    if cli.dry_run:
        from billingctl.services.sync import sync_all_plan

        cli.output.result(sync_all_plan(cli.container, parse_since(since)))
        return
    with cli.output.progress("syncing subscriptions") as advance:
        result = sync_all(cli.container, parse_since(since), progress=advance)
    cli.output.result(result)
    exit_if_partial(result)


def invalidate_cmd(customer_id: str):
    """Invalidate a customer's cached data; the next read re-queries the provider."""
    from billingctl.services.subscriptions import invalidate_customer

    cli = get_ctx()
    if cli.dry_run:
        cli.output.result({"dry_run": True, "customer_id": customer_id, "would_invalidate": True})
        return
    cli.output.result(invalidate_customer(cli.container, customer_id))
