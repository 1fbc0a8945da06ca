"""`billingctl db`: migrations."""

from __future__ import annotations

import typer

from billingctl.cli.context import command, get_ctx, noun

app = noun("Database schema.")


@command(app, "upgrade")
def upgrade(revision: str = typer.Argument("head", help="Target revision.")):
    """Apply the Alembic migrations (safe to re-run)."""
    from billingctl.adapters.db.engine import make_engine, redact
    from billingctl.adapters.db.migrate import current_revision, head_revision
    from billingctl.adapters.db.migrate import upgrade as run_upgrade

    cli = get_ctx()
    settings = cli.container.settings
    engine = make_engine(settings.database_url)
    try:
        if cli.dry_run:
            current = current_revision(engine)
            head = head_revision()
            cli.output.result(
                {"database": redact(settings.database_url), "current": current, "target": head,
                 "dry_run": True, "would_change": current != head},
                human=f"would upgrade {current or 'empty'} -> {head}" if current != head else "already at head",
            )
            return
        before, after = run_upgrade(engine, revision)
    finally:
        engine.dispose()
    cli.output.result(
        {"database": redact(settings.database_url), "before": before, "after": after, "changed": before != after},
        human=f"database at {after} (was {before or 'empty'})",
    )


@command(app, "current")
def current():
    """Show the current and head revisions."""
    from billingctl.adapters.db.engine import make_engine
    from billingctl.adapters.db.migrate import current_revision, head_revision

    cli = get_ctx()
    engine = make_engine(cli.container.settings.database_url)
    try:
        cur, head = current_revision(engine), head_revision()
    finally:
        engine.dispose()
    cli.output.result({"current": cur, "head": head, "up_to_date": cur == head})


@command(app, "prune")
def prune_cmd():
    """Prune what grows for ever: old poller runs, payloads of processed inbox events, delivered outbox
    messages and old audit rows (BILLING_RETENTION_* settings). Example: billingctl --dry-run db prune"""
    from billingctl.services.retention import prune

    cli = get_ctx()
    cli.output.result(prune(cli.container, dry_run=cli.dry_run))
