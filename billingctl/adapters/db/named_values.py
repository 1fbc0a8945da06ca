"""Small named values kept in `poller_cursor` (a poller's cursor, the last reconcile's count): read and
written in one place, each in the caller's own transaction-free call."""

from __future__ import annotations

from sqlalchemy import select, update

from billingctl.adapters.db.sql import insert_ignore
from billingctl.adapters.db.tables import poller_cursor


def read_value(container, name: str) -> str | None:
    with container.uow() as uow:
        return uow.execute(select(poller_cursor.c.value).where(poller_cursor.c.name == name)).scalar()


def write_value(container, name: str, value: str) -> None:
    now = container.clock.now()
    with container.uow() as uow:
        insert_ignore(uow, poller_cursor, {"name": name, "value": value, "updated_at": now}, ["name"])
        uow.execute(update(poller_cursor).where(poller_cursor.c.name == name).values(value=value, updated_at=now))
        uow.commit()
