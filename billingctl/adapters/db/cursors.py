"""Small named values kept in `poller_cursor` (a poller's cursor, a resumable listing's position, the
last reconcile's count)."""

from __future__ import annotations

from sqlalchemy import select, update

from billingctl.adapters.db.repository import Repository
from billingctl.adapters.db.sql import insert_ignore
from billingctl.adapters.db.tables import poller_cursor


class Cursors(Repository):
    def get(self, name: str) -> str | None:
        return self.execute(select(poller_cursor.c.value).where(poller_cursor.c.name == name)).scalar()

    def put(self, name: str, value: str, now) -> None:
        insert_ignore(self.uow, poller_cursor, {"name": name, "value": value, "updated_at": now}, ["name"])
        self.execute(update(poller_cursor).where(poller_cursor.c.name == name).values(value=value, updated_at=now))

    def forget(self, name: str) -> None:
        self.execute(poller_cursor.delete().where(poller_cursor.c.name == name))

