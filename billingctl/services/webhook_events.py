"""What each event source's events do, once they are authenticated: the one dispatch used by the
webhook views, the pollers and `billingctl events replay` alike. Every handler is idempotent."""

from __future__ import annotations

from billingctl.adapters.payloads import Payment
from billingctl.services import inbox
from billingctl.services.inbox import process_once


def _payment_key(event_type: str, payment_id: str, status: str, suffix: str = "") -> str:
    """The one spelling of a payment notification's inbox key (read back by `payment_of_event`)."""
    return f"{event_type}:{payment_id}:{status}{suffix}"


def payment_event_id(event_type: str, payment: Payment) -> str:
    """A refund notification is named by the refunded amount it reports, and a refused refund by how many
    were refused: each is news once (decision 174). So is a capture in part by what it captured: a further
    capture that still leaves some uncaptured keeps the status PARTIALLY_SETTLED (decision 238)."""
    suffix = ""
    if event_type == "PAYMENT.STATUS" and payment.status == "PARTIALLY_SETTLED":
        suffix = f":{int(payment.processor.amount_captured or 0)}"
    if event_type == "PAYMENT.REFUND":
        suffix = f":{payment.refunded}" + (f":failed{payment.refunds_failed}" if payment.refunds_failed else "")
    return _payment_key(event_type, payment.id, payment.status, suffix)


def plain_payment_event_id(event_type: str, payment: dict) -> str | None:
    """`payment_event_id` read from the payment as it came, before it is typed, where typing keeps what
    the key names as it is: a string id and status. A refund's key holds an amount that typing may
    convert ("100" is 100), so it is read from the typed copy only: None; so is a capture in part's."""
    payment_id, status = payment.get("id"), payment.get("status")
    if event_type == "PAYMENT.REFUND" or status == "PARTIALLY_SETTLED" or type(payment_id) is not str \
            or type(status) is not str:
        return None
    return _payment_key(event_type, payment_id, status)


def payment_of_event(event_id: str) -> str | None:
    """The payment id a payment notification's inbox key names (`payment_event_id`)."""
    parts = event_id.split(":")
    return parts[1] if len(parts) >= 3 and parts[0].startswith("PAYMENT.") else None


def _orchestrator(container, event_type: str, payload: dict) -> dict:
    from billingctl.services.fraud_signals import record_dispute
    from billingctl.services.payments import (
        CAPTURED_STATUSES,
        apply_refund_report,
        record_payment,
        refund_failed,
        update_transaction_status,
    )

    if event_type.startswith("DISPUTE."):
        return record_dispute(container, event_type, payload)
    payment = Payment.read(payload["payment"])  # the notification as it was stored: typed once, here
    if event_type == "PAYMENT.STATUS" and payment.status in CAPTURED_STATUSES:
        # One attempt per provider call: a webhook answers quickly, the activations job finishes. A partial
        # settle is held for review by recording itself.
        with container.provider.http.attempts(1):
            return record_payment(container, payment, "webhook")
    if event_type == "PAYMENT.STATUS":
        return update_transaction_status(container, payment)
    if event_type == "PAYMENT.REFUND" and payment.refunds_failed:
        # Each refusal it carries is alerted once; what settled refunds returned is taken back as usual (an
        # unrecorded payment nothing returned for is left to its own paths).
        refused = refund_failed(container, payment)
        if payment.refunded:
            with container.provider.http.attempts(1):
                refused["refund"] = apply_refund_report(container, payment.id, payment.refunded, "webhook")
        return refused
    if event_type == "PAYMENT.REFUND":
        with container.provider.http.attempts(1):
            return apply_refund_report(container, payment.id, payment.refunded, "webhook")
    from billingctl.services.lifecycles import unknown_notification

    return unknown_notification(container, event_type, payment.id)


def _workflow(container, event_type: str, payload: dict) -> dict:
    from billingctl.services.payments import record_payment

    payment_id = payload.get("payment_id")
    if payload.get("status") != "completed" or not payment_id:
        return {"outcome": "ignored"}
    payment = container.orchestrator.get_payment(payment_id)
    if payment.status != "SETTLED":
        return {"outcome": "not_settled", "status": payment.status}
    with container.provider.http.attempts(1):
        return record_payment(container, payment, "workflow_callback")


def _idv(container, event_type: str, payload: dict) -> dict:
    from billingctl.services.users import store_verification

    return store_verification(container, payload["user_id"], payload["status"])


def _identity(container, event_type: str, payload: dict) -> dict:
    from billingctl.services.users import apply_identity_event

    return apply_identity_event(container, event_type, payload["data"])


HANDLERS = {"orchestrator": _orchestrator, "workflow": _workflow, "idv": _idv, "identity": _identity}


def event_id_for(source: str, event_type: str, payload: dict, given: str | None = None) -> str:
    if given:
        return given
    if source == "orchestrator" and event_type.startswith("DISPUTE."):
        from billingctl.services.fraud_signals import dispute_event_id

        return dispute_event_id(event_type, payload)
    if source == "orchestrator":
        return payment_event_id(event_type, Payment.read(payload["payment"]))
    if source == "workflow":
        # One event per status: a `completed` after an earlier `running` for the same workflow is new.
        return f"{payload['workflow_id']}:{payload.get('status')}"
    return payload["id"]


def dispatch(container, source: str, event_type: str, payload: dict, event_id: str | None = None,
             via: str = "webhook", duplicate_read: bool = True) -> dict:
    """Accept into the inbox and process once through the source's handler. `duplicate_read=False`: the
    caller has just made the inbox's duplicate read for this key (`inbox.finished_duplicate`)."""
    if source == "provider":
        from billingctl.services.provider_events import handle_event

        return {"event_id": payload["id"], "status": handle_event(container, payload, via=via)}
    handler = HANDLERS[source]
    event_id = event_id_for(source, event_type, payload, event_id)
    return process_once(container, source, event_id, event_type, payload,
                        lambda: handler(container, event_type, payload), via=via, duplicate_read=duplicate_read)


# ---- every stored event again through its normal path ------------------------------------------

def replay(container, inbox_id: int, reason: str, actor: str, dry_run: bool = False) -> dict:
    """Reprocess one stored event through its normal path; a no-op where it already took effect
    (every handler is idempotent), audited."""
    from billingctl.domain.errors import InvalidInput

    if not reason or not reason.strip():
        raise InvalidInput("a reason is required")
    row = inbox.get_event(container, inbox_id)
    plan = {"id": inbox_id, "source": row["source"], "event_id": row["event_id"], "event_type": row["event_type"],
            "status_before": row["status"]}
    if dry_run:
        return {**plan, "dry_run": True}
    inbox.reopen(container, inbox_id, actor, reason, plan)
    result = dispatch(container, row["source"], row["event_type"], row["payload"], via="replay")
    return {**plan, "result": result, "status_after": inbox.get_event(container, inbox_id)["status"]}


def redrive(container) -> dict:
    """Process stale pending events through their normal path (every handler is idempotent)."""
    done = still_pending = 0
    for row in inbox.stale_pending(container)[:inbox.REDRIVE_BATCH]:
        payload = inbox.payload_of(container, row["id"])
        try:
            dispatch(container, row["source"], row["event_type"], payload, event_id=row["event_id"], via="redrive")
        except Exception as exc:  # one event never stops the others; it stays pending
            import logging

            logging.getLogger("billingctl.inbox").warning(
                "re-driven event failed: %s", getattr(exc, "message", None) or type(exc).__name__,
                extra={"source": row["source"], "event_id": row["event_id"]})
        status = inbox.get_event(container, row["id"])["status"]
        if status == "pending":
            still_pending += 1
        else:
            done += 1
    return {"redriven": done, "still_pending": still_pending}
