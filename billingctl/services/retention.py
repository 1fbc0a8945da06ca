"""Retention: what grows for ever without it (issue "Performance" 7). Run daily by the `prune` job and
by `billingctl db prune`. Nothing that exactly-once depends on is deleted: inbox rows stay (their keys
make a replay a no-op), only the payloads of long-processed events are emptied."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import Text, delete, func, select, update

from billingctl.adapters.db.tables import alert_outbox, audit_log, event_inbox, event_poller_state
from billingctl.domain.batch import BatchResult


def _targets(container):
    s, now = container.settings, container.clock.now()
    return {
        "poller_runs": (event_poller_state, event_poller_state.c.created_at < now - timedelta(
            days=s.retention_poller_runs_days)),
        "inbox_payloads": (event_inbox, (event_inbox.c.status == "processed") & (
            event_inbox.c.processed_at < now - timedelta(days=s.retention_inbox_payload_days))),
        "delivered_outbox": (alert_outbox, (alert_outbox.c.status == "delivered") & (
            alert_outbox.c.delivered_at < now - timedelta(days=s.retention_outbox_days))),
        "audit_log": (audit_log, audit_log.c.created_at < now - timedelta(days=s.retention_audit_days)),
    }


def prune(container, dry_run: bool = False) -> dict:
    counts = {}
    with container.uow() as uow:
        for name, (table, old) in _targets(container).items():
            if name == "inbox_payloads":
                old = old & (func.coalesce(func.length(func.cast(table.c.payload, Text())), 0) > 2)  # not yet {}
            counts[name] = uow.execute(select(func.count()).select_from(table).where(old)).scalar_one()
            if dry_run or not counts[name]:
                continue
            if name == "inbox_payloads":
                uow.execute(update(table).where(old).values(payload={}))
            else:
                uow.execute(delete(table).where(old))
        if not dry_run:
            uow.commit()
    return BatchResult({"dry_run": dry_run, **({"would_prune": counts} if dry_run else {"pruned": counts})},
                       done=0 if dry_run else sum(counts.values()))

