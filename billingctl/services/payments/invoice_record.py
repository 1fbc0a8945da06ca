"""A recorded payment's record on its provider invoice (spec section 1.1: the provider is authoritative),
with the reference the orchestrator's payment id. What finance did to the invoice meanwhile decides the
outcome: paid by another payment, paid in part, voided, deleted, written off or credited in full, each
refunding our payment or its excess once, with one alert; a renewal's payment, which the orchestrator's
workflow records there itself, is first looked for at the provider."""

from __future__ import annotations

import logging

from billingctl.adapters.faults import crash_point
from billingctl.adapters.payloads import Invoice
from billingctl.domain import errors as e
from billingctl.domain import lifecycle
from billingctl.domain.clock import parse_time
from billingctl.services import alerts, review
from billingctl.services.invoices import apply_copy, owed_again, save_copy
from billingctl.services.payments.refunds import refund, reverse_refund

log = logging.getLogger("billingctl.payments")


VOIDED = "invoice_voided"
DELETED = "invoice_deleted"
PAID_ELSEWHERE = "invoice_paid_elsewhere"
WRITTEN_OFF = "invoice_written_off"
CREDITED = "invoice_credited"
UNPAID_PERIOD = (VOIDED, DELETED, PAID_ELSEWHERE, WRITTEN_OFF, CREDITED)  # ends that refund the payment
REMOVED = "payment_removed"  # held by the provider but removed from its invoice: a person's (decision 246)


def report_to_provider(container, row) -> bool | str:
    """Record one purchase on its provider invoice (reference = the orchestrator payment id). True when
    the invoice is paid afterwards; VOIDED (DELETED) when the invoice was voided (deleted) meanwhile,
    PAID_ELSEWHERE when another payment paid it meanwhile, WRITTEN_OFF (CREDITED) when finance wrote it off
    (credited it in full) meanwhile (the payment is then refunded, decisions 113, 201, 179, 185, 204); one
    paid in part meanwhile gets the rest, and the excess is refunded first (decision 180); a refusal the
    provider does not explain stays pending. A renewal's payment, which the orchestrator's workflow records
    there itself, is first looked for at the provider: confirmed when it is on the invoice, REMOVED when it
    is held there but finance removed it from the invoice (decision 246)."""
    if row["confirm_after"] is not None:  # a renewal's: the orchestrator's workflow records it there itself
        held = _held_by_the_provider(container, row)
        if held is not None:
            return held
    amount = int(row["amount"] or 0) - int(row["returned_excess"] or 0)
    if row["returned_excess"]:
        try:  # before the record that ends the follow-up: a run cut short between them refunds it next time
            _return_excess(container, row["transaction_id"], int(row["returned_excess"]))
        except e.BillingError as exc:
            log.warning("returning the excess failed; will retry: %s", exc.message,
                        extra={"invoice_id": row["invoice_id"], "payment_id": row["transaction_id"]})
            return False
    try:
        answer = container.provider.record_payment(row["invoice_id"], amount, row["transaction_id"])
        crash_point(container.settings, "provider_record.after_call")
        copy = answer.invoice
        # The provider's time of the record (its transaction's date), not ours: after a crash between its
        # answer and our commit, the retry gets the same answer replayed (the same idempotency key) hours later.
        recorded_at = parse_time(answer.transaction.date if answer.transaction else None)
    except e.ExternalInvalidRequest as exc:
        # Refused for the invoice's state, or for an amount above the amount due: the invoice says why.
        copy = _invoice_copy(container, row["invoice_id"]) \
            if exc.details.get("api_error_code") in ("invalid_state_for_request", "param_wrong_value") else None
        status = copy.status if copy is not None else None
        if status != "paid":  # a paid copy is saved below, with the purchase marked reported
            apply_copy(container, copy)
        if status == "voided":
            refund_for_voided_invoice(container, row)
            return VOIDED
        if status in lifecycle.INVOICE_PAYABLE and 0 < int(copy.amount_due or 0) < amount:
            return pay_the_rest(container, row, copy)
        paid_by = _paid_by_others(container, copy, row["transaction_id"]) if status == "paid" else None
        if paid_by:
            refund_for_invoice_paid_elsewhere(container, row, paid_by)
            return PAID_ELSEWHERE
        if status == "paid" and not copy.linked_payments and int(copy.write_off_amount or 0) > 0:
            refund_for_written_off_invoice(container, row)
            return WRITTEN_OFF
        if status == "paid" and not copy.linked_payments and int(copy.amount_adjusted or 0) > 0:
            refund_for_credited_invoice(container, row)  # credited in full at the provider (decision 204)
            return CREDITED
        if status != "paid":
            log.error("recording at the provider was refused; left pending: %s", exc.message,
                      extra={"invoice_id": row["invoice_id"], "payment_id": row["transaction_id"],
                             "error_code": exc.details.get("api_error_code")})
            return False
        # Paid already (the orchestrator's workflow reports each settled payment with this reference): marked
        # with the provider's time of it, which reconcile finds its transaction by (not ours, maybe hours later).
        log.info("invoice already paid at the provider", extra={"invoice_id": row["invoice_id"],
                                                                "payment_id": row["transaction_id"]})
        recorded_at = parse_time(copy.paid_at)
    except e.BillingError as exc:  # down, not found yet, breaker open: retried later
        if isinstance(exc, e.ExternalNotFound) and _deleted(container, row["invoice_id"]):
            refund_for_deleted_invoice(container, row)  # finance deleted it at the provider (decision 201)
            return DELETED
        log.warning("recording at the provider failed; will retry: %s", exc.message,
                    extra={"invoice_id": row["invoice_id"], "payment_id": row["transaction_id"]})
        return False
    with container.uow() as uow:
        if copy is not None and copy.status:
            save_copy(container, uow, copy)
        uow.purchases.mark_reported(row["id"], recorded_at or container.clock.now())
        uow.commit()
    return True


def _held_by_the_provider(container, row) -> bool | str | None:
    """A renewal payment's record, as the provider holds it, before ours is made (decision 246): the
    workflow records each renewal payment on its invoice, and past the wait for the provider's confirmation
    a record of ours would be a second one if the provider held the first but not on the invoice (finance
    removed it there before our poll read the record: the invoice owes again, the money stands as the
    customer's excess payments). Applied to the invoice: confirmed (True), no record made. Held but not on
    it: the removal, named to a person at once (`payment-removed`, decision 184) and nothing recorded again
    (REMOVED). None when the provider holds none: ours is made. A read that fails leaves it pending."""
    try:
        held = [t for t in container.provider.payments_referenced(row["transaction_id"])
                if t.status in ("success", "in_progress", "needs_attention")]
    except e.BillingError as exc:
        log.warning("reading the provider's record of a renewal payment failed; will retry: %s", exc.message,
                    extra={"invoice_id": row["invoice_id"], "payment_id": row["transaction_id"]})
        return False
    if not held:
        return None
    applied = [t for t in held if any(link.invoice_id == row["invoice_id"] and int(link.applied_amount or 0) > 0
                                      for link in t.linked_invoices)]
    recorded_at = parse_time((applied or held)[0].date) or container.clock.now()
    copy = None if applied else _invoice_copy(container, row["invoice_id"])
    with container.uow() as uow:
        if copy is not None and copy.status:
            save_copy(container, uow, copy)
        uow.purchases.mark_reported(row["id"], recorded_at)
        if not applied:
            owed_again(container, uow, row["invoice_id"], copy.status if copy is not None and copy.status
                       else "payment_due")
        uow.commit()
    return True if applied else REMOVED


def pay_the_rest(container, row, invoice: Invoice) -> bool | str:
    """A payment settled for a provider invoice paid in part meanwhile (a cheque finance entered while our
    record waited): the provider takes no more than the amount due, so ours pays the rest, and what the other
    payment paid is refunded on the card first, without taking back credits (the period is paid once); one
    chat alert (decision 180)."""
    payment_id = row["transaction_id"]
    excess = int(row["amount"] or 0) - int(invoice.amount_due or 0)
    others = [p.txn_id for p in invoice.linked_payments if p.txn_id and p.txn_id != payment_id]
    by = ", ".join(others) or "an adjustment"
    with container.uow() as uow:
        uow.purchases.return_excess(row["id"], excess)  # before the refund, whose report then takes back nothing
        alerts.raise_alert(uow, container.clock,
                           f"Payment {payment_id} settled for invoice {row['invoice_id']}, paid in part at the "
                           f"provider by {by} meanwhile - it pays the rest ({invoice.amount_due} "
                           f"{row['currency_code']}); the excess {excess} is refunded",
                           f"invoice-part-paid:{payment_id}", payment_id=payment_id, user_id=row["user_id"],
                           invoice_id=row["invoice_id"])
        uow.commit()
    log.warning("payment settled for an invoice paid in part meanwhile: pays the rest, the excess refunded",
                extra={"payment_id": payment_id, "invoice_id": row["invoice_id"], "user_id": row["user_id"],
                       "excess": excess})
    # the provider's record of it was read already, before the refusal (decision 246)
    return report_to_provider(container, {**row, "returned_excess": excess, "confirm_after": None})


def _return_excess(container, payment_id: str, excess: int) -> None:
    """Refund the payment's excess (decision 180) once: nothing when that much is refunded or asked for; one
    the processor refused is asked for again under a new key (decision 174)."""
    payment = container.orchestrator.get_payment(payment_id)
    asked = payment.refund_asked
    if asked < excess:
        key = f"excess:{payment_id}:{excess}" + (f":{payment.refunds_failed}" if payment.refunds_failed else "")
        container.orchestrator.refund_payment(payment_id, excess - asked, reason="invoice paid in part elsewhere",
                                              idempotency_key=key)


def _paid_by_others(container, invoice: Invoice, payment_id: str) -> list[str]:
    """The provider transactions paying a paid invoice when none of them is this payment (the workflow's
    record of it carries its id as reference, `Transaction.payment_reference`, decision 175); [] when one is, or when
    the copy names none (nothing to judge by: taken as ours, as before decision 179)."""
    others = []
    for linked in invoice.linked_payments:
        if not linked.txn_id:
            continue
        if linked.txn_id == payment_id or \
                container.provider.get_transaction(linked.txn_id).payment_reference() == payment_id:
            return []
        others.append(linked.txn_id)
    return others


def refund_for_voided_invoice(container, row) -> None:
    """A payment settled for a provider invoice voided while the charge was in flight (an operator's
    `users freeze --void-invoices`, finance at the provider's console): the void is the decision that
    the period is not collected, so the payment is refunded in full (decision 113)."""
    _refund_unpaid_period(container, row, VOIDED, "invoice voided",
                          f"invoice {row['invoice_id']} was voided at the provider",
                          f"Payment {row['transaction_id']} settled for voided invoice {row['invoice_id']} - "
                          "refunded, credits reversed", f"voided-invoice:{row['transaction_id']}",
                          "payment settled for a voided invoice: refunded")


def _deleted(container, invoice_id: str) -> bool:
    """Our copy says the provider deleted the invoice (its `invoice_deleted` reached us): a record the
    provider answers "not found" for is not waited on. Before the event is read it is retried."""
    with container.uow(autocommit=True) as uow:
        local = uow.invoices.get(invoice_id)
    return local is not None and local["deleted_at"] is not None


def refund_for_deleted_invoice(container, row) -> None:
    """A payment settled for a provider invoice finance deleted while the charge was in flight: like a void,
    the deletion is the decision that the period is not collected there, so the payment is refunded in full
    and the period stays uncredited (decision 201)."""
    _refund_unpaid_period(container, row, DELETED, "invoice deleted",
                          f"invoice {row['invoice_id']} was deleted at the provider",
                          f"Payment {row['transaction_id']} settled for invoice {row['invoice_id']}, deleted at "
                          "the provider meanwhile - refunded, credits reversed",
                          f"deleted-invoice:{row['transaction_id']}", "payment settled for a deleted invoice: refunded")


def refund_for_written_off_invoice(container, row) -> None:
    """A payment settled for a provider invoice finance wrote off while the charge was in flight (at the
    provider's console: its write-off needs no payment in progress there, and ours is at the orchestrator):
    like a void, the write-off is the decision that the period is not collected, so the payment is refunded
    in full and the period stays uncredited (decision 185)."""
    _refund_unpaid_period(container, row, WRITTEN_OFF, "invoice written off",
                          f"invoice {row['invoice_id']} was written off at the provider",
                          f"Payment {row['transaction_id']} settled for invoice {row['invoice_id']}, written off "
                          "at the provider meanwhile - refunded, credits reversed",
                          f"written-off-invoice:{row['transaction_id']}",
                          "payment settled for a written-off invoice: refunded")


def refund_for_credited_invoice(container, row) -> None:
    """A payment settled for a provider invoice finance credited in full while the charge was in flight (an
    adjustment credit note for all that was due, at the provider's console): like a write-off, nobody owes
    the period any more, so the payment is refunded in full and the period stays uncredited (decision 204)."""
    _refund_unpaid_period(container, row, CREDITED, "invoice credited",
                          f"invoice {row['invoice_id']} was credited in full at the provider",
                          f"Payment {row['transaction_id']} settled for invoice {row['invoice_id']}, credited in "
                          "full at the provider meanwhile - refunded, credits reversed",
                          f"credited-invoice:{row['transaction_id']}",
                          "payment settled for an invoice credited in full: refunded")


def refund_for_invoice_paid_elsewhere(container, row, paid_by: list[str]) -> None:
    """A payment settled for a provider invoice that another payment paid meanwhile (a cheque or a wire
    finance entered while our record waited for the provider): the customer paid the period twice, and
    ours is the one we can give back, so it is refunded in full (decision 179)."""
    by = ", ".join(paid_by)
    _refund_unpaid_period(container, row, PAID_ELSEWHERE, "invoice paid by another payment",
                          f"invoice {row['invoice_id']} was paid at the provider by {by}",
                          f"Payment {row['transaction_id']} settled for invoice {row['invoice_id']}, already paid "
                          f"at the provider by {by} - refunded, credits reversed",
                          f"invoice-paid-elsewhere:{row['transaction_id']}",
                          "payment settled for an invoice another payment paid: refunded")


def _refund_unpaid_period(container, row, closed_reason: str, refund_reason: str, why: str, text: str,
                          key: str, logged: str) -> None:
    """The payment is refunded in full, its credits reversed, its purchase closed (no follow-up records it
    for ever) and its review row ended `resolved`/`refunded`, with one chat alert. Each step is idempotent:
    a run cut short is finished by the next."""
    payment_id, now = row["transaction_id"], container.clock.now()
    payment = refund(container, payment_id, reason=refund_reason)
    reverse_refund(container, payment_id, payment.refunded, closed_reason)  # a pending refund: when it settles
    with container.uow() as uow:
        uow.purchases.close(payment_id, closed_reason, now)  # the invoice's copy was saved by the caller
        review.open_row(uow, now, payment_id=payment_id, user_id=row["user_id"],
                        subscription_id=row["subscription_id"], item_price_id=row["item_price_id"],
                        amount=row["amount"], currency_code=row["currency_code"], settled_at=row["settled_at"])
        review.move(container, uow, payment_id, "resolved", resolution="refunded", next_attempt_at=None,
                    last_error=why)
        alerts.raise_alert(uow, container.clock, text, key, payment_id=payment_id, user_id=row["user_id"],
                           invoice_id=row["invoice_id"])
        uow.commit()
    log.warning(logged, extra={"payment_id": payment_id, "invoice_id": row["invoice_id"], "user_id": row["user_id"],
                               "reason": why})


def _invoice_copy(container, invoice_id: str) -> Invoice | None:
    try:
        return container.provider.get_invoice(invoice_id)
    except e.BillingError:
        return None
