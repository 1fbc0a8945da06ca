"""`billingctl lock show|list|clear|repair|backfill-mid`: the per-lane processor lock."""

from __future__ import annotations

from typing import Literal

import typer

from billingctl.cli.context import command, get_ctx, noun

app = noun("The per-lane processor lock.")


@command(app, "show")
def lock_show(user_id: str):
    """The user's SFW and NSFW processor locks."""
    from billingctl.services.processor_lock import show

    cli = get_ctx()
    cli.output.result(show(cli.container, user_id))


@command(app, "list")
def lock_list(problem: Literal["drift", "unknown", "unlocked"] = typer.Option(..., "--problem",
              help="drift: settled on another processor of the lane than the lock; unknown: on a processor no "
                   "lane lists; unlocked: the user's lane is still unlocked."),
              since: str = typer.Option("1d", "--since", help="ISO 8601 or a span (1h, 2d): payments since.")):
    """The users behind a processor-lock alert: each recent payment with the problem, its user and lane."""
    from billingctl.cli.context import parse_since
    from billingctl.services.processor_lock import problems

    cli = get_ctx()
    rows = problems(cli.container, problem, parse_since(since))
    cli.output.table(rows, ["user_id", "lane", "locked", "settled", "payment_id", "at"],
                     title=f"processor locks: {problem}")


@command(app, "clear")
def lock_clear(user_id: str, lane: Literal["sfw", "nsfw"] = typer.Option(..., "--lane",
                                                     help="The lane."),
               reason: str = typer.Option(..., "--reason", help="Why (goes to the audit log)."),
               yes: bool = typer.Option(False, "--yes", help="Confirm.")):
    """Clear a wrong lock; refused when the user transacted successfully on the stored processor."""
    from billingctl.domain.errors import Refused
    from billingctl.services.processor_lock import clear

    cli = get_ctx()
    if not yes and not cli.dry_run:
        raise Refused("lock clear is destructive: add --yes (or --dry-run to see the plan)")
    result = clear(cli.container, user_id, lane, reason, cli.actor, dry_run=cli.dry_run)
    cli.output.result(result)


@command(app, "repair")
def lock_repair(user_id: str, lane: Literal["sfw", "nsfw"] = typer.Option(..., "--lane",
                                                      help="The lane.")):
    """Re-lock from the orchestrator's payment history (outcome locked, no_history or unavailable)."""
    from billingctl.cli.exitcodes import EXTERNAL
    from billingctl.services.processor_lock import repair

    cli = get_ctx()
    result = repair(cli.container, user_id, lane, cli.actor)
    cli.output.result(result)
    if result["outcome"] == "unavailable":
        raise typer.Exit(EXTERNAL)


@command(app, "backfill-mid")
def lock_backfill_mid():
    """Fill the NSFW merchant account of legacy NMI-type users only; never a processor column."""
    from billingctl.services.processor_lock import backfill_mid

    cli = get_ctx()
    result = backfill_mid(cli.container, cli.actor, dry_run=cli.dry_run)
    cli.output.result(result, human=f"filled {len(result['filled'])}, without history "
                                    f"{len(result['without_history'])}{' (dry run)' if cli.dry_run else ''}")
