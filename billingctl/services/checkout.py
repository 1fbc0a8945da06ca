"""Checkout: a pending subscription at the provider (status future, start_date over a year ahead)
and an orchestrator client session. The amount comes from the provider's catalog, never the client."""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta

from billingctl.adapters.db.sql import insert_ignore
from billingctl.adapters.db.tables import checkout_session, subscription, users
from billingctl.domain.errors import InvalidInput
from billingctl.services import catalog
from billingctl.services.payments import parse_time

log = logging.getLogger("billingctl.checkout")

# The pending-checkout marker: status future with start_date more than a year ahead.
PENDING_START_OFFSET = timedelta(days=400)


def create_checkout(container, user_id: str, item_price_id: str, risky_actions: str | None = None) -> dict:
    if not item_price_id or not isinstance(item_price_id, str):
        raise InvalidInput("item_price_id is required")
    plan = catalog.plan(container, item_price_id)
    now = container.clock.now()
    key = uuid.uuid4().hex
    created = container.provider.create_subscription_for_items(user_id, item_price_id, now + PENDING_START_OFFSET,
                                                               idempotency_key=f"checkout:{key}")
    sub, invoice = created["subscription"], created.get("invoice") or {}
    order_id = invoice.get("id") or sub["id"]
    metadata = {"user_id": user_id, "subscription_id": sub["id"], "item_price_id": item_price_id, "lane": plan.lane}
    if risky_actions:
        metadata["risky_actions"] = risky_actions  # forwarded into metadata only; never decides anything
    session = container.orchestrator.create_client_session(
        order_id=order_id, customer_id=user_id, amount=plan.amount, currency_code=plan.currency_code,
        metadata=metadata, idempotency_key=f"session:{key}")
    with container.uow() as uow:
        insert_ignore(uow, users, {"id": user_id, "created_at": now, "credits": 0}, ["id"])
        insert_ignore(uow, subscription, {
            "id": sub["id"], "status": sub["status"], "customer_id": user_id, "created_at": now,
            "start_date": parse_time(sub.get("start_date")), "coupon_ids": [], "item_price_id": item_price_id,
            "lane": plan.lane}, ["id"])
        uow.execute(checkout_session.insert().values(
            user_id=user_id, subscription_id=sub["id"], invoice_id=order_id, item_price_id=item_price_id,
            lane=plan.lane, amount=plan.amount, currency_code=plan.currency_code,
            client_token=session.get("clientToken"), expires_at=parse_time(session.get("clientExpirationDate")),
            status="open", created_at=now))
        uow.commit()
    return {"order_id": order_id, "subscription_id": sub["id"], "client_token": session.get("clientToken"),
            "amount": plan.amount, "currency_code": plan.currency_code, "lane": plan.lane}
