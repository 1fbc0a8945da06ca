"""The one event inbox, unique on (source, event_id): webhooks and pollers of every source write
here, and each event is processed exactly once whichever path saw it first."""

from __future__ import annotations

from datetime import timedelta

from billingctl.adapters.db.inbox import seen

# A pending event nobody finished (its request was cut by a database outage or a kill, or its handler
# failed and no redelivery came) is re-driven by the poll job: first after REDRIVE_AFTER, then with the
# wait doubling per failed attempt, counted from when it was received.
REDRIVE_AFTER = timedelta(minutes=2)
REDRIVE_BATCH = 50


def finished_duplicate(container, source: str, event_id: str, via: str) -> str | None:
    """The duplicate fast path, one read before any lock or transaction: the event's status when it is
    finished and this path has delivered it before (nothing is left to do or count), else None. (No
    import inside: one costs a duplicate webhook about 7,000 instructions, issue 39 item 4.)"""
    row = seen(container.autocommit_engine, source, event_id, via, container.held_read)
    if row is not None and row["status"] != "pending" and row["by_via"]:
        return row["status"]
    return None


def accept(uow, clock, source: str, event_id: str, event_type: str, payload: dict, occurred_at=None,
           via: str = "webhook") -> str:
    """Store the event, or count one more delivery of it, in one statement; returns its status:
    'pending' for new or unfinished work, 'processed', 'parked'. (A repeat of a finished event by a path
    already recorded never gets here: `finished_duplicate` answers it with one read, so `deliveries`
    counts deliveries until the event is finished, plus the first one from each path.)"""
    return uow.inbox.accept(source, event_id, event_type, payload, occurred_at, clock.now(), via).status


def finish(uow, clock, source: str, event_id: str, error: str | None = None, max_attempts: int | None = 10) -> str:
    """Mark one processing attempt: processed, or still pending, or parked after max_attempts (None: an
    outage's failure, which never parks)."""
    return uow.inbox.finish(source, event_id, error, max_attempts, clock.now())


def list_events(container, source: str | None = None, state: str | None = None, since=None,
                limit: int = 50) -> list[dict]:
    with container.uow() as uow:
        return uow.inbox.listing(source, state, since, limit)


def get_event(container, inbox_id: int) -> dict:
    from billingctl.domain.errors import NotFound

    with container.uow() as uow:
        row = uow.inbox.get(inbox_id)
    if row is None:
        raise NotFound(f"no inbox event {inbox_id}")
    return dict(row)


def reopen(container, inbox_id: int, actor: str, reason: str, details: dict) -> None:
    """Make a stored event pending again for a replay, audited in the same transaction."""
    with container.uow() as uow:
        uow.inbox.reopen(inbox_id)
        uow.audit.record(actor, "events.replay", f"{details['source']}:{details['event_id']}", reason, details,
                         container.clock.now())
        uow.commit()


def payload_of(container, inbox_id: int) -> dict:
    with container.uow(autocommit=True) as uow:
        return uow.inbox.payload(inbox_id)


def duplicate_answer(event_id: str) -> dict:
    return {"event_id": event_id, "outcome": "duplicate"}


def process_once(container, source: str, event_id: str, event_type: str, payload: dict, handler,
                 via: str = "webhook", duplicate_read: bool = True) -> dict:
    """Accept an event into the inbox and run `handler()` unless it was processed before.
    A handler's BillingError is kept on the inbox row (visible in `events list`) and reported."""
    import logging

    from billingctl.domain.errors import BillingError

    if receive(container, source, event_id, event_type, payload, via=via, duplicate_read=duplicate_read) != "pending":
        return duplicate_answer(event_id)
    from billingctl.domain.errors import outage

    error, result, down = None, {}, False
    try:
        result = handler() or {}
    except BillingError as exc:
        error, result, down = exc.message, {"outcome": "failed", "error": exc.message}, outage(exc)
        logging.getLogger("billingctl.inbox").warning("event failed; kept in the inbox: %s", exc.message,
                                                      extra={"source": source, "event_id": event_id})
    except Exception as exc:
        # Count the attempt if the database lets us (it may be what failed), then let the caller answer.
        try:
            _finish_and_alert(container, source, event_id, event_type, f"{type(exc).__name__}: {exc}")
        except Exception as finish_exc:
            logging.getLogger("billingctl.inbox").warning(
                "event attempt not counted: %s", type(finish_exc).__name__, extra={"event_id": event_id})
        raise
    _finish_and_alert(container, source, event_id, event_type, error, down)
    return {"event_id": event_id, **result}


def stale_pending(container, now=None) -> list[dict]:
    """Pending events old enough to be re-driven, oldest first."""
    now = now or container.clock.now()
    with container.uow() as uow:
        rows = uow.inbox.pending_received_before(now - REDRIVE_AFTER, REDRIVE_BATCH * 4)
    return [dict(r) for r in rows if r["received_at"] + REDRIVE_AFTER * 2 ** min(r["attempts"], 12) <= now]


def count_stale_pending(container) -> int:
    with container.uow() as uow:
        return uow.inbox.count_pending_received_before(container.clock.now() - REDRIVE_AFTER)


def _finish_and_alert(container, source: str, event_id: str, event_type: str, error: str | None,
                      outage: bool = False) -> None:
    record_attempt(container, source, event_id, error, f"Inbox event {source}:{event_id} ({event_type}) parked "
                   "after repeated failures - manual review required", outage=outage)


def receive(container, source: str, event_id: str, event_type: str, payload: dict, occurred_at=None,
            via: str = "webhook", duplicate_read: bool = True) -> str:
    """Every event source's way in: the duplicate fast path (one read; not again when the caller has just
    made it), else the inbox row (one statement, standing alone). Returns the status; only 'pending' has
    work to do."""
    seen = finished_duplicate(container, source, event_id, via) if duplicate_read else None
    if seen is not None:
        return seen
    with container.uow(autocommit=True) as uow:
        return accept(uow, container.clock, source, event_id, event_type, payload, occurred_at, via=via)


def record_attempt(container, source: str, event_id: str, error: str | None, parked_text: str,
                   max_attempts: int = 10, outage: bool = False) -> str:
    """Count one processing attempt. A success is one statement; a failure that parks the event raises
    its chat alert in the same transaction, so a parked event is never silent. A failure that is an outside
    system's outage never parks (decision 216): the event stays pending, the poll re-drives it until the
    outage ends, and one pending over 15 minutes pages (EventsParked)."""
    from billingctl.services import alerts

    if outage:
        max_attempts = None

    if error is None:
        with container.uow(autocommit=True) as uow:
            return finish(uow, container.clock, source, event_id, None, max_attempts)
    with container.uow() as uow:
        status = finish(uow, container.clock, source, event_id, error, max_attempts)
        if status == "parked":
            alerts.raise_alert(uow, container.clock, parked_text, f"parked:{source}:{event_id}", error=error[:200])
        uow.commit()
    return status
