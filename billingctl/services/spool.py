"""Authenticated webhooks the database could not take, kept on local disk until it can (decision 208).

Primer retries a webhook that gets no 2xx answer "up to 5 times with increasing delays" (about 10 s, 60 s,
5, 10 and 15 minutes) and then drops it for good; it lists no refunds and no disputes. A database outage
longer than about 31 minutes therefore lost every refund and dispute notification sent during it (the
settled payments are found again by the poller; a chargeback nowhere). So a webhook that passed its
authentication and its checks and then met an unavailable database is written here (one file, written
whole and renamed into place, so a crash never leaves half of one) and answered 202; the event poll
dispatches each spooled event through the one `dispatch` once the database answers (the inbox makes a
second delivery of it a duplicate), oldest first, and deletes its file. An empty `webhook_spool_dir`
turns this off (the answer is then 503, as before)."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path

log = logging.getLogger("billingctl.spool")
SUFFIX, TAKEN, FAILED = ".json", ".taken", ".failed"
TAKEN_STALE_SECONDS = 600  # a file a drain took and never finished (its process died): taken again after this


def spool(directory: str, source: str, event_type: str, payload: dict, event_id: str | None) -> str:
    """Write one event to the spool, durably; returns its file name."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{time.time_ns():020d}-{uuid.uuid4().hex}"
    body = json.dumps({"source": source, "event_type": event_type, "payload": payload, "event_id": event_id})
    partial = folder / f".{name}.tmp"
    with open(partial, "wb") as out:
        out.write(body.encode())
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, folder / f"{name}{SUFFIX}")
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)  # the rename itself survives a crash
    finally:
        os.close(descriptor)
    return name + SUFFIX


def _folder(directory: str) -> Path | None:
    """The spool's folder, or None when the spool is off or nothing was ever spooled."""
    folder = Path(directory) if directory else None
    return folder if folder is not None and folder.is_dir() else None


def overdue(directory: str, after_seconds: int = 300) -> dict:
    """What `billingctl health` shows: files waiting, those older than `after_seconds`, those failed."""
    if (folder := _folder(directory)) is None:
        return {"waiting": 0, "late": 0, "failed": 0}
    now, files = time.time(), [p for p in folder.iterdir() if p.suffix in (SUFFIX, TAKEN, FAILED)]
    return {"waiting": len(files), "late": sum(1 for p in files if now - p.stat().st_mtime > after_seconds),
            "failed": sum(1 for p in files if p.suffix == FAILED)}


def _due(folder: Path) -> list[Path]:
    now = time.time()
    return sorted(p for p in folder.iterdir() if p.suffix == SUFFIX or (
        p.suffix == TAKEN and now - p.stat().st_mtime > TAKEN_STALE_SECONDS))


def drain(container, limit: int = 500) -> dict:
    """Dispatch spooled events, oldest first, each taken by one process (a rename), its file deleted once
    dispatched. A database still away stops the run: that file and the rest wait for the next one. Any
    other failure keeps the file as `.failed` for a person (counted in `waiting`, logged as an error)."""
    directory = container.settings.webhook_spool_dir
    if (folder := _folder(directory)) is None:
        return {"dispatched": 0, "waiting": 0}
    if not (due := _due(folder)):  # nothing to dispatch: no import of the handlers (a lease-held run's case)
        return {"dispatched": 0, "waiting": overdue(directory)["waiting"]}
    from billingctl.domain.errors import is_database_outage
    from billingctl.services.webhook_events import dispatch

    dispatched = 0
    for path in due[:limit]:
        taken = path.with_suffix(TAKEN)
        try:
            os.rename(path, taken)
            os.utime(taken)
        except FileNotFoundError:
            continue  # another process took it
        try:
            event = json.loads(taken.read_bytes())
            dispatch(container, event["source"], event["event_type"], event["payload"], event_id=event["event_id"])
        except Exception as exc:
            if is_database_outage(exc):
                os.rename(taken, taken.with_suffix(SUFFIX))
                log.warning("spooled webhook not dispatched yet: %s", type(getattr(exc, "orig", None) or exc).__name__)
                break
            os.rename(taken, taken.with_suffix(FAILED))
            log.error("spooled webhook failed; kept for review: %s", type(exc).__name__, extra={"file": path.name})
            continue
        taken.unlink()
        dispatched += 1
    return {"dispatched": dispatched, "waiting": overdue(directory)["waiting"]}
