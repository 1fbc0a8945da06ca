"""Authorization attempts and the NSFW quota (spec section 3). Every NSFW authorization is a
fraud_event `authorization_attempt` with metadata merchant_context and amount; the quota counts those
with merchant_context full, on the NSFW tier, in production only. Client input decides nothing here."""

from __future__ import annotations

import logging
from dataclasses import asdict

from sqlalchemy import select

from billingctl.adapters.db.tables import fraud_event
from billingctl.domain.quota import CUSTOMER, LONGEST, QuotaDecision, authorization_quota

log = logging.getLogger("billingctl.fraud")

FULL = "full"


def attempt_times(uow, user_id: str, now) -> list:
    rows = uow.execute(select(fraud_event.c.created_at, fraud_event.c.metadata).where(
        fraud_event.c.user_id == user_id, fraud_event.c.event_type == "authorization_attempt",
        fraud_event.c.created_at > now - LONGEST)).all()
    return [created for created, meta in rows if (meta or {}).get("merchant_context") == FULL]


def enforced(settings, lane: str) -> bool:
    return lane == "nsfw" and settings.is_production


def check(uow, settings, user_id: str, lane: str, now, initiator: str = CUSTOMER) -> QuotaDecision | None:
    """None when the quota does not apply (SFW, or not production)."""
    if not enforced(settings, lane):
        return None
    return authorization_quota(attempt_times(uow, user_id, now), now, initiator)


def record_attempt(uow, user_id: str, now, amount: int, initiator: str, **extra) -> None:
    uow.execute(fraud_event.insert().values(user_id=user_id, event_type="authorization_attempt", created_at=now,
                                            metadata={"merchant_context": FULL, "amount": amount,
                                                      "initiator": initiator, **extra}))


def record_velocity(uow, user_id: str, now, amount: int, window: str | None, source: str) -> None:
    uow.execute(fraud_event.insert().values(user_id=user_id, event_type="velocity_triggered", created_at=now,
                                            metadata={"merchant_context": FULL, "amount": amount, "window": window,
                                                      "source": source}))


def show(container, user_id: str) -> dict:
    now = container.clock.now()
    with container.uow() as uow:
        decision = authorization_quota(attempt_times(uow, user_id, now), now, CUSTOMER)
    return {"user_id": user_id, "enforced": container.settings.is_production, "tier": "nsfw",
            "customer_allowed": decision.allowed, "windows": [asdict(w) for w in decision.windows]}
