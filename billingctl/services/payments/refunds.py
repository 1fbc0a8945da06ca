"""Refunds of captured payments (spec sections 1 and 4): a refund asked for once at the orchestrator, its
credits reversed once whichever path reports it (the ledger's key names the cumulative refunded amount), a
refund the processor refused sent back to a person, and the operator's `payments refund`."""

from __future__ import annotations

import logging

from billingctl.adapters.payloads import Payment
from billingctl.domain import errors as e
from billingctl.domain import lifecycle
from billingctl.domain.plans import require_id
from billingctl.domain.refunds import credits_to_reverse, share_refunded
from billingctl.services import alerts, review
from billingctl.services.payments.transactions import CAPTURED_STATUSES

log = logging.getLogger("billingctl.payments")


REFUND_FAILED_TEXT = "Refund of payment {payment_id} failed at the processor - manual action required"


REFUNDED_IN_REVIEW = ("refunded", "refunded_elsewhere")  # a review row's resolutions that returned the money


def returned_in_review(row) -> bool:
    """A review row (or None) that ended with its payment's money returned: refunded as a duplicate, or
    resolved by a refund (a person's, or found refunded elsewhere)."""
    return row is not None and (row["status"] == "duplicate_refunded" or (
        row["status"] in lifecycle.REVIEW_REFUNDED and row["resolution"] in REFUNDED_IN_REVIEW))


def apply_credits(uow, user_id: str, amount: int, source_key: str, reason: str, payment_id: str | None, now) -> bool:
    """One ledger row per source key; users.credits moves only when the row is new."""
    return uow.ledger.apply(user_id, amount, source_key, reason, payment_id, now)


def refund(container, payment_id: str, reason: str = "duplicate charge") -> Payment:
    """Refund what is left of the payment at the orchestrator, once (the client's idempotency key for a
    refund is the payment id). The amount is always named: a payment already partly refunded (at the
    orchestrator's console) is refunded for the rest, and a request without an amount would ask for the
    full amount, which the orchestrator refuses. Of a payment captured in part (PARTIALLY_SETTLED), what was
    captured: the rest was never taken. A refund still pending at the processor is not asked for again; one
    the processor refused is asked for again under a new key (the old one would replay the refused refund,
    decision 174). Credits follow the answer's amountRefunded: a pending refund reverses them when its
    notification reports it settled."""
    payment = container.orchestrator.get_payment(payment_id)
    asked, amount = payment.refund_asked, payment.taken
    if asked >= amount:
        return payment
    # One key per refund asked for: the first is the payment's id; each later one (after a refusal, or of
    # what a later capture took, decision 237) is numbered by the refunds the payment holds.
    made = payment.refunds_made
    key = f"refund:{payment_id}" + (f":{made + 1}" if made else "")
    return container.orchestrator.refund_payment(payment_id, amount - asked, reason=reason, idempotency_key=key)


def refund_failed(container, payment: Payment) -> dict:
    """The processor refused a refund (PAYMENT.REFUND with a REFUND transaction FAILED): the money is still
    with us, and whoever asked for it has moved on. One chat alert per refused refund (each refusal the
    payment carries, whichever refund the notification is about: two refunds in flight end in any order);
    a review row that ended with a refund (a same-plan duplicate, `orphans resolve --refund`, a voided
    invoice's payment) goes back to a person (`needs_review`) unless the payment is refunded in full after
    all, who refunds it again or decides otherwise. Its credits were never reversed (only a settled refund
    reverses them) (decision 174)."""
    new = 0
    with container.uow() as uow:
        held = uow.orphans.get(payment.id)
        reopen = (held is not None and held["status"] in lifecycle.REVIEW_REFUNDED
                  and held["resolution"] == "refunded" and not payment.fully_refunded)
        if reopen:
            review.move(container, uow, payment.id, "needs_review", next_attempt_at=None, resolution=None,
                        last_error=f"refund failed at the processor ({payment.refunds_failed} refused)")
        for n in range(1, payment.refunds_failed + 1):
            new += alerts.raise_alert(uow, container.clock, REFUND_FAILED_TEXT.format(payment_id=payment.id),
                                      f"refund-failed:{payment.id}:{n}", payment_id=payment.id,
                                      user_id=payment.user_id, refunded=payment.refunded, amount=payment.charged,
                                      review="needs_review" if reopen else (held["status"] if held else None))
        uow.commit()
    if new:
        container.metrics.payments_held.labels(reason="refund_failed").inc(new)  # PaymentsHeldForReview
        log.error(REFUND_FAILED_TEXT.format(payment_id=payment.id), extra={"payment_id": payment.id})
    return {"payment_id": payment.id, "outcome": "refund_failed", "reopened": reopen}


def refund_by_operator(container, payment_id: str, reason: str, actor: str, dry_run: bool = False) -> dict:
    """`billingctl payments refund`: refund what is left of a captured payment at the orchestrator and
    reverse its credits once (the refund notification that follows finds them reversed), audited. Safe to
    re-run: a payment refunded already is only made sure of in the ledger. A payment held in the review
    queue is resolved there (`orphans resolve --refund`), so its row ends with it."""
    require_id(payment_id, "payment_id")
    if not (reason or "").strip():
        raise e.InvalidInput("--reason is required")
    payment = container.orchestrator.get_payment(payment_id)
    if payment.status not in CAPTURED_STATUSES:
        raise e.Refused(f"payment {payment_id} is {payment.status}: only a captured payment can be refunded")
    if payment.taken > payment.refunded:
        from billingctl.services.fraud_signals import refuse_if_disputed

        refuse_if_disputed(container, payment_id, "a refund")
    with container.uow() as uow:
        held, recorded = uow.orphans.status(payment_id), uow.purchases.by_payment_id(payment_id) is not None
    left = payment.taken - payment.refunded
    if left > 0 and held in (*lifecycle.REVIEW_OPEN, *lifecycle.REVIEW_HUMAN):
        raise e.Refused(f"payment {payment_id} is held for review ({held}): "
                        f"billingctl orphans resolve {payment_id} --refund --reason R --yes")
    plan = {"payment_id": payment_id, "amount": payment.charged, "currency_code": payment.currency_code,
            "already_refunded": payment.refunded, "to_refund": max(left, 0)}
    if dry_run:
        return {"dry_run": True, **plan}
    answer = refund(container, payment_id, reason) if left > 0 else payment
    # Credits exist only for a recorded payment; an unrecorded one is only refunded (its notification then
    # finds it refunded in full).
    reversed_ = (reverse_refund(container, payment_id, answer.refunded, "operator") if recorded
                 else {"credits_reversed": 0, "user_id": payment.user_id})
    with container.uow() as uow:
        uow.audit.record(actor, "payments.refund", payment_id, reason,
                         {**plan, "credits_reversed": reversed_.get("credits_reversed", 0)}, container.clock.now())
        total = uow.ledger.reversed_for(payment_id)
        uow.commit()
    log.warning("payment refunded by an operator", extra={"payment_id": payment_id, "actor": actor})
    # credits_reversed: by this command; credits_reversed_total: for the payment, whichever path reversed them
    # (the refund's own notification may have been first).
    # refund_pending: the processor has not settled it yet; its notification reverses the credits then (or,
    # refused, raises the refund-failed alert).
    outcome = "refund_pending" if answer.refunded < payment.taken and answer.refund_pending else \
        "refunded" if left > 0 else "already_refunded"
    return {**plan, "outcome": outcome, "refunded": answer.refunded,
            "credits_reversed": reversed_.get("credits_reversed", 0), "credits_reversed_total": total,
            "user_id": reversed_.get("user_id")}


def reverse_refund(container, payment_id: str, refunded_total: int, path: str) -> dict:
    """Reverse the credits of a refunded payment exactly once, whichever path reports it.

    Every report carries the payment's cumulative refunded amount (the orchestrator's
    amountRefunded); the credits to reverse are the same share of the purchase's credits, and the
    ledger key names that cumulative amount, so two reports of one refund insert one row. The user's
    row is locked while the already-reversed sum is read, so reports of different refunds serialize."""
    now = container.clock.now()
    with container.uow() as uow:
        bought = uow.purchases.by_payment_id(payment_id)
        if bought is None:
            return {"payment_id": payment_id, "outcome": "unknown_payment", "credits_reversed": 0}
        uow.users.lock(bought["user_id"])
        reversed_so_far = uow.ledger.reversed_for(payment_id)
        # An excess given back because the invoice was part-paid elsewhere takes back nothing (decision 180).
        share, _ = share_refunded(bought["amount"], bought["returned_excess"], refunded_total)
        target = credits_to_reverse(bought["credits"], bought["amount"], bought["returned_excess"], refunded_total)
        delta = target - reversed_so_far
        if delta <= 0:
            return {"payment_id": payment_id, "outcome": "already_reversed", "credits_reversed": 0}
        # Keyed by the cumulative refunded amount, not the share: an excess counted between two refunds
        # (decision 180) can give a later refund the share of an earlier one (decision 265).
        apply_credits(uow, bought["user_id"], -delta, f"refund:{payment_id}:{refunded_total}", "refund", payment_id,
                      now)
        review.close_purchase_ended(uow, payment_id, now)  # its row ended refunded while the refund was pending
        alerts.enqueue(uow, container.clock, "analytics", {
            "event": "payment_refunded", "payment_id": payment_id, "user_id": bought["user_id"],
            "refunded_total": share, "credits_reversed": delta, "path": path},
            f"analytics:refund:{payment_id}:{refunded_total}")
        uow.commit()
    log.info("refund reversed credits", extra={"payment_id": payment_id, "credits": delta, "path": path})
    return {"payment_id": payment_id, "outcome": "reversed", "credits_reversed": delta, "user_id": bought["user_id"]}
