"""Dunning attempts: one row per renewal charge attempt (or its outcome) on an invoice. The invoice's
dunning state is its newest row's status (domain.lifecycle.DUNNING); a pending row is resolved in place,
once, by a conditional update."""

from __future__ import annotations

from sqlalchemy import and_, func, select, update

from billingctl.adapters.db.repository import Repository
from billingctl.adapters.db.tables import dunning_attempt


class DunningAttempts(Repository):
    def history(self, invoice_id: str) -> list[dict]:
        return [dict(r) for r in self.execute(select(dunning_attempt).where(dunning_attempt.c.invoice_id == invoice_id)
                                              .order_by(dunning_attempt.c.id)).mappings()]

    def newest(self, invoice_id: str) -> dict | None:
        row = self.execute(select(dunning_attempt).where(dunning_attempt.c.invoice_id == invoice_id)
                           .order_by(dunning_attempt.c.id.desc()).limit(1)).mappings().first()
        return dict(row) if row is not None else None

    def pending_for_payment(self, payment_id: str) -> dict | None:
        """The unresolved in-flight row of a renewal charge, if any."""
        row = self.execute(select(dunning_attempt).where(
            dunning_attempt.c.payment_id == payment_id, dunning_attempt.c.status == "pending",
            dunning_attempt.c.resolved_at.is_(None)).order_by(dunning_attempt.c.id.desc()).limit(1)).mappings().first()
        return dict(row) if row is not None else None

    def charged_amount(self, payment_id: str) -> int | None:
        """The amount a renewal attempt asked the orchestrator to charge with this payment."""
        return self.execute(select(dunning_attempt.c.amount).where(dunning_attempt.c.payment_id == payment_id)
                            .order_by(dunning_attempt.c.id).limit(1)).scalar()

    def resolve(self, row_id: int, now) -> bool:
        """End one pending row; False when another writer ended it first (its outcome row is theirs)."""
        return self.execute(update(dunning_attempt).where(
            dunning_attempt.c.id == row_id, dunning_attempt.c.status == "pending",
            dunning_attempt.c.resolved_at.is_(None)).values(resolved_at=now)).rowcount == 1

    def in_flight(self) -> list[dict]:
        """Every unresolved pending row (charges in flight), oldest first."""
        return [dict(r) for r in self.execute(select(dunning_attempt).where(
            dunning_attempt.c.status == "pending", dunning_attempt.c.resolved_at.is_(None))
            .order_by(dunning_attempt.c.created_at)).mappings()]

    def answers_lost(self) -> list[dict]:
        """Every invoice's newest row when it is an `error` not yet read back (a charge whose answer was
        lost: it may have been made), oldest first."""
        newest = select(func.max(dunning_attempt.c.id)).group_by(dunning_attempt.c.invoice_id)
        return [dict(r) for r in self.execute(select(dunning_attempt).where(
            dunning_attempt.c.id.in_(newest), dunning_attempt.c.status == "error",
            dunning_attempt.c.resolved_at.is_(None)).order_by(dunning_attempt.c.created_at)).mappings()]

    def read_back(self, row_id: int, now) -> None:
        """An `error` row whose order was read back and held no charge: nothing was made, nothing to read."""
        self.execute(update(dunning_attempt).where(
            dunning_attempt.c.id == row_id, dunning_attempt.c.status == "error",
            dunning_attempt.c.resolved_at.is_(None)).values(resolved_at=now))

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
