"""One provider event, processed exactly once (the inbox), whichever path delivered it: the provider's
webhook, the event poller or a re-drive. An event whose handling fails is retried on its next delivery
and parked with a chat alert after MAX_EVENT_ATTEMPTS."""

from __future__ import annotations

import logging

from billingctl.adapters.logs import item_failed
from billingctl.adapters.payloads import Event, EventContent, EventEnvelope, Invoice, Payment, Transaction
from billingctl.domain import errors as e
from billingctl.domain.clock import parse_time
from billingctl.domain.lifecycle import INVOICE_PAYABLE
from billingctl.services import alerts, inbox
from billingctl.services.invoices import apply_copy, owed_again
from billingctl.services.payments import apply_refund_report, record_payment, reverse_refund
from billingctl.services.sync import apply_remote_subscription, subscription_gone

log = logging.getLogger("billingctl.events")

SOURCE = "provider"
MAX_EVENT_ATTEMPTS = 5


# ---- processing one event -------------------------------------------------------------------------

def process_event(container, event: Event) -> dict:
    event = Event.read(event)  # typed already, or the event as the inbox stored it
    kind, content = event.event_type, event.content
    if content.invoice is not None:
        # Every event that carries the invoice (generated, renewed, started, a payment) brings its copy.
        apply_copy(container, content.invoice)
    if kind == "payment_succeeded":
        return _payment_succeeded(container, content)
    if kind in ("payment_refunded", "credit_note_created"):
        return _refund(container, kind, content)
    if kind == "subscription_deleted" and content.subscription is not None:  # decision 215
        subscription_gone(container, content.subscription.id, content.subscription.resource_version, "event")
        return {"outcome": "subscription_deleted"}
    if kind.startswith("subscription_") and content.subscription is not None:
        outcome = apply_remote_subscription(container, content.subscription, source="event")
        _analytics(container, event, {"event": kind, "subscription_id": content.subscription.id,
                                      "status": content.subscription.status})
        return {"outcome": outcome}
    if kind == "invoice_generated" and content.invoice is not None:
        return {"outcome": "invoice_stored"}
    return {"outcome": "ignored"}


def _payment_succeeded(container, content: EventContent) -> dict:
    txn = content.transaction
    if txn is None or not (txn.reference_number or txn.id_at_gateway):
        return {"outcome": "no_reference"}
    payment_id = txn.payment_reference()
    if payment_id is None:
        log.error("payment_succeeded names no usable payment reference; left for review",
                  extra={"transaction_id": txn.id[:64]})
        return {"outcome": "invalid_reference"}
    with container.uow() as uow:
        recorded = uow.purchases.exists_for_payment(payment_id)
    if recorded:
        _confirm_provider_record(container, payment_id, content)
        return {"outcome": "already_recorded", "payment_id": payment_id}
    # The orchestrator webhook was missed: record it now, from the orchestrator's own payment.
    result = record_reported_payment(container, payment_id, content, "event_poller")
    _confirm_provider_record(container, payment_id, content)
    return {"outcome": result["outcome"], "payment_id": payment_id, "credits_applied": result["credits_applied"]}


def _confirm_provider_record(container, payment_id: str, content: EventContent) -> bool:
    """The provider says the invoice is paid by this payment: its purchase is recorded there (by the
    orchestrator's workflow), so no follow-up posts it again (issue 39 item 1: a renewal costs no call)."""
    invoice = content.invoice
    if invoice is None or not invoice.id:
        return False
    if not (invoice.status == "paid" or (invoice.amount_due is not None and invoice.amount_due <= 0)):
        return False
    # Marked with the provider's time of the record (its transaction's date), not ours: the confirmation may
    # come hours later, and reconcile looks for the transaction in the provider's list by its date.
    recorded_at = parse_time(content.transaction.date if content.transaction else None) or \
        parse_time(invoice.paid_at) or container.clock.now()
    with container.uow() as uow:
        confirmed = uow.purchases.confirm_reported(payment_id, invoice.id, recorded_at)
        ours = uow.invoices.get(invoice.id) if confirmed else None
        if ours is not None and _record_undone(ours, invoice):
            # The record was undone at the provider before we read it (finance removed the payment, and the
            # invoice was voided or owes again since): the removal's news, told to a person (decision 260).
            owed_again(container, uow, invoice.id, ours["status"])
        uow.commit()
    if confirmed:
        log.info("recorded on its invoice by the workflow: confirmed by the provider",
                 extra={"payment_id": payment_id, "invoice_id": invoice.id})
    return confirmed


def _record_undone(ours, reported: Invoice) -> bool:
    """Our copy of an invoice no longer holds the record the provider reports on it: voided (the provider
    voids an invoice only once its payments are removed, decision 188), or unpaid by a copy newer than the
    report's (its payment removed since, decision 184). Not a deleted one: the deletion is its own news
    (decision 215)."""
    if ours["deleted_at"] is not None or ours["status"] in (None, "paid"):
        return False
    newer = (ours["provider_resource_version"] or 0) > (reported.resource_version or 0)
    return ours["status"] == "voided" or (ours["status"] in INVOICE_PAYABLE and newer)


def record_reported_payment(container, payment_id: str, content: EventContent, path: str) -> dict:
    """A payment the provider holds on an invoice: the orchestrator's own payment when it has one; else
    one entered at the provider (a cheque, a wire that finance records), which is never posted back to the
    provider and credits its invoice's term once, when the invoice is paid in full (decision 112)."""
    try:
        payment = container.orchestrator.get_payment(payment_id)
    except e.ExternalNotFound:
        txn, inv = content.transaction or Transaction(id=payment_id), content.invoice or Invoice(id="")
        payment = Payment.read({
            "id": payment_id, "status": "SETTLED", "order_id": inv.id or None, "customer_id": txn.customer_id,
            "amount": txn.amount, "currency_code": txn.currency_code, "date": txn.date,
            "metadata": {"subscription_id": inv.subscription_id or txn.subscription_id,
                         "item_price_id": inv.item_price_id}})
        paid = inv.status == "paid" or (inv.amount_due is not None and inv.amount_due <= 0)
        return record_payment(container, payment, path, provider_side=True, term_paid=paid)
    return record_payment(container, payment, path)


def _refund(container, kind: str, content: EventContent) -> dict:
    """A refund the provider reports: the workflow's mirror of a refund at the orchestrator, or one finance
    recorded there, made by wire or cheque outside the orchestrator (decision 212). What the customer got
    back is the larger of the two books' totals: the orchestrator's refunded amount, and the refunds the
    provider lists on the payment (the mirrored ones with those made outside); a payment entered at the
    provider has only the latter."""
    txn, note = content.transaction, content.credit_note
    if kind == "credit_note_created" and (note is None or note.type != "refundable"):
        return {"outcome": "ignored"}
    payment_id, at_provider = _refunded_payment(container, txn, note)
    if not payment_id:
        return {"outcome": "unknown_payment"}
    try:
        refunded = container.orchestrator.get_payment(payment_id).refunded
    except e.ExternalNotFound:  # entered at the provider: its books alone
        return reverse_refund(container, payment_id, at_provider, "event_poller")
    result = apply_refund_report(container, payment_id, max(refunded, at_provider), "event_poller")
    if at_provider > refunded and result["outcome"] == "recorded":  # recorded now, with the orchestrator's
        result["refund"] = reverse_refund(container, payment_id, at_provider, "event_poller")
    return result


def _refunded_payment(container, txn: Transaction | None, note) -> tuple[str | None, int]:
    """The payment a provider refund gives money back of, and all the provider holds as given back of it
    (read from the payment's transaction that the refund names; 0 when it names none)."""
    if txn is not None and txn.type == "refund" and txn.reference_transaction_id:
        paid = container.provider.get_transaction(txn.reference_transaction_id, include_deleted=True)
        return paid.payment_reference(), paid.refunded
    payment_id = None
    invoice_id = note.reference_invoice_id if note is not None else None
    with container.uow() as uow:
        if invoice_id:
            payment_id = uow.purchases.paying_invoice(invoice_id)
    return payment_id or (txn.reference_number if txn is not None else None), 0


def _analytics(container, event: Event, payload: dict) -> None:
    with container.uow() as uow:
        alerts.enqueue(uow, container.clock, "analytics", payload, f"analytics:{SOURCE}:{event.id}")
        uow.commit()


# ---- the inbox path shared by the poller and the webhook ---------------------------------------

def handle_event(container, event: EventEnvelope, via: str = "poller") -> str:
    """Store and process one provider event; returns its inbox status afterwards."""
    event = EventEnvelope.read(event)  # read by the poller's list; a webhook's body as it came (its schema passed)
    event_id, kind = event.id, event.event_type
    status = inbox.receive(container, SOURCE, event_id, kind, event.wire(), parse_time(event.occurred_at), via=via)
    if status != "pending":
        return status
    error, down = None, False
    try:
        process_event(container, event.wire())
    except e.BillingError as exc:
        error, down = exc.message, e.outage(exc)
    except Exception as exc:  # one bad event must not stop the others
        error = f"{type(exc).__name__}: {exc}"
        item_failed(log, "event processing", exc, event_id=event_id)
    status = inbox.record_attempt(container, SOURCE, event_id, error, f"Provider event {event_id} ({kind}) parked "
                                  f"after {MAX_EVENT_ATTEMPTS} failed attempts - manual review required",
                                  MAX_EVENT_ATTEMPTS, outage=down)
    if error:
        log.warning("event processing failed: %s", error, extra={"event_id": event_id, "status": status})
    return status


# ---- the poller ------------------------------------------------------------------------------------
