"""The manual-review and orphan-recovery rows: one per orchestrator payment id."""

from __future__ import annotations

from sqlalchemy import func, select, update

from billingctl.adapters.db.repository import Repository
from billingctl.adapters.db.sql import insert_ignore
from billingctl.adapters.db.tables import orphan_recovery


class Orphans(Repository):
    def open(self, values: dict) -> bool:
        """One row per payment id (a second opening is a no-op); True when it is new."""
        return insert_ignore(self.uow, orphan_recovery, values, ["payment_id"])

    def get(self, payment_id: str):
        return self.execute(select(orphan_recovery).where(orphan_recovery.c.payment_id == payment_id)) \
            .mappings().first()

    def count_by_status(self) -> dict[str, int]:
        """Review rows still open, by status (the scrape): recovery's own and a person's."""
        from billingctl.domain.lifecycle import REVIEW_HUMAN, REVIEW_OPEN

        counts = dict(self.execute(select(orphan_recovery.c.status, func.count()).where(
            orphan_recovery.c.status.in_((*REVIEW_OPEN, *REVIEW_HUMAN))).group_by(orphan_recovery.c.status)).all())
        return {status: int(counts.get(status, 0)) for status in (*REVIEW_OPEN, *REVIEW_HUMAN)}

    def status(self, payment_id: str) -> str | None:
        return self.execute(select(orphan_recovery.c.status).where(orphan_recovery.c.payment_id == payment_id)) \
            .scalar()

    def claim(self, row, now, until) -> bool:
        """Own the row for one attempt: a conditional update on the attempt, status and due time read
        with it, so of two runners that read the same row only one wins."""
        due = row["next_attempt_at"]
        return self.execute(update(orphan_recovery).where(
            orphan_recovery.c.payment_id == row["payment_id"], orphan_recovery.c.attempts == row["attempts"],
            orphan_recovery.c.status == row["status"],
            orphan_recovery.c.next_attempt_at.is_(None) if due is None else orphan_recovery.c.next_attempt_at == due,
        ).values(next_attempt_at=until, updated_at=now)).rowcount == 1

    def move(self, payment_id: str, status: str, sources: tuple[str, ...], **values) -> bool:
        """One step of the row's lifecycle (domain.lifecycle.ORPHAN): a conditional update from the states
        the table allows; False when another writer moved it first."""
        return self.execute(update(orphan_recovery).where(
            orphan_recovery.c.payment_id == payment_id, orphan_recovery.c.status.in_(sources))
            .values(status=status, **values)).rowcount == 1

    def set(self, payment_id: str, **values) -> None:
        assert "status" not in values, "a status is a lifecycle step: Orphans.move"
        self.execute(update(orphan_recovery).where(orphan_recovery.c.payment_id == payment_id).values(**values))

    def oldest_settled(self, statuses: tuple[str, ...]):
        return self.execute(select(func.min(orphan_recovery.c.settled_at)).where(
            orphan_recovery.c.status.in_(statuses))).scalar()

    def listing(self, status: str | None = None) -> list[dict]:
        query = select(orphan_recovery).order_by(orphan_recovery.c.created_at)
        if status:
            query = query.where(orphan_recovery.c.status == status)
        return [dict(r) for r in self.execute(query).mappings()]

    def held_for_review(self, user_id: str) -> list[str]:
        return list(self.execute(select(orphan_recovery.c.payment_id).where(
            orphan_recovery.c.user_id == user_id, orphan_recovery.c.status == "needs_review")).scalars())
