"""The event poller (spec sections 1, 4 and 6 "Polling").

Events from the provider arrive by the poller and by the provider's webhook; both go into the one
inbox (unique on source and event id) and through `provider_events.process_event`, so each is processed
exactly once whichever path saw it first. The cursor never passes an event that failed; an event that keeps
failing is parked with a chat alert, so it neither blocks the poller nor disappears."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from billingctl.adapters.logs import item_failed
from billingctl.adapters.payloads import EventContent
from billingctl.domain import errors as e
from billingctl.domain.batch import BatchResult
from billingctl.domain.clock import parse_time
from billingctl.services import alerts, spool, webhook_events
from billingctl.services.cursors import read_value, write_value

log = logging.getLogger("billingctl.events")

CURSOR = "provider_events"
# Events with equal or late timestamps are re-read this far behind the cursor; the inbox skips what
# was already processed. Four poll intervals: wide enough for late events, narrow enough that an idle
# poll stays one request (fewer than 100 events in the window).
OVERLAP = timedelta(seconds=60)
STALE_AFTER = timedelta(minutes=5)


def _read_cursor(container) -> datetime | None:
    value = read_value(container, CURSOR)
    return datetime.fromtimestamp(int(value), UTC) if value else None


def _write_cursor(container, when: datetime) -> None:
    write_value(container, CURSOR, str(int(when.timestamp())))


def poll(container, all_invoices: bool = False, since: datetime | None = None, progress=None) -> dict:
    """One poller run: events after the cursor (minus the overlap), then optionally the invoice scan."""
    cursor = _read_cursor(container)
    start = since or (cursor - OVERLAP if cursor else None)
    seen = processed = failed = 0
    new_cursor, blocked, error, budget_spent = cursor, False, None, False
    try:
        offset = None
        while True:
            events, offset = container.provider.events_page(start, offset)
            seen += len(events)
            container.metrics.events_polled.inc(len(events))
            for event in events:
                # The handlers (every payment service) load with the first event: an idle run, most of
                # them, loads none (issue 39 item 5).
                from billingctl.services.provider_events import handle_event

                status = handle_event(container, event)
                occurred = parse_time(event.occurred_at)
                if status == "pending":
                    failed += 1
                    blocked = True  # the cursor stays behind the first event still to retry
                else:
                    processed += 1
                    if not blocked and occurred and (new_cursor is None or occurred > new_cursor):
                        new_cursor = occurred
                if progress:
                    progress(1)
            if not offset:
                break
    except e.RateLimited as exc:
        if not exc.details.get("client_side"):
            error = exc.message
        else:
            # Our share of the provider budget is spent: stop here, keep what was done, resume next run.
            budget_spent = True
            log.info("poll paused: the batch share of the provider budget is spent; the next run resumes",
                     extra={"events_processed": processed})
    except e.ExternalError as exc:
        error = exc.message
        log.warning("poll stopped: %s", exc.message)
    if new_cursor is not None and new_cursor != cursor and since is None:
        _write_cursor(container, new_cursor)
    # Spec 4: every paid invoice with all_invoices, else only the recent ones since the given time (the
    # scheduled poll gives none: its events cover it, and a list call every 15 s would spend the budget).
    scan = scan_paid_invoices(container, since) if (all_invoices or since is not None) and error is None \
        and not budget_spent else None
    spooled = spool.drain(container)  # webhooks kept on disk while the database was away (decision 208)
    redriven = webhook_events.redrive(container)  # events of every source that a cut request left pending
    with container.uow() as uow:
        uow.poller_runs.add(
            created_at=container.clock.now(), events_seen=seen, events_processed=processed, events_failed=failed,
            cursor=str(int(new_cursor.timestamp())) if new_cursor else None, error=error)
        uow.commit()
    container.metrics.poller_last_run.set(container.clock.now().timestamp())
    result = {"events_seen": seen, "events_processed": processed, "events_failed": failed,
              "cursor": new_cursor, "error": error, "inbox": redriven, "spool": spooled,
              "budget_spent": budget_spent}
    if scan is not None:
        result["invoice_scan"] = scan
    result = BatchResult(result, done=processed, failed=failed, skipped=seen - processed - failed)
    if error:
        raise e.ExternalError(f"poll incomplete: {error}", result=result)
    return result


def scan_paid_invoices(container, since: datetime | None) -> dict:
    """--all-invoices: paid invoices whose credits were never applied are recorded now."""
    from billingctl.services.provider_events import record_reported_payment

    checked = recovered = 0
    failures = []
    for remote in container.provider.list_invoices(status="paid", updated_after=since):
        checked += 1
        with container.uow() as uow:
            if uow.purchases.paying_invoice(remote.id) is not None:
                continue
        for link in remote.linked_payments:
            # The invoice links its transactions by id; the orchestrator payment id is the
            # transaction's reference number.
            if not link.txn_id:
                continue
            try:
                txn = container.provider.get_transaction(link.txn_id)
                reference = txn.payment_reference()
                if not reference or (txn.type or "payment") != "payment":
                    continue
                recorded = record_reported_payment(container, reference,
                                                   EventContent(invoice=remote, transaction=txn), "invoice_scan")
                if recorded["outcome"] == "recorded":
                    recovered += 1
            except Exception as exc:  # one invoice never stops the scan (issue 37): counted, logged, next
                item_failed(log, "invoice scan", exc, invoice_id=remote.id)
                failures.append({"invoice_id": remote.id,
                                 "error": exc.message if isinstance(exc, e.BillingError) else type(exc).__name__})
    return {"invoices_checked": checked, "recovered": recovered, "failed": failures}


# ---- the watchdog ---------------------------------------------------------------------------------

def poller_freshness(container) -> dict:
    with container.uow() as uow:
        row = uow.poller_runs.newest()
        parked = uow.inbox.count_parked()
    if row is None:
        return {"newest_run_at": None, "age_seconds": None, "stale": True, "parked_events": parked}
    age = (container.clock.now() - row.created_at).total_seconds()
    return {"newest_run_at": row.created_at, "age_seconds": round(age, 1), "stale": age > STALE_AFTER.total_seconds(),
            "run_id": row.id, "parked_events": parked}


def watchdog(container) -> dict:
    """The watchdog job: a stale poller raises one chat alert per stale episode."""
    fresh = poller_freshness(container)
    if fresh["stale"]:
        with container.uow() as uow:
            alerts.raise_alert(uow, container.clock, "Event poller is stale: newest event_poller_state row is "
                               f"{fresh['age_seconds']} s old (over 5 minutes) - the worker may be stuck",
                               f"poller-stale:{fresh.get('run_id')}")
            uow.commit()
        alerts.deliver_outbox(container)
    return fresh
