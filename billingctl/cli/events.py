"""`billingctl poll`, `sync`, `sync-all`, `invalidate`, `subscriptions …`, `events …`."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import typer

from billingctl.cli.context import command, get_ctx

subscriptions_app = typer.Typer(help="Subscriptions (the provider is the source of truth).",
                  no_args_is_help=True, rich_markup_mode=None)
events_app = typer.Typer(help="The event inbox (every source).",
                  no_args_is_help=True, rich_markup_mode=None)

Source = Literal["orchestrator", "provider", "workflow", "idv", "identity"]
InboxState = Literal["pending", "processed", "parked"]


_RELATIVE = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _parse_since(value: str | None) -> datetime | None:
    """An ISO 8601 time, or a span back from now: `90s`, `15m`, `1h`, `2d`, `1w`."""
    import re
    from datetime import UTC, timedelta

    from billingctl.domain.errors import InvalidInput
    from billingctl.services.payments import parse_time

    if not value:
        return None
    relative = re.fullmatch(r"([0-9]{1,6})([smhdw])", value.strip())
    if relative:
        return datetime.now(UTC) - timedelta(seconds=int(relative.group(1)) * _RELATIVE[relative.group(2)])
    try:
        return parse_time(value)
    except (ValueError, OverflowError, OSError):
        raise InvalidInput(f"--since must be an ISO 8601 time or a span like 1h or 2d, not {value!r}") from None


def _progress(label: str, total: int | None = None):
    from billingctl.cli.output import progress

    return progress(label, total)


def register(app: typer.Typer) -> None:
    app.add_typer(subscriptions_app, name="subscriptions")
    app.add_typer(events_app, name="events")

    @command(app, "poll")
    def poll_cmd(all_invoices: bool = typer.Option(False, "--all-invoices", help="Also scan paid invoices."),
                 since: str = typer.Option(None, "--since", metavar="TIME",
                                           help="ISO 8601 or a span (1h, 2d): read from here, not the cursor."),
                 watchdog: bool = typer.Option(False, "--watchdog", help="Only check the poller's freshness.")):
        """Process the provider's events after the cursor (the 15-second job)."""
        from billingctl.cli.exitcodes import PARTIAL, REFUSED
        from billingctl.services import events

        cli = get_ctx()
        if cli.dry_run:
            cli.output.result({"dry_run": True, "cursor": events._read_cursor(cli.container),
                               "overlap_seconds": events.OVERLAP.total_seconds(), "all_invoices": all_invoices,
                               "since": _parse_since(since), "freshness": events.poller_freshness(cli.container)})
            return
        if watchdog:
            fresh = events.watchdog(cli.container)
            cli.output.result(fresh)
            if fresh["stale"]:
                raise typer.Exit(REFUSED)
            return
        with _progress("polling events") as progress:
            result = events.poll(cli.container, all_invoices=all_invoices, since=_parse_since(since),
                                 progress=progress)
        cli.output.result(result)
        if result["events_failed"]:
            raise typer.Exit(PARTIAL)

    @command(app, "sync")
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

    @command(app, "sync-all")
    def sync_all_cmd(since: str = typer.Option(..., "--since", metavar="TIME",
                                               help="ISO 8601 or a span (1h, 2d): subscriptions updated since.")):
        """Sync every subscription changed since a time (resumable)."""
        from billingctl.cli.exitcodes import PARTIAL
        from billingctl.services.sync import sync_all

        cli = get_ctx()
        if cli.dry_run:
            from billingctl.services.sync import sync_all_plan

            cli.output.result(sync_all_plan(cli.container, _parse_since(since)))
            return
        with _progress("syncing subscriptions") as progress:
            result = sync_all(cli.container, _parse_since(since), progress=progress)
        cli.output.result(result)
        if result["failed"]:
            raise typer.Exit(PARTIAL)

    @command(app, "invalidate")
    def invalidate_cmd(customer_id: str):
        """Invalidate a customer's cached data; the next read re-queries the provider."""
        from billingctl.services.subscriptions import invalidate_customer

        cli = get_ctx()
        if cli.dry_run:
            cli.output.result({"dry_run": True, "customer_id": customer_id, "would_invalidate": True})
            return
        cli.output.result(invalidate_customer(cli.container, customer_id))


@command(subscriptions_app, "show")
def subscriptions_show(subscription_id: str, customer: str = typer.Option(..., "--customer")):
    """The subscription as the customer's API sees it (cached; stale while the breaker is open)."""
    from billingctl.services.subscriptions import get_for_user

    cli = get_ctx()
    cli.output.result(get_for_user(cli.container, customer, subscription_id))


@command(subscriptions_app, "cancel")
def subscriptions_cancel(subscription_id: str, reason: str = typer.Option(..., "--reason"),
                         yes: bool = typer.Option(False, "--yes")):
    """Cancel at the provider; an errored call that took effect is a success."""
    from billingctl.domain.errors import Refused
    from billingctl.services.sync import cancel_subscription

    cli = get_ctx()
    if not yes and not cli.dry_run:
        raise Refused("cancel is destructive: add --yes (or --dry-run)")
    cli.output.result(cancel_subscription(cli.container, subscription_id, reason, cli.actor, dry_run=cli.dry_run))


@command(events_app, "list")
def events_list(source: Source = typer.Option(None, "--source", help="The event source."),
                state: InboxState = typer.Option(None, "--state",
                                          help="The inbox state."),
                since: str = typer.Option(None, "--since", help="ISO 8601 or a span (1h, 2d): received since."),
                limit: int = typer.Option(50, "--limit")):
    """The inbox of every source, newest first."""
    from billingctl.services.inbox import list_events

    cli = get_ctx()
    rows = list_events(cli.container, source, state, _parse_since(since), limit)
    cli.output.table(rows, ["id", "received_at", "source", "event_id", "event_type", "status", "attempts",
                            "deliveries", "seen_by",
                            "last_error"], title="event inbox", data=rows)


@command(events_app, "show")
def events_show(inbox_id: int = typer.Argument(..., metavar="ID")):
    """One event: payload, deliveries (by webhook, poller, replay), processing attempts and errors."""
    from billingctl.services.inbox import get_event

    cli = get_ctx()
    cli.output.result(get_event(cli.container, inbox_id))


@command(events_app, "replay")
def events_replay(inbox_id: int = typer.Argument(..., metavar="ID"), reason: str = typer.Option(..., "--reason"),
                  yes: bool = typer.Option(False, "--yes")):
    """Reprocess one stored event through its normal path (a no-op where it already took effect)."""
    from billingctl.domain.errors import Refused
    from billingctl.services.inbox import replay

    cli = get_ctx()
    if not yes and not cli.dry_run:
        raise Refused("replay changes state: add --yes (or --dry-run)")
    cli.output.result(replay(cli.container, inbox_id, reason, cli.actor, dry_run=cli.dry_run))
