"""Unified payment recording (spec sections 1, 2 and 4): the one service every path uses when it learns of
a settled payment. In one database transaction it writes the purchase (unique transaction_id = the
orchestrator payment id), the transaction, and the plan's credits through a ledger row whose unique source
key makes a second application impossible; a payment that does not match its order, or whose
subscription, user or dispute forbids crediting it, is held or handed to orphan recovery instead. Then,
under the subscription's lock, its follow-ups at the provider (`followups`)."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta

from billingctl.adapters.db.purchases import CAPTURED_IN_PART, ledger_row, transaction_row
from billingctl.adapters.faults import crash_point
from billingctl.adapters.payloads import Payment
from billingctl.domain import errors as e
from billingctl.domain import lifecycle
from billingctl.domain.plans import require_id
from billingctl.services import alerts, catalog, fraud_quota, review
from billingctl.services.invoices import name_invoice
from billingctl.services.payments.followups import _AFTER_RESPONSE, complete_followups
from billingctl.services.payments.refunds import refund, returned_in_review, reverse_refund
from billingctl.services.payments.transactions import CAPTURED_STATUSES, end_renewal_attempt, save_transaction
from billingctl.services.processor_lock import lock_after_settle

log = logging.getLogger("billingctl.payments")


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


def _invoice_of(facts: PaymentFacts) -> dict:
    return {"id": facts.invoice_id, "subscription_id": facts.subscription_id, "customer_id": facts.user_id}


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
