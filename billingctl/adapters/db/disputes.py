"""Disputes: one row per processor dispute id; its state moves by conditional updates along
domain.lifecycle.DISPUTE."""

from __future__ import annotations

from sqlalchemy import select, update

from billingctl.adapters.db.repository import Repository
from billingctl.adapters.db.sql import insert_ignore
from billingctl.adapters.db.tables import dispute


class Disputes(Repository):
    def get(self, dispute_id: str) -> dict | None:
        row = self.execute(select(dispute).where(dispute.c.dispute_id == dispute_id)).mappings().first()
        return dict(row) if row is not None else None

    def open(self, values: dict) -> bool:
        return insert_ignore(self.uow, dispute, values, ["dispute_id"])

    def move(self, dispute_id: str, state: str, sources: tuple[str, ...], held_kind: str | None, now,
             **values) -> bool:
        """A step judged against the row's state and stage (`held_kind`): False when another notification
        changed either first."""
        held = dispute.c.kind.is_(None) if held_kind is None else dispute.c.kind == held_kind
        return self.execute(update(dispute).where(dispute.c.dispute_id == dispute_id, dispute.c.state.in_(sources),
                                                  held).values(state=state, updated_at=now, **values)).rowcount == 1

    def note(self, dispute_id: str, now, **values) -> None:
        """The orchestrator's latest words (type, status) without a change of state."""
        self.execute(update(dispute).where(dispute.c.dispute_id == dispute_id).values(updated_at=now, **values))

    def deciding(self, payment_id: str) -> dict | None:
        """The dispute that decides what may be done with a payment's money: a lost one (the customer has
        it back), else an undecided one; None when neither."""
        rows = self.execute(select(dispute).where(dispute.c.payment_id == payment_id,
                                                  dispute.c.state.in_(("lost", "open")))).mappings().all()
        return dict(min(rows, key=lambda r: (r["state"] != "lost", r["dispute_id"]))) if rows else None

    def open_for_user(self, user_id: str) -> list[dict]:
        """The user's disputes still undecided (no merchant-initiated charge while any is)."""
        return [dict(r) for r in self.execute(select(dispute).where(dispute.c.user_id == user_id,
                                                                    dispute.c.state == "open")).mappings()]

    def listing(self, limit: int = 100) -> list[dict]:
        return [dict(r) for r in self.execute(select(dispute).order_by(dispute.c.updated_at.desc()).limit(limit))
                .mappings()]
