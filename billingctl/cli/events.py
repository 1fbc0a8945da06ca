"""`billingctl events list|show|replay` (the inbox of every source) and `billingctl poll`."""

from __future__ import annotations

from typing import Literal

import typer

from billingctl.cli.context import command, exit_if_partial, get_ctx, noun, parse_since

Source = Literal["orchestrator", "provider", "workflow", "idv", "identity"]
InboxState = Literal["pending", "processed", "parked"]

app = noun("The event inbox (every source).")


def register_root_commands(root: typer.Typer) -> None:
    """The commands of this noun that sit at the top level (`billingctl poll`, `billingctl activate`)."""
    command(root, "poll")(poll_cmd)


@command(app, "list")
def events_list(source: Source = typer.Option(None, "--source", help="The event source."),
                state: InboxState = typer.Option(None, "--state",
                                          help="The inbox state."),
                since: str = typer.Option(None, "--since", help="ISO 8601 or a span (1h, 2d): received since."),
                limit: int = typer.Option(50, "--limit")):
    """The inbox of every source, newest first."""
    from billingctl.services.inbox import list_events

    cli = get_ctx()
    rows = list_events(cli.container, source, state, parse_since(since), limit)
    cli.output.table(rows, ["id", "received_at", "source", "event_id", "event_type", "status", "attempts",
                            "deliveries", "seen_by",
                            "last_error"], title="event inbox", data=rows)


@command(app, "show")
def events_show(inbox_id: int = typer.Argument(..., metavar="ID")):
    """One event: payload, deliveries (by webhook, poller, replay), processing attempts and errors."""
    from billingctl.services.inbox import get_event

    cli = get_ctx()
    cli.output.result(get_event(cli.container, inbox_id))


@command(app, "replay")
def events_replay(inbox_id: int = typer.Argument(..., metavar="ID"), reason: str = typer.Option(..., "--reason"),
                  yes: bool = typer.Option(False, "--yes")):
    """Reprocess one stored event through its normal path (a no-op where it already took effect)."""
    from billingctl.domain.errors import Refused
    from billingctl.services.webhook_events import replay

    cli = get_ctx()
    if not yes and not cli.dry_run:
        raise Refused("replay changes state: add --yes (or --dry-run)")
    cli.output.result(replay(cli.container, inbox_id, reason, cli.actor, dry_run=cli.dry_run))


def poll_cmd(all_invoices: bool = typer.Option(False, "--all-invoices", help="Also scan paid invoices."),
             since: str = typer.Option(None, "--since", metavar="TIME",
                                       help="ISO 8601 or a span (1h, 2d): read from here, not the cursor."),
             watchdog: bool = typer.Option(False, "--watchdog", help="Only check the poller's freshness.")):
    """Process the provider's events after the cursor (the 15-second job)."""
    from billingctl.cli.exitcodes import REFUSED
    from billingctl.services import events

    cli = get_ctx()
    if cli.dry_run:
        cli.output.result({"dry_run": True, "cursor": events._read_cursor(cli.container),
                           "overlap_seconds": events.OVERLAP.total_seconds(), "all_invoices": all_invoices,
                           "since": parse_since(since), "freshness": events.poller_freshness(cli.container)})
        return
    if watchdog:
        fresh = events.watchdog(cli.container)
        cli.output.result(fresh)
        if fresh["stale"]:
            raise typer.Exit(REFUSED)
        return
    with cli.output.progress("polling events") as advance:
        result = events.poll(cli.container, all_invoices=all_invoices, since=parse_since(since),
                             progress=advance)
    cli.output.result(result)
    exit_if_partial(result)
