"""The alert outbox: messages to the chat, notification and analytics sinks, delivered after commit."""

from __future__ import annotations

from sqlalchemy import and_, func, or_, select, update

from billingctl.adapters.db.repository import Repository
from billingctl.adapters.db.sql import insert_ignore
from billingctl.adapters.db.tables import alert_outbox

UNDELIVERED = ("pending", "sending")


def _due(now):
    return and_(alert_outbox.c.status.in_(UNDELIVERED),
                or_(alert_outbox.c.next_attempt_at.is_(None), alert_outbox.c.next_attempt_at <= now))


class Outbox(Repository):
    def add(self, row: dict) -> bool:
        """Queue one message (`services.alerts.outbox_row`); False when its dedupe key was already queued."""
        return insert_ignore(self.uow, alert_outbox, row, ["dedupe_key"])

    def queued(self, dedupe_key: str) -> bool:
        """Whether a message with this dedupe key was ever queued."""
        return self.execute(select(alert_outbox.c.id).where(alert_outbox.c.dedupe_key == dedupe_key)
                            .limit(1)).first() is not None

    def newest_created(self, key_prefix: str):
        """When the newest message whose dedupe key starts with this prefix was queued (None: never)."""
        return self.execute(select(func.max(alert_outbox.c.created_at))
                            .where(alert_outbox.c.dedupe_key.startswith(key_prefix, autoescape=True))).scalar_one()

    def due(self, now, sinks: list[str], limit: int) -> list:
        return self.execute(select(alert_outbox).where(_due(now), alert_outbox.c.sink.in_(sinks))
                            .order_by(alert_outbox.c.id).limit(limit)).mappings().all()

    def count_due_elsewhere(self, now, sinks: list[str]) -> int:
        """Due messages for sinks other than these (sinks with no URL configured)."""
        return self.execute(select(func.count()).select_from(alert_outbox).where(
            _due(now), alert_outbox.c.sink.not_in(sinks))).scalar_one()

    def claim(self, row, now, until) -> bool:
        """Take one due message for one delivery attempt; of two runners only one wins."""
        return self.execute(
            update(alert_outbox)
            .where(alert_outbox.c.id == row["id"], alert_outbox.c.attempts == row["attempts"], _due(now))
            .values(status="sending", attempts=row["attempts"] + 1, next_attempt_at=until)).rowcount == 1

    def retry_at(self, message_id: int, error: str, when) -> None:
        self.execute(update(alert_outbox).where(alert_outbox.c.id == message_id).values(
            status="pending", last_error=error[:500], next_attempt_at=when))

    def delivered(self, message_id: int, now) -> None:
        self.execute(update(alert_outbox).where(alert_outbox.c.id == message_id).values(
            status="delivered", delivered_at=now, last_error=None))

    def count_undelivered(self) -> int:
        return self.execute(select(func.count()).select_from(alert_outbox).where(
            alert_outbox.c.status.in_(UNDELIVERED))).scalar_one()

    def backlog(self) -> dict[str, dict]:
        """Per sink: undelivered messages and when the oldest was queued (the scrape)."""
        return {row.sink: {"pending": int(row.n), "oldest": row.oldest} for row in self.execute(
            select(alert_outbox.c.sink, func.count().label("n"), func.min(alert_outbox.c.created_at).label("oldest"))
            .where(alert_outbox.c.status.in_(UNDELIVERED)).group_by(alert_outbox.c.sink))}

    def undelivered_per_sink(self) -> dict[str, int]:
        return dict(self.execute(select(alert_outbox.c.sink, func.count()).where(
            alert_outbox.c.status.in_(UNDELIVERED)).group_by(alert_outbox.c.sink)).all())

    def listing(self, status: str | None = None, limit: int = 50) -> list[dict]:
        query = select(alert_outbox).order_by(alert_outbox.c.id.desc()).limit(limit)
        if status:
            query = query.where(alert_outbox.c.status == status)
        return [dict(r) for r in self.execute(query).mappings()]
