"""Dunning attempts: one row per renewal charge attempt (or its outcome) on an invoice. The invoice's
dunning state is its newest row's status (domain.lifecycle.DUNNING); a pending row is resolved in place,
once, by a conditional update."""

from __future__ import annotations

from sqlalchemy import and_, exists, func, or_, select, update

from billingctl.adapters.db.repository import Repository
from billingctl.adapters.db.tables import dunning_attempt


def _told(row):
    """A later row of `row`'s invoice names a charge: the answer `row` lost was told since (decision 239)."""
    later = dunning_attempt.alias("later")
    return exists().where(later.c.invoice_id == row.c.invoice_id, later.c.id > row.c.id,
                          later.c.payment_id.is_not(None))


def charge_unended(invoice_id):
    """A clause: the invoice has a renewal charge whose end is not known yet, so it may still take the
    customer's money: in flight (an unresolved pending row), or its answer lost and its order not read back
    since (an unresolved `error` row no later row told). The tick or its sweep ends each."""
    row = dunning_attempt.alias("unended")
    return exists().where(row.c.invoice_id == invoice_id, row.c.resolved_at.is_(None),
                          or_(row.c.status == "pending", and_(row.c.status == "error", ~_told(row))))


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
        """Of each invoice, its newest attempt whose answer was lost (`error`: it may have been made), when
        its order was not read back since and no later row names a charge (in flight, or its outcome told
        by its notification or a read-back): `renewals._lost_answer` in one statement, oldest first."""
        lost = select(func.max(dunning_attempt.c.id)).where(
            dunning_attempt.c.status == "error", dunning_attempt.c.resolved_at.is_(None)
        ).group_by(dunning_attempt.c.invoice_id)
        return [dict(r) for r in self.execute(select(dunning_attempt).where(
            dunning_attempt.c.id.in_(lost), ~_told(dunning_attempt)).order_by(dunning_attempt.c.created_at)).mappings()]

    def read_back(self, invoice_id: str, now) -> None:
        """The invoice's order was read back: its lost answers (`error` rows) are known now."""
        self.execute(update(dunning_attempt).where(
            dunning_attempt.c.invoice_id == invoice_id, dunning_attempt.c.status == "error",
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
