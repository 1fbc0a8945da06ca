"""Dunning attempts: one row per renewal charge attempt (or its outcome) on an invoice."""

from __future__ import annotations

from sqlalchemy import and_, select

from billingctl.adapters.db.repository import Repository
from billingctl.adapters.db.tables import dunning_attempt


class DunningAttempts(Repository):
    def history(self, invoice_id: str) -> list[dict]:
        return [dict(r) for r in self.execute(select(dunning_attempt).where(dunning_attempt.c.invoice_id == invoice_id)
                                              .order_by(dunning_attempt.c.id)).mappings()]

    def add(self, **values) -> None:
        self.execute(dunning_attempt.insert().values(**values))

    def listing(self, user_id: str | None = None, invoice_id: str | None = None, limit: int = 100) -> list[dict]:
        query = select(dunning_attempt).order_by(dunning_attempt.c.id.desc()).limit(limit)
        conditions = []
        if user_id:
            conditions.append(dunning_attempt.c.user_id == user_id)
        if invoice_id:
            conditions.append(dunning_attempt.c.invoice_id == invoice_id)
        if conditions:
            query = query.where(and_(*conditions))
        return [dict(r) for r in self.execute(query).mappings()]
