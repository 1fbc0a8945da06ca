"""Fraud events: authorization attempts (the quota's input, with their reservations), velocity
triggers and disputes."""

from __future__ import annotations

from sqlalchemy import delete, select, update

from billingctl.adapters.db.repository import Repository
from billingctl.adapters.db.sql import insert_ignore
from billingctl.adapters.db.tables import fraud_event


class FraudEvents(Repository):
    def add(self, user_id: str, event_type: str, now, metadata: dict, dedupe_key: str | None = None) -> bool:
        """One event; with a key, a second report of the same event adds nothing (False)."""
        values = {"user_id": user_id, "event_type": event_type, "created_at": now, "dedupe_key": dedupe_key,
                  "metadata": metadata}
        if dedupe_key is None:
            self.execute(fraud_event.insert().values(**values))
            return True
        return insert_ignore(self.uow, fraud_event, values, ["dedupe_key"])

    def since(self, user_id: str, event_type: str, after) -> list:
        """(created_at, metadata) of the user's events of one type created after `after`."""
        return self.execute(select(fraud_event.c.created_at, fraud_event.c.metadata).where(
            fraud_event.c.user_id == user_id, fraud_event.c.event_type == event_type,
            fraud_event.c.created_at > after)).all()

    def exists(self, key: str) -> bool:
        return self.execute(select(fraud_event.c.id).where(fraud_event.c.dedupe_key == key)).first() is not None

    def rename(self, key: str, new_key: str) -> bool:
        return self.execute(update(fraud_event).where(fraud_event.c.dedupe_key == key).values(
            dedupe_key=new_key)).rowcount == 1

    def remove(self, key: str) -> None:
        self.execute(delete(fraud_event).where(fraud_event.c.dedupe_key == key))
