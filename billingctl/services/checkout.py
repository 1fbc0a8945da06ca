"""Checkout (spec sections 1, 3 and 4): a pending subscription at the provider (status future,
start_date over a year ahead) and an orchestrator client session. The amount and the lane come from
the provider's catalog, never from the client; identity comes from the session. An aborted checkout
leaves nothing behind: checks run before anything is created, and what was created is undone.

The order id given to the orchestrator (and held by the front end) is the subscription id: a future
subscription has no invoice at the provider until activation starts it (docs/decisions.md)."""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta

from billingctl.adapters.logs import item_failed
from billingctl.adapters.payloads import SubscriptionAnswer
from billingctl.domain import errors as e
from billingctl.domain import lifecycle
from billingctl.domain.batch import BatchResult
from billingctl.domain.clock import parse_time
from billingctl.domain.plans import looks_like_id
from billingctl.domain.quota import CUSTOMER
from billingctl.services import catalog, fraud_quota
from billingctl.services.sync import cancel_at_provider, write_remote_subscription

log = logging.getLogger("billingctl.checkout")

# The pending-checkout marker: status future with start_date more than a year ahead.
PENDING_START_OFFSET = timedelta(days=400)
PENDING_MARKER = timedelta(days=365)
CLEANUP_AGE = timedelta(days=1)
REUSE_MARGIN = timedelta(minutes=10)  # a pending checkout is answered again while its session has this long left


def _plan_or_400(container, item_price_id):
    if not looks_like_id(item_price_id):
        raise e.InvalidInput("item_price_id is required: letters, digits, '.', '_' and '-'")
    try:
        return catalog.plan(container, item_price_id)
    except e.ExternalNotFound:
        raise e.InvalidInput(f"unknown item_price_id {item_price_id}") from None


def _read_user_and_lock(container, user_id: str):
    try:
        with container.uow() as uow:
            user = uow.users.freeze_state(user_id)
            lock = uow.locks.read(user_id) or {}
    except Exception as exc:
        # Spec section 2 rule 7: never route without knowing the processor; nothing is created.
        log.error("checkout aborted: processor lock read failed: %s", type(exc).__name__, extra={"user_id": user_id})
        raise e.ProcessorLockUnavailable(
            "checkout is temporarily unavailable: the payment processor lock could not be read") from None
    return user, lock


def create_checkout(container, user_id: str, item_price_id: str, risky_actions: str | None = None) -> dict:
    plan = _plan_or_400(container, item_price_id)
    user, lock = _read_user_and_lock(container, user_id)
    if user is not None and user.frozen_at is not None:
        raise e.AccountFrozen("payments are disabled for this account")
    # One live subscription per customer and plan (decision 110): a second tab gets the pending checkout
    # back, and a plan already held is refused; checkouts of one customer and plan are made one at a time.
    with container.locks.hold(f"checkout:{user_id}:{plan.item_price_id}"):
        return _checkout_once(container, user_id, plan, lock, risky_actions)


def _checkout_once(container, user_id: str, plan, lock, risky_actions) -> dict:
    now = container.clock.now()
    with container.uow(autocommit=True) as uow:
        held = uow.subscriptions.holding_plan(user_id, plan.item_price_id, None)
        pending = uow.checkouts.open_for_plan(user_id, plan.item_price_id, now + REUSE_MARGIN)
    if held:
        raise e.AlreadySubscribed(f"already subscribed to {plan.item_price_id}")
    if pending is not None:
        # No new start, so no new reservation; but a customer whose window is full gets no payment form
        # back either (each try in it is an authorization the quota counts).
        with container.uow() as uow:
            _refuse_over_quota(uow, user_id, plan, now,
                               fraud_quota.check(uow, container.settings, user_id, plan.lane, now, CUSTOMER))
        log.info("checkout of a plan already pending: the same checkout is answered",
                 extra={"user_id": user_id, "order_id": pending["order_id"]})
        return {"order_id": pending["order_id"], "subscription_id": pending["subscription_id"],
                "client_token": pending["client_token"], "amount": pending["amount"],
                "currency_code": pending["currency_code"], "lane": pending["lane"],
                "item_price_id": pending["item_price_id"]}
    _admit_start(container, user_id, now)
    key = uuid.uuid4().hex
    # The session reserves the slot of its first authorization before anything is created: the check
    # and the reservation are one transaction under the user's row lock (correct without Redis).
    with container.uow() as uow:
        _refuse_over_quota(uow, user_id, plan, now, fraud_quota.reserve(
            uow, container.settings, user_id, plan.lane, now, CUSTOMER, f"checkout:{key}", plan.amount,
            clock=container.clock))
        uow.commit()
    try:
        return _create(container, user_id, plan, lock, risky_actions, now, key)
    except Exception:
        with container.uow() as uow:
            fraud_quota.release(uow, f"checkout:{key}")
            uow.commit()
        raise


def _admit_start(container, user_id: str, now) -> None:
    """A new checkout spends provider calls (its subscription, a new customer, the catalog) from the
    interactive share of the budget that every user shares: one user's flood must never spend the others'
    (issue 37, decision 126). Each user holds at most `checkout_open_per_user` open checkouts and starts at
    most `checkout_starts_per_user_per_minute` a minute; over either, 429 before any provider call."""
    settings = container.settings
    with container.uow(autocommit=True) as uow:
        held = uow.checkouts.count_open(user_id, now)
    if held >= settings.checkout_open_per_user:
        log.warning("checkout refused: too many open checkouts", extra={"user_id": user_id, "open": held})
        raise e.TooManyRequests(f"{held} checkouts are already waiting for payment: pay or leave one first",
                                retry_after=60)
    try:
        container.checkout_limiter.admit(user_id)
    except e.TooManyRequests as exc:
        log.warning("checkout refused: too many started this minute", extra={"user_id": user_id})
        raise e.TooManyRequests("too many checkouts started in the last minute; retry later",
                                retry_after=exc.details.get("retry_after")) from None


def _refuse_over_quota(uow, user_id: str, plan, now, decision) -> None:
    """A quota decision that refuses: the velocity signal is written (committed) and the checkout refused."""
    if decision is None or decision.allowed:
        return
    fraud_quota.record_velocity(uow, user_id, now, plan.amount, decision.blocking, "checkout")
    uow.commit()
    log.warning("checkout blocked: authorization quota exhausted", extra={"user_id": user_id,
                                                                          "window": decision.blocking})
    raise e.QuotaExhausted()


def create_pending_subscription(container, user_id: str, item_price_id: str, now, key: str) -> SubscriptionAnswer:
    """A future subscription for the user, creating the provider's customer (id = our user id) the
    first time: one call for a user who checked out before, two for a new one (three when the customer
    we believed to exist does not)."""
    with container.uow() as uow:
        known = uow.checkouts.user_has_any(user_id)
    if not known:
        ensure_customer(container, user_id, f"{key}:customer")
    try:
        return container.provider.create_subscription_for_items(user_id, item_price_id, now + PENDING_START_OFFSET,
                                                                 idempotency_key=f"{key}:subscription")
    except e.ExternalNotFound:
        if not known:
            raise
        ensure_customer(container, user_id, f"{key}:customer")
    return container.provider.create_subscription_for_items(user_id, item_price_id, now + PENDING_START_OFFSET,
                                                             idempotency_key=f"{key}:subscription:2")


def ensure_customer(container, user_id: str, idempotency_key: str | None = None) -> None:
    """Create the provider's customer for a user; one that already exists (a race) is fine."""
    with container.uow() as uow:
        user = uow.users.get(user_id)
    email = user["email"] if user is not None else None
    try:
        container.provider.create_customer(user_id, email=email, idempotency_key=idempotency_key)
    except e.ExternalInvalidRequest as exc:
        if exc.details.get("api_error_code") != "duplicate_entry":
            raise
        log.info("provider customer already exists", extra={"user_id": user_id})
        return
    log.info("provider customer created", extra={"user_id": user_id})


def _create(container, user_id, plan, lock, risky_actions, now, key: str) -> dict:
    created = create_pending_subscription(container, user_id, plan.item_price_id, now, f"checkout:{key}")
    sub = created.subscription
    order_id = sub.id
    metadata = {"user_id": user_id, "subscription_id": sub.id, "item_price_id": plan.item_price_id,
                "lane": plan.lane}
    locked = lock.get(f"{plan.lane}_processor")
    if locked:
        metadata["psp"] = locked
        if plan.lane == "nsfw" and lock.get("nsfw_processor_mid"):
            metadata["processor_merchant_id"] = lock["nsfw_processor_mid"]
    if risky_actions:
        metadata["risky_actions"] = risky_actions[:512]  # forwarded into metadata only; decides nothing
    try:
        session = container.orchestrator.create_client_session(
            order_id=order_id, customer_id=user_id, amount=plan.amount, currency_code=plan.currency_code,
            metadata=metadata, idempotency_key=f"session:{key}")
        with container.uow() as uow:
            uow.users.ensure(user_id, now)
            uow.subscriptions.add({
                "id": sub.id, "status": sub.status, "customer_id": user_id, "created_at": now,
                "start_date": parse_time(sub.start_date), "coupon_ids": [], "item_price_id": plan.item_price_id,
                "lane": plan.lane})
            uow.checkouts.add(
                user_id=user_id, subscription_id=sub.id, order_id=order_id, item_price_id=plan.item_price_id,
                lane=plan.lane, amount=plan.amount, currency_code=plan.currency_code,
                client_token=session.client_token, expires_at=session.expires_at,
                status="open", created_at=now)
            # The reservation now waits for the session's first authorization (found by its order id).
            fraud_quota.rename(uow, f"checkout:{key}", f"order:{order_id}")
            uow.commit()
    except Exception:
        _undo_subscription(container, sub.id, created.invoice.id if created.invoice is not None else None)
        raise
    return {"order_id": order_id, "subscription_id": sub.id, "client_token": session.client_token,
            "amount": plan.amount, "currency_code": plan.currency_code, "lane": plan.lane,
            "item_price_id": plan.item_price_id}


def _undo_subscription(container, subscription_id: str, invoice_id: str | None) -> None:
    """Compensate a half-made checkout: nothing may stay behind at the provider."""
    try:
        if invoice_id:
            container.provider.void_invoice(invoice_id)
        container.provider.cancel_subscription(subscription_id)
    except e.BillingError as exc:
        log.error("could not undo a half-made checkout; the cleanup job will cancel it: %s", exc.message,
                  extra={"subscription_id": subscription_id})


def checkout_status(container, user_id: str, order_id: str) -> dict:
    if not order_id:
        raise e.InvalidInput("order_id is required")
    if not looks_like_id(order_id):
        raise e.NotFound("not found")
    now = container.clock.now()
    with container.uow() as uow:
        row = uow.checkouts.by_order_id(order_id, user_id)
        if row is None:
            raise e.NotFound("not found")
        paid = uow.purchases.exists_for_subscription(row["subscription_id"])
        status = uow.subscriptions.status(row["subscription_id"])
    if paid:
        state = "paid"
    elif status == "cancelled" or row["status"] == "cancelled":
        state = "cancelled"
    elif row["expires_at"] is not None and row["expires_at"] <= now:
        state = "expired"
    else:
        state = "pending"
    return {"order_id": order_id, "status": state, "subscription_id": row["subscription_id"],
            "item_price_id": row["item_price_id"], "amount": row["amount"], "currency_code": row["currency_code"],
            "expires_at": row["expires_at"]}


def cleanup_candidates(container) -> list[dict]:
    now = container.clock.now()
    with container.uow() as uow:
        return uow.checkouts.expired_unpaid(now, now + PENDING_MARKER, now - CLEANUP_AGE)


def cleanup_expired(container, dry_run: bool = False) -> dict:
    """future -> cancelled for expired pending checkouts older than a day (the hourly job); first, each
    checkout authorization left uncaptured past its limit is captured, or voided when no longer owed."""
    candidates = cleanup_candidates(container)
    if dry_run:
        would = finish_authorizations(container, dry_run=True)
        return {"dry_run": True, "would_cancel": [c["id"] for c in candidates], "would_capture": would["captured"],
                "would_void": would["voided"]}
    finished = finish_authorizations(container)
    cancelled, skipped, failed = [], [], list(finished["failed"])
    for row in candidates:
        # The same lock as record_payment: a late payment either lands first (and we skip) or after.
        with container.locks.hold(f"subscription:{row['id']}"):
            with container.uow() as uow:
                if uow.purchases.exists_for_subscription(row["id"]):
                    skipped.append(row["id"])
                    continue
            try:
                remote = cancel_at_provider(container, row["id"])
            except Exception as exc:  # one checkout never stops the others (issue 37): counted, logged, next
                item_failed(log, "checkout clean-up", exc, subscription_id=row["id"])
                failed.append({"id": row["id"], "error": exc.message if isinstance(exc, e.BillingError)
                               else type(exc).__name__})
                continue
            with container.uow() as uow:
                write_remote_subscription(container, uow, remote, "checkout-cleanup", force=True)
                uow.checkouts.cancel(row["id"])
                uow.commit()
            cancelled.append(row["id"])
    strays = _cancel_strays(container)
    cancelled += strays["cancelled"]
    failed += strays["failed"]
    return BatchResult({"cancelled": cancelled, "skipped_paid": skipped, "captured": finished["captured"],
                        "capture_refused": finished["capture_refused"], "voided": finished["voided"],
                        "failed": failed},
                       done=len(cancelled) + len(finished["captured"]) + len(finished["capture_refused"])
                       + len(finished["voided"]),
                       failed=len(failed), skipped=len(skipped), errors=failed)


# Card networks hold an authorization about a week: captured later, it is a late presentment the issuer may
# refuse or charge back, so an older one is voided.
AUTHORIZATION_LIFE = timedelta(days=7)


def finish_authorizations(container, dry_run: bool = False) -> dict:
    """Checkout payments the workflow authorized and never captured (its capture step failed), past the
    authorization limit (`renewal_authorized_max_minutes`, the one reconcile judges every authorization
    by): captured, since the customer bought the plan (its answer recorded at once), or voided
    when the checkout is no longer owed: its subscription cancelled, its customer frozen, or another
    payment paid it (decision 211), or when the authorization is older than a card authorization lives
    (decision 213). Renewal charges are the renewal tick's; one payment never stops the
    others. Without this the clean-up cancelled the subscription a day later and left the money held.
    `dry_run`: what it would capture and void, doing neither."""
    from billingctl.services.payments import CAPTURED_STATUSES, record_payment, update_transaction_status
    now = container.clock.now()
    limit = timedelta(minutes=container.settings.renewal_authorized_max_minutes)
    captured, refused, voided, failed = [], [], [], []
    try:
        # Every authorization, however old (they are few: a finished one leaves the status).
        listed = {p.id: p.made_at for p in container.orchestrator.list_payments("AUTHORIZED")
                  if p.made_at is not None and now - p.made_at > limit}
    except e.BillingError as exc:
        return {"captured": [], "capture_refused": [], "voided": [],
                "failed": [{"id": "*", "error": f"listing authorizations: {exc.message}"}]}
    for payment_id, made in listed.items():
        try:
            payment = container.orchestrator.get_payment(payment_id)
            if payment.status != "AUTHORIZED" or payment.is_renewal:
                continue
            with container.uow(autocommit=True) as uow:
                bought = uow.checkouts.by_order_id(payment.order_id) if payment.order_id else None
                why = _not_owed(uow, bought, payment_id) if bought is not None else None
            if why is None and now - made > AUTHORIZATION_LIFE:
                why = "authorization older than a week"
            if bought is None:
                continue  # not a checkout of ours: reconcile names it
            if dry_run:
                (voided if why is not None else captured).append(payment_id)
                continue
            if why is not None:
                log.warning("checkout authorization left uncaptured for a checkout no longer owed: cancelling",
                            extra={"payment_id": payment_id, "subscription_id": bought["subscription_id"], "why": why})
                container.orchestrator.cancel_payment(payment_id, reason=f"checkout authorization: {why}")
                voided.append(payment_id)
                continue
            log.warning("checkout authorization left uncaptured past its limit: capturing",
                        extra={"payment_id": payment_id, "subscription_id": bought["subscription_id"]})
            settled = container.orchestrator.capture_payment(payment_id)
            if settled.status in CAPTURED_STATUSES:  # recorded now (the webhook's copy is then a duplicate), so
                captured.append(payment_id)
                record_payment(container, settled, "checkout_cleanup")  # a day-old checkout is not cancelled below
            else:  # the processor refused the capture (DECLINED, FAILED): no money moved (decision 261)
                log.warning("checkout authorization's capture refused by the processor",
                            extra={"payment_id": payment_id, "subscription_id": bought["subscription_id"],
                                   "status": settled.status})
                update_transaction_status(container, settled)
                refused.append(payment_id)
        except Exception as exc:
            item_failed(log, "checkout authorization", exc, payment_id=payment_id)
            failed.append({"id": payment_id, "error": exc.message if isinstance(exc, e.BillingError)
                           else type(exc).__name__})
    return {"captured": captured, "capture_refused": refused, "voided": voided, "failed": failed}


def _not_owed(uow, bought, payment_id: str) -> str | None:
    """Why a checkout's authorization is owed no capture any more, from our copies; None while it is."""
    local = uow.subscriptions.get(bought["subscription_id"])
    if local is None or local["status"] not in lifecycle.AWAITING_OR_STARTED:
        return f"subscription {local['status'] if local else 'unknown'}"
    if uow.users.frozen_at(bought["user_id"]) is not None:
        return "customer frozen"
    other = uow.purchases.other_payment_of(bought["subscription_id"], payment_id)
    return f"paid by payment {other}" if other else None


def _cancel_strays(container) -> dict:
    """Pending checkouts that exist only at the provider (a checkout whose undo failed after its local
    rows were never written): future, marked pending, older than a day, unknown to us. No checkout session
    of ours names them, so nothing can pay them."""
    now = container.clock.now()
    cancelled, failed = [], []
    try:
        remote = list(container.provider.list_subscriptions(status="future"))
    except e.BillingError as exc:
        return {"cancelled": [], "failed": [{"id": "*", "error": f"listing future subscriptions: {exc.message}"}]}
    for sub in remote:
        start, created = parse_time(sub.start_date), parse_time(sub.created_at)
        if start is None or created is None or start <= now + PENDING_MARKER or created >= now - CLEANUP_AGE:
            continue
        with container.uow() as uow:
            if uow.checkouts.exists_for_subscription(sub.id):
                continue  # ours: the local pass above decides
        try:
            cancel_at_provider(container, sub.id)
        except e.BillingError as exc:
            failed.append({"id": sub.id, "error": exc.message})
            continue
        log.warning("cancelled a pending checkout known only to the provider", extra={"subscription_id": sub.id})
        cancelled.append(sub.id)
    return {"cancelled": cancelled, "failed": failed}
