"""Unified payment recording and subscription activation (spec sections 1, 2, 3 and 4).

`record_payment` is the one service every path uses when it learns of a settled payment (the
orchestrator webhook, the event poller, the settled-payments poller, the workflow-completion
callback, the CLI). In one database transaction it writes the purchase (unique transaction_id =
the orchestrator payment id), the transaction, and the plan's credits through a ledger row whose
unique source key makes a second application impossible; then, under a per-subscription lock, it
records the payment on the provider's invoice and activates the pending subscription."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta

from billingctl.adapters.db.purchases import CAPTURED_IN_PART, ledger_row, transaction_row
from billingctl.adapters.faults import crash_point
from billingctl.adapters.payloads import Invoice, Payment, Subscription
from billingctl.domain import errors as e
from billingctl.domain import lifecycle
from billingctl.domain.batch import BatchResult
from billingctl.domain.clock import parse_time
from billingctl.domain.plans import require_id
from billingctl.domain.refunds import credits_to_reverse, share_refunded
from billingctl.services import alerts, catalog, fraud_quota, review
from billingctl.services.invoices import apply_copy, name_invoice, owed_again, save_copy
from billingctl.services.lifecycles import report_illegal
from billingctl.services.processor_lock import lock_after_settle
from billingctl.services.sync import subscription_gone, write_remote_subscription

log = logging.getLogger("billingctl.payments")
REFUND_FAILED_TEXT = "Refund of payment {payment_id} failed at the processor - manual action required"

# The orchestrator's statuses of a payment that captured money (in full, or in part): recording follows.
CAPTURED_STATUSES = ("SETTLED", "PARTIALLY_SETTLED")
# How long a renewal's payment waits for the provider to confirm the workflow's record on its invoice (its
# payment_succeeded event, read by the poll every minute) before the activations job records it itself.
WORKFLOW_CONFIRMATION = timedelta(minutes=15)


@dataclass
class PaymentFacts:
    payment_id: str
    user_id: str
    subscription_id: str
    invoice_id: str | None
    item_price_id: str
    lane: str
    amount: int
    currency_code: str
    credits: int
    processor: str | None
    merchant_id: str | None
    settled_at: datetime | None
    # What the checkout session asked for (None when the payment is not a checkout's): a payment that does
    # not match is held for review, never credited.
    expected_amount: int | None = None
    expected_currency: str | None = None
    provider_side: bool = False  # entered at the provider (decision 112)
    # A merchant-initiated renewal charge on its invoice: the orchestrator's workflow records it there, and
    # the provider's payment_succeeded event confirms it (issue 39 item 1: nothing bought twice).
    renewal: bool = False


_UNREAD = object()


def facts_from_payment(container, payment: Payment, checkout=_UNREAD) -> PaymentFacts:
    """What recording needs, from the payment plus our own checkout record (`checkout`: the session its
    order names, when the caller read it already); the provider is asked only for what we do not hold locally."""
    payment = Payment.read(payment)
    if payment.status not in CAPTURED_STATUSES:
        raise e.InvalidInput(f"payment {payment.id} is {payment.status}, not SETTLED")
    metadata = payment.metadata
    order_id = payment.order_id or None
    subscription_id = metadata.subscription_id or None
    item_price_id = metadata.item_price_id or None
    user_id = payment.user_id
    invoice_id = payment.invoice_id
    expected = (None, None)
    if order_id:
        row = checkout
        if row is _UNREAD:
            with container.uow(autocommit=True) as reader:
                row = reader.checkouts.by_order_id(order_id)
        if row is not None:
            expected = (int(row["amount"]), row["currency_code"])
            invoice_id = row["invoice_id"] if row["invoice_id"] != row["subscription_id"] else None
            subscription_id = subscription_id or row["subscription_id"]
            item_price_id = item_price_id or row["item_price_id"]
            user_id = user_id or row["user_id"]
    if not subscription_id and invoice_id:  # our copy first: the provider finds no invoice finance deleted
        with container.uow(autocommit=True) as reader:
            copy = reader.invoices.get(invoice_id)
        subscription_id = (copy["subscription_id"] if copy is not None else None) or \
            container.provider.get_invoice(invoice_id).subscription_id
    if not subscription_id:
        raise e.InvalidInput(f"payment {payment.id} names no subscription or invoice")
    if not item_price_id:
        with container.uow(autocommit=True) as uow:
            item_price_id = uow.subscriptions.item_price_id(subscription_id)
    if not item_price_id:
        remote = container.provider.get_subscription(subscription_id)
        item_price_id = remote.item_price_id
        user_id = user_id or remote.customer_id
    if not user_id:
        raise e.InvalidInput(f"payment {payment.id} names no customer")
    plan = catalog.plan(container, item_price_id)
    return PaymentFacts(
        payment_id=payment.id, user_id=str(user_id), subscription_id=subscription_id, invoice_id=invoice_id,
        item_price_id=item_price_id, lane=metadata.lane or plan.lane, amount=payment.charged,
        currency_code=payment.currency_code or plan.currency_code, credits=plan.credits,
        processor=payment.processor.name or None, merchant_id=payment.processor.merchant_id or None,
        settled_at=payment.settled_at, expected_amount=expected[0], expected_currency=expected[1],
        renewal=bool(invoice_id) and expected == (None, None) and payment.is_renewal)


def record_payment(container, payment: Payment, path: str, followups: bool = True, provider_side: bool = False,
                   term_paid: bool = False) -> dict:
    """Record a settled payment exactly once, then record it at the provider and activate.
    `provider_side`: a payment entered at the provider, not the orchestrator's (a cheque, a wire): never
    posted back to the provider, and its invoice's term is credited once, when `term_paid` (decision 112)."""
    payment = Payment.read(payment)  # typed already, or a stored notification's payment (read once here)
    done, bought, checkout = _finished_duplicate(container, payment)
    if done is not None and followups:
        return done
    if bought is not None:  # recorded before: nothing to write; only its follow-ups may be left
        result = {"payment_id": payment.id, "outcome": "duplicate", **bought, "credits_applied": 0}
        if followups and _AFTER_RESPONSE.get() is not None:
            _followups(container, result)  # queued: they take the subscription's lock once the answer is sent
        elif followups:
            with container.locks.hold(f"subscription:{bought['subscription_id']}"):
                _followups(container, result)
        return result
    facts = facts_from_payment(container, payment, checkout)
    if provider_side:
        facts.provider_side = True
        facts.credits = facts.credits if term_paid and facts.invoice_id else 0
    # A refund made in review stands, whatever was captured since: in full, or more and still in part.
    if payment.refund_asked and (kept_back := _refunded_in_review(container, payment, facts)):
        return kept_back
    # A payment entered at the provider pays whatever finance entered on the invoice, not an order of ours.
    held = None if provider_side else _mismatch(container, payment, facts)
    if held is not None:
        return _hold_mismatch(container, payment, facts, held, path)
    with container.locks.hold(f"subscription:{facts.subscription_id}"):
        result = _record_locally(container, facts, path, payment)
        if result["outcome"] in ("orphaned", "held_frozen"):
            return result
        if followups:
            _followups(container, result)
    refunded = payment.refunded
    if refunded and result["outcome"] == "recorded":
        # Recorded after it was refunded (a late poller): the refund reports may all be behind us.
        result["refund"] = reverse_refund(container, facts.payment_id, refunded, path)
    if result["outcome"] == "recorded" and facts.lane == "nsfw" and _is_checkout_payment(payment):
        token = payment.payment_method.token
        result["set_primary"] = set_primary_after_first_payment(container, facts.user_id, token)
    return result


REFUNDED_IN_REVIEW = ("refunded", "refunded_elsewhere")  # a review row's resolutions that returned the money


def returned_in_review(row) -> bool:
    """A review row (or None) that ended with its payment's money returned: refunded as a duplicate, or
    resolved by a refund (a person's, or found refunded elsewhere)."""
    return row is not None and (row["status"] == "duplicate_refunded" or (
        row["status"] in lifecycle.REVIEW_REFUNDED and row["resolution"] in REFUNDED_IN_REVIEW))


def _refunded_in_review(container, payment: Payment, facts: PaymentFacts) -> dict | None:
    """A payment whose review ended with its money returned (a person's or recovery's refund of what a
    capture in part took), captured again since (the rest, by a capture that was not final): the refund
    stands, so the rest is refunded too and nothing is credited, with one alert (decision 237). None for
    any other payment."""
    with container.uow(autocommit=True) as uow:
        row = uow.orphans.get(payment.id)
    if not returned_in_review(row):
        return None
    answer = refund(container, payment.id, "refunded in review")
    with container.uow() as uow:
        alerts.raise_alert(uow, container.clock, f"Payment {payment.id} of user {facts.user_id}, refunded in review, "
                                                 "was captured again: what it took since is refunded too, nothing "
                                                 "credited", f"refunded-then-captured:{payment.id}",
                           payment_id=payment.id, user_id=facts.user_id, refunded=answer.refunded,
                           pending=answer.refund_pending, taken=answer.taken)
        uow.commit()
    log.warning("payment refunded in review captured again; the rest refunded",
                extra={"payment_id": payment.id, "user_id": facts.user_id})
    return {"payment_id": payment.id, "outcome": "refunded_in_review", "subscription_id": facts.subscription_id,
            "user_id": facts.user_id, "credits_applied": 0}


def _followups(container, result: dict) -> None:
    """The provider follow-ups of a recorded payment, under its subscription's lock (held by the caller): made
    now, or, in a webhook, once its answer is sent. The subscription is the purchase's (orphan recovery may
    have recorded it elsewhere)."""
    deferred = _AFTER_RESPONSE.get()
    if deferred is not None:  # a webhook: its provider calls run once its answer is sent
        deferred.add(result["subscription_id"])
        result["followups"] = "after_response"
    else:
        result.update(complete_followups(container, result["subscription_id"]))


def _finished_duplicate(container, payment: Payment) -> tuple[dict | None, dict | None, object]:
    """The duplicate fast path, one read before any lock, provider call or transaction: (the answer for a
    payment with nothing left to do: purchased, recorded on its provider invoice, its subscription active
    with no activation pending; the (subscription_id, user_id) of a payment purchased already, whose
    follow-ups may be left; the checkout session the payment's order names, which recording needs next)."""
    if payment.status != "SETTLED":
        return None, None, _UNREAD  # the full path refuses it with the right message
    from billingctl.adapters.db.purchases import finished

    row = finished(container.autocommit_engine, payment.id, payment.order_id or None)
    checkout = {k.removeprefix("checkout_"): v for k, v in row.items() if k.startswith("checkout_")}
    checkout = checkout if checkout["id"] is not None else None
    if row["bought_subscription_id"] is None:
        return None, None, checkout
    bought = {"subscription_id": row["bought_subscription_id"], "user_id": row["bought_user_id"]}
    if not row["finished"]:
        return None, bought, checkout
    return {"payment_id": payment.id, "outcome": "duplicate", **bought, "credits_applied": 0,
            "provider_recorded": True, "activation": "already_active"}, bought, checkout


def _confirm_after(uow, facts: PaymentFacts, now) -> datetime | None:
    """Until when a renewal's payment waits for the provider to confirm the workflow's record on its
    invoice; None (no wait) for anything else, and for an invoice we hold voided or deleted: that record is
    refused, and the follow-up that learns it refunds the payment (decisions 113, 201) without a
    quarter-hour's delay."""
    if not facts.renewal or facts.provider_side:
        return None
    local = uow.invoices.get(facts.invoice_id)
    return None if local is not None and (local["status"] == "voided" or local["deleted_at"] is not None) \
        else now + WORKFLOW_CONFIRMATION


def _is_checkout_payment(payment: Payment) -> bool:
    return payment.payment_method.payment_type == "FIRST_PAYMENT"


def set_primary_after_first_payment(container, user_id: str, token: str | None) -> bool:
    """NSFW checkout: make the new card the user's primary instrument; failure is not fatal. Logged as the
    checkout's (`billingctl.checkout`), where the spec's markers have always been."""
    checkout_log = logging.getLogger("billingctl.checkout")
    try:
        if not token:
            raise e.InvalidInput("the payment carries no vaulted token")
        container.orchestrator.set_default_instrument(token)
    except e.BillingError as exc:
        checkout_log.warning("nsfw_checkout_set_primary_failed", extra={"user_id": user_id, "error": exc.message})
        return False
    checkout_log.info("nsfw_checkout_set_primary", extra={"user_id": user_id})
    return True


def _unrecorded_gates(uow, facts: PaymentFacts) -> tuple[bool, bool, bool, bool, bool, bool]:
    """(the subscription is cancelled, the user is frozen, the user already holds another live subscription
    of the plan, a dispute on the payment was lost), each only while this payment has no purchase yet,
    whether the user's row exists, and whether the payment waits for a person as captured in part: one read."""
    row = uow.purchases.gates(facts.payment_id, facts.subscription_id, facts.user_id, facts.item_price_id)
    bought = row["bought"]
    return (row["status"] == "cancelled" and not bought, row["frozen_at"] is not None and not bought,
            bool(row["same_plan"] or row["paid_other"]) and not bought, bool(row["charged_back"]) and not bought,
            bool(row["user_exists"]), bool(row["held_in_part"]))


def _left_to_orphan_recovery(facts: PaymentFacts, message: str) -> dict:
    log.warning(message, extra={"payment_id": facts.payment_id, "subscription_id": facts.subscription_id})
    return {"payment_id": facts.payment_id, "outcome": "orphaned", "subscription_id": facts.subscription_id,
            "user_id": facts.user_id, "credits_applied": 0}


def _hand_to_recovery(uow, now, facts: PaymentFacts, message: str) -> dict:
    """Nothing credited: the payment's review row is opened in the caller's transaction, for orphan recovery."""
    review.open_row(uow, now, payment_id=facts.payment_id, user_id=facts.user_id,
                    subscription_id=facts.subscription_id, item_price_id=facts.item_price_id,
                    amount=facts.amount, currency_code=facts.currency_code, settled_at=facts.settled_at)
    uow.commit()
    return _left_to_orphan_recovery(facts, message)


def _record_locally(container, facts: PaymentFacts, path: str, payment: Payment) -> dict:
    now = container.clock.now()
    with container.uow() as uow:
        # The gates first: they take the user's row, as the quota's reservation does before its own writes.
        cancelled, frozen, same_plan, charged_back, known, held_in_part = _unrecorded_gates(uow, facts)  # user's row
        fraud_quota.count_authorization(uow, now, payment, facts.lane, facts.user_id)

        def held(to: str) -> None:  # captured in full since it was held as captured in part (decision 226)
            if held_in_part:
                review.captured_in_full(container, uow, facts.payment_id, facts.user_id, to)

        if charged_back:
            # A chargeback lost before this payment was recorded (its notification lost, the poller behind):
            # the money went back to the customer, and the loss found no credits to take back. Nothing is
            # credited or subscribed; orphan recovery ends its row `charged_back` (decision 203).
            held("retrying")
            return _hand_to_recovery(uow, now, facts, "payment charged back before it was recorded; left to orphan "
                                                      "recovery")
        if path == "orphan_recovery":  # recovery decided the rest; a freeze made meanwhile still holds
            if frozen:  # (decision 177): the attempt fails, and the next one holds the payment for a person
                raise review.frozen_refusal(facts.user_id, facts.payment_id)
            cancelled = same_plan = False
        if same_plan and not payment.is_renewal and not cancelled and not frozen:
            # A second checkout of a plan the customer already holds live, or a checkout paid twice (two
            # tabs of one payment form): the same-plan duplicate path of orphan recovery refunds it with one
            # alert; nothing is credited (a future subscription of its own is cancelled by the cleanup job).
            held("retrying")
            return _hand_to_recovery(uow, now, facts, "second payment for a plan the customer already holds; left "
                                                      "to orphan recovery to refund")
        if cancelled and facts.invoice_id and payment.is_renewal:
            # A renewal charge that settled after its subscription was cancelled (decision 107): it pays the
            # period of its own invoice, which the workflow already marked paid at the provider. Recorded
            # there once, credited once; never handed to orphan recovery, which would start a new
            # subscription and put the same payment on its first invoice too.
            cancelled = False
            log.info("renewal settled after its subscription was cancelled: its paid period is honoured",
                     extra={"payment_id": facts.payment_id, "subscription_id": facts.subscription_id})
        if cancelled:
            held("retrying")
            uow.commit()
            # A checkout-retry orphan: settled for a cancelled subscription. The settled-payments poller
            # recovers it (re-subscribe or refund); recording it here would credit a dead plan.
            return _left_to_orphan_recovery(facts, "payment settled for a cancelled subscription; left to orphan "
                                                   "recovery")
        if frozen:
            # Spec section 4: a freeze disables further payments. A person decides (refund, or unfreeze
            # and retry); nothing is credited or activated meanwhile.
            held("needs_review")
            review.hold_frozen(uow, container.clock, payment_id=facts.payment_id, user_id=facts.user_id,
                               subscription_id=facts.subscription_id, item_price_id=facts.item_price_id,
                               amount=facts.amount, currency_code=facts.currency_code, settled_at=facts.settled_at)
            uow.commit()
            log.warning("payment settled for a frozen user; held for manual review",
                        extra={"payment_id": facts.payment_id, "user_id": facts.user_id})
            return {"payment_id": facts.payment_id, "outcome": "held_frozen", "subscription_id": facts.subscription_id,
                    "user_id": facts.user_id, "credits_applied": 0}
        # A term paid at the provider in several parts (a cheque, then a wire) is credited once, by its invoice.
        term_key = f"invoice:{facts.invoice_id}" if facts.provider_side else f"payment:{facts.payment_id}"
        # Analytics in the same transaction: one notification per recorded payment, whatever the path.
        analytics = alerts.outbox_row(container.clock, "analytics", {
            "event": "payment_recorded", "payment_id": facts.payment_id, "user_id": facts.user_id,
            "subscription_id": facts.subscription_id, "item_price_id": facts.item_price_id, "lane": facts.lane,
            "amount": facts.amount, "currency_code": facts.currency_code, "credits": facts.credits, "path": path,
        }, f"analytics:payment:{facts.payment_id}")
        transaction = dict(amount=facts.amount, currency_code=facts.currency_code, customer_id=facts.user_id,
                           invoice_id=facts.invoice_id, subscription_id=facts.subscription_id,
                           processor=facts.processor, processor_merchant_id=facts.merchant_id)
        # User, purchase, transaction, ledger and balance, subscription and outbox: one statement on PostgreSQL.
        written = uow.new_payments.record(known, {
            "invoice_id": facts.invoice_id, "transaction_id": facts.payment_id,
            "subscription_id": facts.subscription_id, "user_id": facts.user_id, "item_price_id": facts.item_price_id,
            "amount": facts.amount, "currency_code": facts.currency_code, "credits": facts.credits,
            "processor": facts.processor, "recorded_via": path, "settled_at": facts.settled_at, "created_at": now,
            # A payment the provider itself holds is never posted back to it (that would pay the invoice twice);
            # recorded there when its transaction is dated, maybe hours before we read its event.
            "provider_recorded_at": (facts.settled_at or now) if facts.provider_side else None,
            # A renewal's record on its invoice is the workflow's; ours only if no confirmation came meanwhile.
            "confirm_after": _confirm_after(uow, facts, now),
        }, transaction_row(facts.payment_id, lifecycle.payment_status("SETTLED"), now, **transaction),
            ledger_row(facts.user_id, facts.credits, term_key, "payment", facts.payment_id, now)
            if facts.credits > 0 or not facts.provider_side else None,
            {"id": facts.subscription_id, "status": "future", "customer_id": facts.user_id, "created_at": now,
             "coupon_ids": [], "item_price_id": facts.item_price_id, "lane": facts.lane,
             "activation_pending_since": now}, analytics)
        if not written.purchase:
            stored = uow.purchases.by_payment_id(facts.payment_id)
            return {"payment_id": facts.payment_id, "outcome": "duplicate",
                    "subscription_id": stored["subscription_id"], "user_id": stored["user_id"], "credits_applied": 0}
        if not written.transaction:  # opened by an earlier status report: moved through its lifecycle
            save_transaction(container, uow, facts.payment_id, "SETTLED", now, **transaction)
        credited = written.credited
        held("recovered")  # it matches its order: recorded
        if facts.invoice_id:  # a renewal charge ends here, whichever path saw it settle
            end_renewal_attempt(container, uow, _invoice_of(facts), facts.payment_id, "succeeded",
                                amount=facts.amount)
        if facts.invoice_id:  # its status is the provider's copy's (decision 117), written by the follow-up
            name_invoice(uow, facts.invoice_id, now, subscription_id=facts.subscription_id, customer_id=facts.user_id,
                         total_amount=facts.amount, currency_code=facts.currency_code,
                         paid_at=facts.settled_at or now)
        lock = lock_after_settle(uow, container, user_id=facts.user_id, payment_lane=facts.lane,
                                 processor=facts.processor, merchant_id=facts.merchant_id)
        crash_point(container.settings, "record.before_commit")
        uow.commit()
    crash_point(container.settings, "record.after_commit")
    alerts.logged(analytics, True)
    if facts.settled_at is not None:
        container.metrics.payment_recording_latency.observe(max(0.0, (now - facts.settled_at).total_seconds()))
    container.metrics.payments_recorded.labels(path=path).inc()
    log.info("payment recorded", extra={"payment_id": facts.payment_id, "user_id": facts.user_id, "path": path,
                                        "credits": facts.credits, "lock_outcome": lock.outcome})
    return {"payment_id": facts.payment_id, "outcome": "recorded", "subscription_id": facts.subscription_id,
            "user_id": facts.user_id, "credits_applied": facts.credits if credited else 0,
            "lock": asdict(lock)}


def apply_credits(uow, user_id: str, amount: int, source_key: str, reason: str, payment_id: str | None, now) -> bool:
    """One ledger row per source key; users.credits moves only when the row is new."""
    return uow.ledger.apply(user_id, amount, source_key, reason, payment_id, now)


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


def _invoice_of(facts: PaymentFacts) -> dict:
    return {"id": facts.invoice_id, "subscription_id": facts.subscription_id, "customer_id": facts.user_id}


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


# ---- captured money that does not match its order: held for review, never credited --------------------

def _expected_charge(container, facts: PaymentFacts) -> tuple[int | None, str | None]:
    """(amount, currency) the payment should carry: its checkout session's, else the renewal attempt's
    (the amount we asked the orchestrator to charge on the invoice). (None, None) when we asked for none."""
    if facts.expected_amount is not None:
        return facts.expected_amount, facts.expected_currency
    if not facts.invoice_id:
        return None, None
    with container.uow(autocommit=True) as uow:
        charged = uow.dunning.charged_amount(facts.payment_id)
    return (int(charged), None) if charged is not None else (None, None)


def _mismatch(container, payment: Payment, facts: PaymentFacts) -> str | None:
    """Why a captured payment cannot be credited as its order's (None when it can): a partial settle, an
    amount captured below the amount, another amount or another currency than the order's."""
    if payment.captured_in_part:
        return CAPTURED_IN_PART
    amount, currency = _expected_charge(container, facts)
    if currency is not None and facts.currency_code != currency:
        return "currency_mismatch"
    if amount is not None and facts.amount != amount:
        return "amount_mismatch"
    return None


def captured_in_part_reason(payment: Payment) -> str:
    """Why a payment captured in part waits for a person, as its review row says it."""
    return (f"{CAPTURED_IN_PART}: captured {int(payment.processor.amount_captured or 0)} of {payment.charged} "
            f"{payment.currency_code}")


def _hold_mismatch(container, payment: Payment, facts: PaymentFacts, reason: str, path: str) -> dict:
    """Money was captured, but not what the order asked for: nothing is credited, activated or reported to
    the provider; the payment waits in the review queue (`orphans show/resolve`) with one chat alert, and a
    renewal's attempt ends `held` (no automatic charge follows it)."""
    now = container.clock.now()
    detail = captured_in_part_reason(payment) if reason == CAPTURED_IN_PART else \
        f"{reason}: {facts.amount} {facts.currency_code}"
    with container.uow() as uow:
        fraud_quota.count_authorization(uow, now, payment, facts.lane, facts.user_id)
        save_transaction(container, uow, facts.payment_id, payment.status, now, amount=facts.amount,
                         currency_code=facts.currency_code, customer_id=facts.user_id, invoice_id=facts.invoice_id,
                         subscription_id=facts.subscription_id, processor=facts.processor,
                         processor_merchant_id=facts.merchant_id)
        new = review.hold_mismatch(uow, container.clock, payment_id=facts.payment_id, user_id=facts.user_id,
                                   subscription_id=facts.subscription_id, item_price_id=facts.item_price_id,
                                   amount=facts.amount, currency_code=facts.currency_code, settled_at=facts.settled_at,
                                   reason=detail)
        if facts.invoice_id:
            end_renewal_attempt(container, uow, _invoice_of(facts), facts.payment_id, "held", amount=facts.amount)
        uow.commit()
    if new:
        container.metrics.payments_held.labels(reason=reason).inc()
        log.warning("payment held for review: it does not match its order",
                    extra={"payment_id": facts.payment_id, "user_id": facts.user_id, "reason": reason, "path": path})
    return {"payment_id": facts.payment_id, "outcome": "held_mismatch", "reason": reason,
            "subscription_id": facts.subscription_id, "user_id": facts.user_id, "credits_applied": 0}


# ---- follow-ups at the provider: record on the invoice, activate --------------------------------

class AfterResponse:
    """The provider follow-ups a web request recorded (issue 39 item 3): the request answers from our
    database alone, and these run once its answer is sent (the WSGI server closes the response), never
    waiting for the budget. The database is their durable queue: a purchase not yet on its invoice, a
    subscription still to activate; if this process dies first, or a call fails, the activations job
    finishes them with the same idempotency keys."""

    def __init__(self, container):
        self.container = container
        self.subscriptions: list[str] = []

    def add(self, subscription_id: str) -> None:
        if subscription_id not in self.subscriptions:
            self.subscriptions.append(subscription_id)

    def run(self) -> None:
        from billingctl.adapters.ratelimit import MONEY, budget

        for subscription_id in self.subscriptions:
            try:
                # As inside the request: one attempt a call, no wait for the budget (the job does the rest).
                with self.container.locks.hold(f"subscription:{subscription_id}"), budget(MONEY, no_wait=True), \
                        self.container.provider.http.attempts(1):
                    complete_followups(self.container, subscription_id)
            except Exception as exc:  # noqa: BLE001 - the answer is sent; the activations job retries
                log.warning("follow-up after the webhook's answer failed; the activations job retries: %s",
                            getattr(exc, "message", type(exc).__name__), extra={"subscription_id": subscription_id})


_AFTER_RESPONSE: ContextVar[AfterResponse | None] = ContextVar("followups_after_response", default=None)


@contextmanager
def followups_after_response(container):
    """Inside: recording hands its provider follow-ups to the returned AfterResponse instead of making them."""
    deferred = AfterResponse(container)
    token = _AFTER_RESPONSE.set(deferred)
    try:
        yield deferred
    finally:
        _AFTER_RESPONSE.reset(token)


def complete_followups(container, subscription_id: str) -> dict:
    """Activate the subscription (which, for a pending checkout, starts it and names the invoice its
    payment belongs to), then record every unreported purchase on its invoice. Failures leave the work
    pending (listed by `health`, retried by the activations job)."""
    from billingctl.adapters.ratelimit import MONEY, budget

    with budget(MONEY):  # recording and activation take the budget's reserved share
        return _complete_followups(container, subscription_id)


def _complete_followups(container, subscription_id: str) -> dict:
    result = {"provider_recorded": True, "activation": None}
    try:
        result["activation"] = activate_subscription(container, subscription_id, _locked=True)["outcome"]
    except e.PaymentNotRecorded:
        raise
    except e.BillingError as exc:
        result["activation"] = "pending"
        result["activation_error"] = exc.message
    with container.uow(autocommit=True) as uow:
        pending = uow.purchases.unreported(subscription_id, container.clock.now())
    for row in pending:
        reported = report_to_provider(container, row) if row["invoice_id"] else False
        if reported in UNPAID_PERIOD:  # refunded: its period is not this payment's
            result["refunded_unpaid_period"] = row["transaction_id"]
        elif not reported:
            result["provider_recorded"] = False
    return result


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


def _invoice_copy(container, invoice_id: str) -> Invoice | None:
    try:
        return container.provider.get_invoice(invoice_id)
    except e.BillingError:
        return None


STARTED = ("in_trial", "active", "non_renewing")


def activate_subscription(container, subscription_id: str, _locked: bool = False, dry_run: bool = False) -> dict:
    """future -> active, only when a purchase exists: start the subscription at the provider (its start
    date moved to now; the provider invoices the first term), give the invoice to the purchase that
    paid it, then the local copy."""
    require_id(subscription_id, "subscription_id")
    if not _locked and not dry_run:
        with container.locks.hold(f"subscription:{subscription_id}"):
            return activate_subscription(container, subscription_id, _locked=True)
    with container.uow(autocommit=True) as uow:
        bought = uow.purchases.first_of_subscription(subscription_id)
        local = uow.subscriptions.get(subscription_id)
    if bought is None:
        raise e.PaymentNotRecorded(
            f"no purchase exists for subscription {subscription_id}: the payment was never recorded")
    if local is not None and local["status"] == "active" and bought.invoice_id:
        return {"subscription_id": subscription_id, "outcome": "already_active", "status": "active"}
    if dry_run:  # every check of the real run passed; it would start the subscription at the provider now
        return {"subscription_id": subscription_id, "outcome": "would_activate", "dry_run": True,
                "status": local["status"] if local is not None else None}
    if local is not None and local["status"] == "cancelled" and not bought.invoice_id:
        return _orphan_cancelled_checkout(container, subscription_id)
    now = container.clock.now()
    try:
        if bought.invoice_id:
            # Started before (its first term's invoice is assigned): nothing to start. A second start would
            # reuse the first one's idempotency key within its second, and the provider would replay "active"
            # for a subscription cancelled since. The provider's copy decides what the local one says.
            remote, first_invoice = _started_copy(container, subscription_id), None
        else:
            remote, first_invoice = _start_at_provider(container, subscription_id)
        if remote.current_term_end is None and bought.item_price_id:
            period = catalog.plan(container, bought.item_price_id).period_days
            term_end = container.provider.now(now) + timedelta(days=period)
            remote = container.provider.change_term_end(subscription_id, term_end).subscription
        listed = not bought.invoice_id and first_invoice is None  # not the answer to our start (decision 250)
        if not bought.invoice_id:
            first_invoice = first_invoice or _first_term_invoice(container, subscription_id)
        crash_point(container.settings, "activate.after_provider")
    except CancelledAtProvider as cancelled:
        return _orphan_cancelled_checkout(container, subscription_id, cancelled.remote)
    except e.ExternalNotFound:  # deleted at the provider (its event not read yet): a cancelled one (decision 222)
        subscription_gone(container, subscription_id, source="activation")
        return _orphan_cancelled_checkout(container, subscription_id)
    except e.ExternalError as exc:
        container.metrics.activation_errors.inc()
        with container.uow() as uow:
            uow.subscriptions.set(subscription_id, activation_error=exc.message[:500])
            uow.commit()
        log.error("activation failed: %s", exc.message, extra={"subscription_id": subscription_id})
        raise
    with container.uow() as uow:
        if not bought.invoice_id and first_invoice:
            _assign_invoice(container, uow, bought, subscription_id, first_invoice, tried=listed)
        write_remote_subscription(container, uow, remote, "activation", activation_pending_since=None,
                                  activation_error=None)
        uow.commit()
    if bought.invoice_id:
        return {"subscription_id": subscription_id, "outcome": "already_active", "status": remote.status}
    log.info("subscription activated", extra={"subscription_id": subscription_id})
    return {"subscription_id": subscription_id, "outcome": "activated", "status": remote.status}


def _start_at_provider(container, subscription_id: str) -> tuple[Subscription, Invoice | None]:
    """(the started subscription, the invoice starting it generated). A subscription that is already
    started (an earlier attempt whose answer was lost) is read back instead."""
    provider, sent, status = container.provider, None, None
    for _ in range(2):
        # The start is the provider's "now" (its clock, from its answers' Date header: decision 115). Each
        # answer teaches that clock afresh: a start our clock put in the provider's future (kept future) or
        # too far in its past (backdating, refused) is sent once more when the provider's clock, as its
        # answer showed it, names another start; never twice the same.
        start = provider.now(container.clock.now())
        if start == sent:
            if status is None:
                break  # refused, and its clock names the same start: sending it again is refused again
            # Kept future, and the answer is dated in the very second it kept: the provider read its clock in
            # the second before and its answer left after the turn. Its clock has reached the kept start, so
            # a second earlier is its "now" and a new request, not a replay (decision 241).
            start -= timedelta(seconds=1)
        sent = start
        try:
            # One key per start date: a retry within this call reuses it, but a later attempt is a new
            # request, never a replay of an earlier answer that only moved the start.
            answer = provider.start_subscription(
                subscription_id, start, idempotency_key=f"activate:{subscription_id}:{int(start.timestamp())}")
        except e.ExternalInvalidRequest as exc:
            if exc.details.get("api_error_code") == "invalid_state_for_request":
                return _started_copy(container, subscription_id), None
            if exc.details.get("param") == "start_date" and provider.knows_its_clock():
                continue
            raise
        status = answer.subscription.status
        if status in STARTED:
            return answer.subscription, answer.invoice
    if status is None:
        raise e.ExternalError(f"the provider refused every start date for {subscription_id}: our clock and its "
                              "clock disagree", dependency="subscription_provider")
    raise e.ExternalError(f"the provider kept {subscription_id} {status}: the start date is ahead of its clock",
                          dependency="subscription_provider")


def _started_copy(container, subscription_id: str) -> Subscription:
    """The provider's copy of a subscription that was started: cancelled since raises CancelledAtProvider,
    and one still future cannot be activated. A paused one was started: its copy is taken as it is (a
    payment of its unpaid invoice, a cheque, activates nothing; decision 193)."""
    remote = container.provider.get_subscription(subscription_id)
    if remote.status == "cancelled":
        raise CancelledAtProvider(remote)
    if remote.status not in (*STARTED, "paused"):
        raise e.ExternalError(f"the provider holds {subscription_id} {remote.status}: it cannot be activated",
                              dependency="subscription_provider")
    return remote


class CancelledAtProvider(Exception):
    """The checkout's subscription was cancelled at the provider before its payment settled."""

    def __init__(self, remote: Subscription):
        super().__init__(remote.id)
        self.remote = remote


def _orphan_cancelled_checkout(container, subscription_id: str, remote: Subscription | None = None) -> dict:
    """The provider is authoritative (spec section 1.1): a checkout it cancelled is never activated, and
    the payment that settled for it is an orphan (re-subscribed or refunded by orphan recovery, which
    moves the purchase and its credits to the new subscription, or reverses them with the refund). The
    subscription leaves "activation pending"; its row takes the provider's cancelled copy (`remote`; none
    when the local copy is cancelled already)."""
    now = container.clock.now()
    with container.uow() as uow:
        paid = uow.purchases.without_invoice(subscription_id)
        for row in paid:
            review.hand_to_recovery(container, uow, payment_id=row["transaction_id"], user_id=row["user_id"],
                                    subscription_id=subscription_id, item_price_id=row["item_price_id"],
                                    amount=row["amount"], currency_code=row["currency_code"],
                                    settled_at=row["settled_at"])
        if remote is None:
            uow.subscriptions.set(subscription_id, activation_pending_since=None, activation_error=None,
                                  synced_at=now)
        else:
            write_remote_subscription(container, uow, remote, "activation", force=True, activation_pending_since=None,
                                      activation_error=None)
        uow.commit()
    log.warning("checkout cancelled at the provider before its payment: handed to orphan recovery",
                extra={"subscription_id": subscription_id, "payment_ids": [r["transaction_id"] for r in paid]})
    return {"subscription_id": subscription_id, "outcome": "cancelled_at_provider", "status": "cancelled"}


def _first_term_invoice(container, subscription_id: str) -> Invoice | None:
    invoices = sorted(container.provider.list_invoices(subscription_id=subscription_id),
                      key=lambda i: (i.date or 0, i.id))
    return invoices[0] if invoices else None


def _assign_invoice(container, uow, bought, subscription_id: str, remote: Invoice, tried: bool) -> None:
    """The checkout's payment pays the invoice of the first term: the purchase, the checkout and the
    local invoice row learn its id (the row is the provider's copy: still payable until the follow-up
    records the payment on it). An invoice the renewal job may have tried (`tried`: found started at the
    provider, not made by our start; a reactivated subscription's new term, charged before its checkout's
    payment was recorded) has its dunning ended by this payment, as when another payment pays an invoice
    whose charge then ends unpaid (decisions 193, 250). The one our start made has none: nothing is read."""
    uow.purchases.assign_invoice(bought.id, bought.transaction_id, subscription_id, remote.id)
    save_copy(container, uow, remote)
    if tried:
        end_renewal_attempt(container, uow, {"id": remote.id, "subscription_id": subscription_id,
                                             "customer_id": bought.user_id}, bought.transaction_id, "succeeded",
                            amount=bought.amount)


def pending_activations(container) -> list[dict]:
    """Subscriptions with follow-up work: an activation still to do, or a purchase not yet recorded on
    the provider's invoice."""
    with container.uow() as uow:
        return uow.subscriptions.with_followups(container.clock.now())


def retry_pending(container) -> dict:
    """The activations job: finish every pending follow-up, each isolated from the others."""
    done, failed = 0, 0
    for row in pending_activations(container):
        with container.locks.hold(f"subscription:{row['id']}"):
            try:
                outcome = complete_followups(container, row["id"])
            except e.BillingError as exc:
                log.warning("pending activation still failing: %s", exc.message, extra={"subscription_id": row["id"]})
                failed += 1
                continue
            except Exception:  # one row's crash never stops the others' (issue 37): counted, logged, next
                log.exception("pending activation crashed", extra={"subscription_id": row["id"]})
                failed += 1
                continue
        if outcome["activation"] in ("activated", "already_active") and outcome["provider_recorded"]:
            done += 1
        else:
            failed += 1
    return BatchResult({"completed": done, "failed": failed}, done=done, failed=failed)


def record_payment_by_id(container, payment_id: str, path: str = "cli", confirmed: bool = True) -> dict:
    """An operator's record of one payment. Unless `confirmed`, a payment whose invoice (or, for a checkout,
    subscription) another recorded payment already pays is refused: recording it would credit a second
    term, and a double charge is fixed by a refund (issue 38, item 6)."""
    require_id(payment_id, "payment_id")
    payment = container.orchestrator.get_payment(payment_id)
    if not confirmed and payment.status in CAPTURED_STATUSES:
        facts = facts_from_payment(container, payment)
        with container.uow(autocommit=True) as uow:
            other = (uow.purchases.paying_invoice(facts.invoice_id) if facts.invoice_id
                     else uow.purchases.paying_subscription(facts.subscription_id))
        if other is not None and other != payment_id:
            what = f"invoice {facts.invoice_id}" if facts.invoice_id else f"subscription {facts.subscription_id}"
            raise e.Refused(f"{what} is already paid by {other}: recording {payment_id} would credit a second term; "
                            f"refund it (billingctl payments refund {payment_id} --reason R --yes), or add --yes "
                            "to record it anyway")
    return record_payment(container, payment, path)


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


# ---- refunds ------------------------------------------------------------------------------------

def apply_refund_report(container, payment_id: str, refunded_total: int, path: str) -> dict:
    """A refund report from any path. One for a payment we have not recorded means its settle is late or
    lost: the settle is recorded now from the orchestrator's own payment, whose refunded amount recording
    reverses (a late settle report is then a duplicate)."""
    result = reverse_refund(container, payment_id, refunded_total, path)
    if result["outcome"] != "unknown_payment":
        return result
    payment = container.orchestrator.get_payment(payment_id)
    if payment.status != "SETTLED":
        return result
    log.info("refund reported before its settle: recording the payment first", extra={"payment_id": payment_id})
    result = record_payment(container, payment, path)
    if result["outcome"] == "duplicate" and payment.refunded:
        # Recorded meanwhile by the settle's own report, from its payload of before the refund (another
        # process, while this one asked the orchestrator): nobody else reverses this refund.
        result["refund"] = reverse_refund(container, payment_id, payment.refunded, path)
    return result


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
        apply_credits(uow, bought["user_id"], -delta, f"refund:{payment_id}:{share}", "refund", payment_id, now)
        review.close_purchase_ended(uow, payment_id, now)  # its row ended refunded while the refund was pending
        alerts.enqueue(uow, container.clock, "analytics", {
            "event": "payment_refunded", "payment_id": payment_id, "user_id": bought["user_id"],
            "refunded_total": share, "credits_reversed": delta, "path": path}, f"analytics:refund:{payment_id}:{share}")
        uow.commit()
    log.info("refund reversed credits", extra={"payment_id": payment_id, "credits": delta, "path": path})
    return {"payment_id": payment_id, "outcome": "reversed", "credits_reversed": delta, "user_id": bought["user_id"]}
