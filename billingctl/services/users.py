"""Users: what an operator needs to see about one user."""

from __future__ import annotations

from sqlalchemy import func, select

from billingctl.adapters.db.tables import credit_ledger, purchase, users
from billingctl.domain.errors import NotFound
from billingctl.services.processor_lock import read_lock


def show_user(container, user_id: str) -> dict:
    with container.uow() as uow:
        user = uow.execute(select(users).where(users.c.id == user_id)).mappings().first()
        if user is None:
            raise NotFound(f"user {user_id} not found")
        ledger = uow.execute(select(func.coalesce(func.sum(credit_ledger.c.amount), 0)).where(
            credit_ledger.c.user_id == user_id)).scalar_one()
        purchases = uow.execute(select(func.count()).select_from(purchase).where(
            purchase.c.user_id == user_id)).scalar_one()
        lock = read_lock(uow, user_id) or {}
    return {"user_id": user_id, "email": user["email"], "credits": user["credits"], "ledger_sum": int(ledger),
            "purchases": purchases, "sfw_processor": lock.get("sfw_processor") or None,
            "nsfw_processor": lock.get("nsfw_processor") or None,
            "nsfw_processor_mid": lock.get("nsfw_processor_mid") or None,
            "frozen": user["frozen_at"] is not None, "frozen_at": user["frozen_at"]}
