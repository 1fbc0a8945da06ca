"""Alerts, user notifications and analytics events through one outbox: enqueued in the caller's
transaction (deduplicated on a key), delivered by `deliver_outbox` with retries, never lost when a
sink is down; a sink without a URL keeps its messages pending and logged."""

from __future__ import annotations

import hashlib
import json
import logging
from datetime import timedelta

from billingctl.adapters.sinks import SINK_SETTINGS, HttpSink, chat_message
from billingctl.domain.batch import BatchResult
from billingctl.domain.errors import InvalidInput

log = logging.getLogger("billingctl.alerts")

CLAIM_SECONDS = 60
MAX_BACKOFF_SECONDS = 1800


def _key(sink: str, payload: dict) -> str:
    return f"{sink}:" + hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def enqueue(uow, clock, sink: str, payload: dict, dedupe_key: str | None = None) -> bool:
    """Queue one message; True when new, False when its dedupe key was already queued."""
    row = outbox_row(clock, sink, payload, dedupe_key)
    inserted = uow.outbox.add(row)
    logged(row, inserted)
    return inserted


def outbox_row(clock, sink: str, payload: dict, dedupe_key: str | None = None) -> dict:
    """The outbox row of one message, for a caller that writes it together with its own rows (`logged` once
    written)."""
    if sink not in SINK_SETTINGS:
        raise InvalidInput(f"unknown sink {sink!r}")
    return {"sink": sink, "dedupe_key": dedupe_key or _key(sink, payload), "payload": payload, "status": "pending",
            "created_at": clock.now()}


def logged(row: dict, inserted: bool) -> None:
    sink, payload = row["sink"], row["payload"]
    log.log(logging.WARNING if sink == "chat" and inserted else logging.INFO,
            "outbox %s: %s", sink, payload.get("text") or payload.get("message") or payload.get("event", ""),
            extra={"sink": sink, "dedupe_key": row["dedupe_key"], "new": inserted})


def raise_alert(uow, clock, text: str, dedupe_key: str | None = None, **fields) -> bool:
    return enqueue(uow, clock, "chat", chat_message(text, **fields), dedupe_key)


def raise_alert_every(uow, clock, text: str, family: str, period: timedelta, **fields) -> bool:
    """A chat alert for a condition that lasts: at most one in any `period` (a rolling window, so an outage
    that starts before midnight pages once, not once on each side of it)."""
    now = clock.now()
    last = uow.outbox.newest_created(f"{family}:")
    if last is not None and now - last < period:
        log.info("outbox chat (paged %s ago): %s", now - last, text, extra={"sink": "chat", "family": family})
        return False
    return raise_alert(uow, clock, text, f"{family}:{now.isoformat()}", **fields)


def send_alert(container, message: str, user_id: str | None = None, dedupe_key: str | None = None) -> dict:
    """POST /internal/notifications/alert and `billingctl alerts send`: a chat alert, or a user
    notification when a user is named. Queued, then one delivery attempt."""
    message = (message or "").strip()
    if not message:
        raise InvalidInput("message is required")
    with container.uow() as uow:
        if user_id:
            new = enqueue(uow, container.clock, "notify", {"user_id": user_id, "message": message}, dedupe_key)
        else:
            new = raise_alert(uow, container.clock, message, dedupe_key)
        uow.commit()
    delivery = deliver_outbox(container)
    return {"queued": new, "sink": "notify" if user_id else "chat", "delivery": delivery}


def deliver_outbox(container, limit: int = 100) -> dict:
    """Deliver what is due. A claim (conditional update) keeps two runners from sending one message."""
    now = container.clock.now()
    sinks = {name: HttpSink(name, getattr(container.settings, attr)) for name, attr in SINK_SETTINGS.items()}
    # Only deliverable rows are taken: messages for a sink with no URL never starve the others.
    configured = [name for name, sink in sinks.items() if sink.configured]
    with container.uow() as uow:
        rows = uow.outbox.due(now, configured, limit)
        unconfigured = uow.outbox.count_due_elsewhere(now, configured)
    result = {"delivered": 0, "failed": 0, "unconfigured": unconfigured}
    for row in rows:
        sink = sinks[row["sink"]]
        with container.uow() as uow:
            claimed = uow.outbox.claim(row, now, now + timedelta(seconds=CLAIM_SECONDS))
            uow.commit()
        if not claimed:
            continue
        try:
            sink.send(row["payload"], row["dedupe_key"])
        except Exception as exc:
            backoff = min(MAX_BACKOFF_SECONDS, 30 * 2 ** row["attempts"])
            with container.uow() as uow:
                uow.outbox.retry_at(row["id"], str(exc), now + timedelta(seconds=backoff))
                uow.commit()
            result["failed"] += 1
            log.warning("outbox delivery failed: %s", exc, extra={"sink": row["sink"], "dedupe_key": row["dedupe_key"]})
            continue
        with container.uow() as uow:
            uow.outbox.delivered(row["id"], container.clock.now())
            uow.commit()
        result["delivered"] += 1
    with container.uow() as uow:
        result["pending"] = uow.outbox.count_undelivered()
    return BatchResult(result, done=result["delivered"], failed=result["failed"])


def list_outbox(container, status: str | None = None, limit: int = 50) -> list[dict]:
    with container.uow() as uow:
        return uow.outbox.listing(status, limit)
