"""The one event inbox, unique on (source, event_id), and the event poller's run log."""

from __future__ import annotations

import hashlib

from sqlalchemy import Boolean, bindparam, case, func, literal, select, update
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import ColumnElement
from sqlalchemy.sql.visitors import InternalTraversal

from billingctl.adapters.db.repository import Repository
from billingctl.adapters.db.sql import DriverStatement, insert_or_count
from billingctl.adapters.db.tables import event_inbox, event_poller_state

LISTED = (event_inbox.c.id, event_inbox.c.source, event_inbox.c.event_id, event_inbox.c.event_type,
          event_inbox.c.status, event_inbox.c.attempts, event_inbox.c.deliveries, event_inbox.c.seen_by,
          event_inbox.c.last_error, event_inbox.c.received_at)


KEY_LENGTH = event_inbox.c.event_id.type.length


def key(event_id: str) -> str:
    """The event's inbox key: its id, or, for an id longer than the column (a composed key such as a
    dispute's, whose parts are each within their own caps), a digest of it: as unique, and stable for every
    delivery of the same event."""
    if len(event_id) <= KEY_LENGTH:
        return event_id
    return f"sha256:{hashlib.sha256(event_id.encode()).hexdigest()}"


class _ListHolds(ColumnElement):
    """True when a JSON array of strings holds a value, decided by the database: the duplicate read answers
    a boolean instead of the array, so no JSON is decoded per request (issue 39 item 4: the driver's JSON
    loader was 22,000 of a duplicate webhook's instructions)."""

    type = Boolean()
    inherit_cache = True
    _traverse_internals = [("array", InternalTraversal.dp_clauseelement),
                           ("value", InternalTraversal.dp_clauseelement)]

    def __init__(self, array, value):
        self.array, self.value = array, value


@compiles(_ListHolds)
def _list_holds_sqlite(element, compiler, **kw):
    return (f"EXISTS (SELECT 1 FROM json_each({compiler.process(element.array, **kw)}) "
            f"WHERE json_each.value = {compiler.process(element.value, **kw)})")


@compiles(_ListHolds, "postgresql")
def _list_holds_postgresql(element, compiler, **kw):
    return f"(CAST({compiler.process(element.array, **kw)} AS JSONB) ? {compiler.process(element.value, **kw)})"


# The duplicate fast path's one read, built and compiled once (issue 39 item 4: no statement construction
# per request), run on the driver's cursor.
SEEN = DriverStatement(select(event_inbox.c.status, _ListHolds(event_inbox.c.seen_by, bindparam("via")).label("by_via"))
                       .where(event_inbox.c.source == bindparam("source"),
                              event_inbox.c.event_id == bindparam("event_id")))


def seen(engine, source: str, event_id: str, via: str, held=None) -> dict | None:
    """{status, by_via} of a stored event, or None: `by_via` whether path `via` delivered it before. One
    read standing alone (`engine` in autocommit, on `held`'s connection when it has one for this thread)."""
    return SEEN.first(engine, {"source": source, "event_id": key(event_id), "via": via}, held)


class Inbox(Repository):

    def accept(self, source: str, event_id: str, event_type: str, payload: dict, occurred_at, now, via: str):
        """Store the event, or count one more delivery of it, in one statement; the row's (id, status,
        seen_by) afterwards. A path delivering it for the first time is added to seen_by."""
        row = insert_or_count(self.uow, event_inbox, {
            "source": source, "event_id": key(event_id), "event_type": event_type, "payload": payload,
            "occurred_at": occurred_at, "status": "pending", "received_at": now, "seen_by": [via],
            "deliveries": 1}, ["source", "event_id"], "deliveries", ["id", "status", "seen_by"])
        seen = list(row.seen_by or [])
        if via not in seen:
            self.execute(update(event_inbox).where(event_inbox.c.id == row.id).values(seen_by=[*seen, via]))
        return row

    def finish(self, source: str, event_id: str, error: str | None, max_attempts: int | None, now) -> str:
        """One processing attempt: processed, or still pending, or parked after max_attempts (None: never, a
        failure that is an outside system's outage); the new status."""
        attempts = event_inbox.c.attempts + 1
        status = literal("processed") if error is None else literal("pending") if max_attempts is None else case(
            (attempts >= max_attempts, literal("parked")), else_=literal("pending"))
        return self.execute(update(event_inbox).where(
            event_inbox.c.source == source, event_inbox.c.event_id == key(event_id)).values(
            status=status, attempts=attempts, last_error=error, processed_at=now if error is None else None)
            .returning(event_inbox.c.status)).scalar_one()

    def listing(self, source: str | None, state: str | None, since, limit: int) -> list[dict]:
        query = select(*LISTED).order_by(event_inbox.c.id.desc()).limit(limit)
        if source:
            query = query.where(event_inbox.c.source == source)
        if state:
            query = query.where(event_inbox.c.status == state)
        if since is not None:
            query = query.where(event_inbox.c.received_at >= since)
        return [dict(r) for r in self.execute(query).mappings()]

    def get(self, inbox_id: int):
        return self.execute(select(event_inbox).where(event_inbox.c.id == inbox_id)).mappings().first()

    def reopen(self, inbox_id: int) -> None:
        self.execute(update(event_inbox).where(event_inbox.c.id == inbox_id).values(status="pending", attempts=0))

    def payload(self, inbox_id: int) -> dict:
        return self.execute(select(event_inbox.c.payload).where(event_inbox.c.id == inbox_id)).scalar_one()

    def pending_received_before(self, before, limit: int) -> list:
        return self.execute(select(event_inbox.c.id, event_inbox.c.source, event_inbox.c.event_id,
                                   event_inbox.c.event_type, event_inbox.c.attempts, event_inbox.c.received_at)
                            .where(event_inbox.c.status == "pending", event_inbox.c.received_at <= before)
                            .order_by(event_inbox.c.id).limit(limit)).mappings().all()

    def count_pending_received_before(self, before) -> int:
        return self.execute(select(func.count()).select_from(event_inbox).where(
            event_inbox.c.status == "pending", event_inbox.c.received_at <= before)).scalar_one()

    def backlog(self) -> dict:
        """Pending and parked events, and when the oldest pending one was received (the scrape)."""
        counts = dict(self.execute(select(event_inbox.c.status, func.count()).where(
            event_inbox.c.status.in_(("pending", "parked"))).group_by(event_inbox.c.status)).all())
        oldest = self.execute(select(func.min(event_inbox.c.received_at)).where(
            event_inbox.c.status == "pending")).scalar()
        return {"pending": int(counts.get("pending", 0)), "parked": int(counts.get("parked", 0)),
                "oldest_pending": oldest}

    def count_parked(self) -> int:
        return self.execute(select(func.count()).select_from(event_inbox).where(
            event_inbox.c.status == "parked")).scalar_one()


class PollerRuns(Repository):
    def add(self, **values) -> None:
        self.execute(event_poller_state.insert().values(**values))

    def newest(self):
        """(id, created_at) of the newest run, or None."""
        return self.execute(select(event_poller_state.c.id, event_poller_state.c.created_at)
                            .order_by(event_poller_state.c.created_at.desc()).limit(1)).first()
