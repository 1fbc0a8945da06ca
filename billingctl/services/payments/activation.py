"""Subscription activation (spec sections 1 and 3): a checkout's subscription, future at the provider, is
started there once its payment is recorded (the provider's clock names the start), its first term's
invoice given to the purchase that paid it; one the provider cancelled or deleted meanwhile is never
activated, and its payment goes to orphan recovery."""

from __future__ import annotations

import logging
from datetime import timedelta

from billingctl.adapters.faults import crash_point
from billingctl.adapters.payloads import Invoice, Subscription
from billingctl.domain import errors as e
from billingctl.domain.plans import require_id
from billingctl.services import catalog, review
from billingctl.services.invoices import save_copy
from billingctl.services.payments.transactions import end_renewal_attempt
from billingctl.services.sync import subscription_gone, write_remote_subscription

log = logging.getLogger("billingctl.payments")


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
