"""A payment's lifecycle on its transaction row, and the renewal attempts of its invoice (spec section 3):
each status report moves the transaction through `domain.lifecycle.PAYMENT`, and each renewal charge seen
to end (settled, held, declined) ends its invoice's dunning once, through `domain.lifecycle.DUNNING`."""

from __future__ import annotations

from billingctl.adapters.payloads import Payment
from billingctl.domain import lifecycle
from billingctl.services import fraud_quota
from billingctl.services.lifecycles import report_illegal

# The orchestrator's statuses of a payment that captured money (in full, or in part): recording follows.
CAPTURED_STATUSES = ("SETTLED", "PARTIALLY_SETTLED")


def _lane_of(uow, payment: Payment) -> str | None:
    lane = payment.metadata.lane
    if lane or not payment.order_id:
        return lane
    return uow.checkouts.lane_of_order(payment.order_id)


def update_transaction_status(container, payment: Payment) -> dict:
    """PAYMENT.STATUS other than a capture: the transaction row follows the payment's lifecycle
    (domain.lifecycle.PAYMENT). A status the orchestrator does not document, or one that contradicts what
    we hold, is refused: logged, counted and alerted; stale news (PENDING after DECLINED) changes nothing."""
    payment = Payment.read(payment)
    now = container.clock.now()
    with container.uow() as uow:
        fraud_quota.count_authorization(uow, now, payment, _lane_of(uow, payment), payment.customer_id)
        step = save_transaction(container, uow, payment.id, payment.status, now, amount=payment.charged,
                                currency_code=payment.currency_code, customer_id=payment.customer_id,
                                invoice_id=payment.invoice_id, processor=payment.processor.name or None,
                                subscription_id=payment.metadata.subscription_id or None,
                                processor_merchant_id=payment.processor.merchant_id or None)
        uow.commit()
    status = lifecycle.payment_status(payment.status)
    outcome = {"apply": "status_updated", "same": "status_updated", "stale": "stale"}.get(step, "illegal")
    return {"payment_id": payment.id, "outcome": outcome, "status": status or payment.status}


def save_transaction(container, uow, payment_id: str, orchestrator_status: str | None, now, **values) -> str:
    """One step of a payment's lifecycle on its transaction row: inserted when new, else moved by a
    conditional update from the states the table allows (a racing writer cannot move it backwards).
    Returns the step taken ("apply", "same", "stale" or "illegal")."""
    target = lifecycle.payment_status(orchestrator_status)
    if target is None:
        report_illegal(container, uow, lifecycle.IllegalTransition("payment", payment_id, None,
                                                                    str(orchestrator_status)))
        return lifecycle.Step.ILLEGAL.value
    if uow.transactions.insert(payment_id, target, now, **values):  # the first report: any status may open it
        return lifecycle.Step.APPLY.value
    while True:
        current = uow.transactions.status(payment_id)
        step = lifecycle.PAYMENT.step(current, target)
        if step != lifecycle.Step.APPLY:
            break
        if uow.transactions.move(payment_id, target, lifecycle.PAYMENT.sources(target), now, **values):
            return step.value
        # another writer moved it first: judge again against what it wrote
    if step == lifecycle.Step.ILLEGAL:
        report_illegal(container, uow, lifecycle.IllegalTransition("payment", payment_id, current, target))
    return step.value


def end_renewal_attempt(container, uow, invoice: dict, payment_id: str, outcome: str, attempted: bool = False,
                        **facts) -> bool:
    """A renewal charge seen to end (settled, or held) on any path ends its invoice's dunning, once
    (domain.lifecycle.DUNNING): its pending row is resolved and the outcome written; with no pending row
    (its answer was lost, or another path recorded it first), the outcome follows the invoice's last
    unfinished attempt. `attempted`: the renewals tick's own direct answer, written even as the first row."""
    pending = uow.dunning.pending_for_payment(payment_id)
    if pending is not None:
        return dunning_step(container, uow, pending, outcome, resolves=pending, decline_code=None)
    newest = uow.dunning.newest(invoice["id"])
    if newest is None and not attempted:
        return False  # not an invoice the renewals tick charged
    if newest is not None and newest["status"] == "held" and outcome == "succeeded" \
            and newest["payment_id"] == payment_id:  # held as captured in part, captured in full since
        return dunning_step(container, uow, invoice, outcome, payment_id=payment_id, **facts)
    if newest is not None and (newest["status"] in lifecycle.DUNNING_ENDED or newest["status"] == "pending"):
        return False  # ended already (or another charge is in flight: its own end will come)
    return dunning_step(container, uow, invoice, outcome, payment_id=payment_id, **facts)


NO_ANSWER = "error"  # the dunning status of a charge whose answer was lost: it may or may not have been made


def dunning_step(container, uow, invoice: dict, status: str, resolves: dict | None = None, **values) -> bool:
    """Write one step of an invoice's dunning (domain.lifecycle.DUNNING): `resolves` names the pending row
    this outcome ends (a conditional update: False when another path ended it first). A step the table
    does not allow is reported, not written."""
    invoice_id = invoice.get("invoice_id") or invoice["id"]
    now = container.clock.now()
    newest = uow.dunning.newest(invoice_id)
    source = newest["status"] if newest is not None else None
    if resolves is not None:
        if not uow.dunning.resolve(resolves["id"], now):
            return False
        source = "pending"
        for key in ("attempt_no", "lane", "processor", "amount", "payment_id"):
            values.setdefault(key, resolves[key])
    if source in lifecycle.DUNNING_ENDED and (status == NO_ANSWER or (
            status == "pending" and values.get("payment_id") and newest["payment_id"] == values["payment_id"])):
        # A charge whose answer was lost, or came back in flight, after another path saw the dunning end
        # (its notification came first; in flight: by this very payment): no news, nothing to write
        # (decisions 231, 232). A charge in flight on an invoice another payment ended stays illegal.
        return False
    if lifecycle.DUNNING.step(source, status) != lifecycle.Step.APPLY:
        report_illegal(container, uow, lifecycle.IllegalTransition("dunning", invoice_id, source, status))
        return False
    uow.dunning.add(invoice_id=invoice_id, subscription_id=invoice.get("subscription_id"),
                    user_id=invoice.get("customer_id") or invoice.get("user_id"), created_at=now, status=status,
                    **values)
    if status in lifecycle.RETRYABLE and (paid := uow.books.paid_by(invoice_id)) is not None:
        # A charge that ended unpaid on an invoice another payment pays (a cheque entered at the provider
        # while it was in flight, whose record left the dunning to it): the dunning ends by that payment
        # (decision 193), so nothing retries and reconcile's `dunning_unfinished` names nothing.
        dunning_step(container, uow, invoice, "succeeded", payment_id=paid.transaction_id, amount=paid.amount)
    return True
