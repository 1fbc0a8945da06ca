"""The one event inbox, unique on (source, event_id): webhooks and pollers of every source write
here, and each event is processed exactly once whichever path saw it first."""

from __future__ import annotations

from sqlalchemy import select, update

from billingctl.adapters.db.sql import insert_ignore
from billingctl.adapters.db.tables import event_inbox


def accept(uow, clock, source: str, event_id: str, event_type: str, payload: dict, occurred_at=None) -> str:
    """Store the event; returns its status ('pending' for new or unfinished work, 'processed', 'parked')."""
    insert_ignore(uow, event_inbox, {"source": source, "event_id": event_id, "event_type": event_type,
                                     "payload": payload, "occurred_at": occurred_at, "status": "pending",
                                     "received_at": clock.now()}, ["source", "event_id"])
    return uow.execute(select(event_inbox.c.status).where(
        event_inbox.c.source == source, event_inbox.c.event_id == event_id)).scalar_one()


def finish(uow, clock, source: str, event_id: str, error: str | None = None, max_attempts: int = 10) -> str:
    """Mark one processing attempt: processed, or still pending, or parked after max_attempts."""
    row = uow.execute(select(event_inbox.c.attempts).where(
        event_inbox.c.source == source, event_inbox.c.event_id == event_id)).one()
    attempts = row.attempts + 1
    status = "processed" if error is None else ("parked" if attempts >= max_attempts else "pending")
    uow.execute(update(event_inbox).where(event_inbox.c.source == source, event_inbox.c.event_id == event_id).values(
        status=status, attempts=attempts, last_error=error, processed_at=clock.now() if error is None else None))
    return status


def list_events(container, status: str | None = None, limit: int = 50) -> list[dict]:
    query = select(event_inbox.c.id, event_inbox.c.source, event_inbox.c.event_id, event_inbox.c.event_type,
                   event_inbox.c.status, event_inbox.c.attempts, event_inbox.c.last_error,
                   event_inbox.c.occurred_at).order_by(event_inbox.c.id.desc()).limit(limit)
    if status:
        query = query.where(event_inbox.c.status == status)
    with container.uow() as uow:
        return [dict(r) for r in uow.execute(query).mappings()]


def get_event(container, source: str, event_id: str) -> dict:
    from billingctl.domain.errors import NotFound

    with container.uow() as uow:
        row = uow.execute(select(event_inbox).where(event_inbox.c.source == source,
                                                    event_inbox.c.event_id == event_id)).mappings().first()
    if row is None:
        raise NotFound(f"no {source} event {event_id}")
    return dict(row)


def replay(container, source: str, event_id: str) -> dict:
    """Put a parked event back to pending and process it again (processing is idempotent)."""
    from billingctl.domain.errors import Refused

    row = get_event(container, source, event_id)
    if row["status"] == "processed":
        raise Refused(f"event {event_id} is already processed")
    if source != "provider":
        raise Refused("only provider events can be replayed from the inbox")
    with container.uow() as uow:
        uow.execute(update(event_inbox).where(event_inbox.c.id == row["id"]).values(status="pending", attempts=0))
        uow.commit()
    from billingctl.services.events import handle_event

    return {"event_id": event_id, "status": handle_event(container, row["payload"])}


def process_once(container, source: str, event_id: str, event_type: str, payload: dict, handler) -> dict:
    """Accept an event into the inbox and run `handler()` unless it was processed before.
    A handler's BillingError is kept on the inbox row (visible in `events list`) and reported."""
    import logging

    from billingctl.domain.errors import BillingError

    with container.uow() as uow:
        status = accept(uow, container.clock, source, event_id, event_type, payload)
        uow.commit()
    if status != "pending":
        return {"event_id": event_id, "outcome": "duplicate"}
    error, result = None, {}
    try:
        result = handler() or {}
    except BillingError as exc:
        error, result = exc.message, {"outcome": "failed", "error": exc.message}
        logging.getLogger("billingctl.inbox").warning("event failed; kept in the inbox: %s", exc.message,
                                                      extra={"source": source, "event_id": event_id})
    with container.uow() as uow:
        finish(uow, container.clock, source, event_id, error)
        uow.commit()
    return {"event_id": event_id, **result}
