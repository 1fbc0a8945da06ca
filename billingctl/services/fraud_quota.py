"""Authorization attempts and the NSFW quota (spec section 3). Every NSFW authorization is a
fraud_event `authorization_attempt` with metadata merchant_context and amount; the quota counts those
with merchant_context full, on the NSFW tier, in production only. Client input decides nothing here."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import TYPE_CHECKING

from billingctl.domain.quota import CUSTOMER, LONGEST, MERCHANT, QuotaDecision, authorization_quota

if TYPE_CHECKING:
    from billingctl.adapters.payloads import Payment

log = logging.getLogger("billingctl.fraud")

FULL = "full"


def attempt_times(uow, user_id: str, now) -> list:
    rows = uow.fraud.since(user_id, "authorization_attempt", now - LONGEST)
    return [created for created, meta in rows if (meta or {}).get("merchant_context") == FULL]


def enforced(settings, lane: str) -> bool:
    return lane == "nsfw" and settings.is_production


def check(uow, settings, user_id: str, lane: str, now, initiator: str = CUSTOMER) -> QuotaDecision | None:
    """None when the quota does not apply (SFW, or not production)."""
    if not enforced(settings, lane):
        return None
    return authorization_quota(attempt_times(uow, user_id, now), now, initiator)


def record_attempt(uow, user_id: str, now, amount: int, initiator: str, dedupe_key: str | None = None,
                   **extra) -> bool:
    """One authorization_attempt row; with a key, a second report of the same attempt adds nothing."""
    return uow.fraud.add(user_id, "authorization_attempt", now, {
        "merchant_context": FULL, "amount": amount, "initiator": initiator, **extra}, dedupe_key)


def reserve(uow, settings, user_id: str, lane: str, now, initiator: str, key: str, amount: int, clock=None,
            **extra) -> QuotaDecision | None:
    """Check the quota and reserve one attempt in the same transaction, under the user's row lock (a
    write first on SQLite, which serializes writers; SELECT ... FOR UPDATE on PostgreSQL), so two
    workers can never both take the last slot. The window is judged at the time read once the lock is
    held (`clock`): a time read before it would not see an attempt another worker committed meanwhile
    with a later stamp. Nothing is reserved when the quota refuses; on the SFW lane nothing is counted
    at all. The caller commits."""
    if lane != "nsfw":
        return None
    uow.users.ensure(user_id, now)
    uow.users.lock(user_id)
    if clock is not None:
        now = max(now, clock.now())
    # A reservation under this key that is still there was never taken by an authorization (an earlier
    # attempt of the same order, its charge cancelled while PENDING): it is not an attempt, and this one
    # is judged and counted from now, not from then (decision 254).
    uow.fraud.remove(key)
    decision = check(uow, settings, user_id, lane, now, initiator)
    if decision is None or decision.allowed:
        record_attempt(uow, user_id, now, amount, initiator, dedupe_key=key, **extra)
    return decision


def rename(uow, key: str, new_key: str) -> bool:
    """A reservation becomes the attempt it reserved for (its order, then its payment)."""
    return uow.fraud.rename(key, new_key)


def release(uow, key: str) -> None:
    """No authorization happened (the checkout was undone, the charge never reached a processor)."""
    uow.fraud.remove(key)


# Orchestrator statuses that mean an authorization was attempted at a processor.
AUTHORIZED_STATUSES = ("AUTHORIZED", "SETTLING", "SETTLED", "DECLINED", "FAILED")


def count_authorization(uow, now, payment: Payment, lane: str | None, user_id: str | None) -> bool:
    """Spec section 3 quota rule 4, read as: every authorization the orchestrator reports on the NSFW
    lane counts once per payment id, whichever path reports it. The first authorization of an order (a
    checkout session, a renewal invoice) takes the slot reserved for it as `order:<order id>`; each
    further one is a row of its own."""
    if lane != "nsfw" or not user_id or payment.status not in AUTHORIZED_STATUSES:
        return False
    key = f"payment:{payment.id}"
    if uow.fraud.exists(key):
        return False
    if payment.order_id and rename(uow, f"order:{payment.order_id}", key):
        return True
    initiator = MERCHANT if payment.metadata.merchant_initiated else CUSTOMER
    return record_attempt(uow, user_id, now, payment.charged, initiator, dedupe_key=key,
                          order_id=payment.order_id, payment_id=payment.id)


def record_velocity(uow, user_id: str, now, amount: int, window: str | None, source: str) -> None:
    uow.fraud.add(user_id, "velocity_triggered", now, {"merchant_context": FULL, "amount": amount, "window": window,
                                                      "source": source})


def show(container, user_id: str) -> dict:
    now = container.clock.now()
    with container.uow() as uow:
        decision = authorization_quota(attempt_times(uow, user_id, now), now, CUSTOMER)
    return {"user_id": user_id, "enforced": container.settings.is_production, "tier": "nsfw",
            "customer_allowed": decision.allowed, "windows": [asdict(w) for w in decision.windows]}
