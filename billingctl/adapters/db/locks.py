"""Processor locks: one live `user_credits` row per user holding the processor locked on each lane
(and the NSFW merchant account). Soft-deleted rows are excluded from every reader and writer."""

from __future__ import annotations

from functools import lru_cache

from sqlalchemy import and_, bindparam, or_, select, update

from billingctl.adapters.db.repository import Repository
from billingctl.adapters.db.sql import insert_ignore, on_driver
from billingctl.adapters.db.tables import user_credits

MID = "nsfw_processor_mid"


def _live(user_id: str):
    return and_(user_credits.c.user_id == user_id, user_credits.c.deleted_at.is_(None))


def _unlocked(column: str):
    return or_(user_credits.c[column].is_(None), user_credits.c[column] == "")


class ProcessorLocks(Repository):
    def read(self, user_id: str) -> dict | None:
        return self.uow.first(on_driver(_read_statement()), {"user_id": str(user_id)})

    def ensure(self, user_id: str, now) -> None:
        insert_ignore(self.uow, user_credits, {"user_id": user_id, "created_at": now}, ["user_id"],
                      "deleted_at IS NULL")

    def lock_first(self, user_id: str, column: str, values: dict, now) -> bool:
        """One conditional statement: create the user's row locked, or lock the row only while `column` is
        still unlocked (first write wins). True when this call locked it."""
        statement = _lock_statement(self.uow.dialect, column, tuple(sorted(values)))
        return self.uow.first(on_driver(statement), {"user_id": user_id, "created_at": now, **values}) is not None

    def relock(self, user_id: str, column: str, values: dict) -> bool:
        """Lock an existing row while `column` is unlocked; True when it did."""
        statement = update(user_credits).where(_live(user_id), _unlocked(column)).values(**values)
        return self.execute(statement).rowcount == 1

    def clear(self, user_id: str, column: str, stored: str, values: dict) -> None:
        self.execute(update(user_credits).where(_live(user_id), user_credits.c[column] == stored).values(**values))

    def soft_delete(self, user_id: str, now) -> None:
        self.execute(update(user_credits).where(_live(user_id)).values(deleted_at=now))

    def legacy_without_mid(self, legacy: str) -> list:
        """(row id, user id) of live rows locked to the legacy processor with no merchant account."""
        return self.execute(select(user_credits.c.id, user_credits.c.user_id).where(
            user_credits.c.deleted_at.is_(None), user_credits.c.nsfw_processor == legacy, _unlocked(MID))).all()

    def fill_mid(self, row_id: int, legacy: str, mid: str) -> None:
        self.execute(update(user_credits).where(
            user_credits.c.id == row_id, user_credits.c.nsfw_processor == legacy, _unlocked(MID)
        ).values(nsfw_processor_mid=mid))


    def settles_since(self, since) -> list[dict]:
        """Captured payments since `since` with their user's live locks (`lock list`)."""
        from billingctl.adapters.db.tables import transaction

        rows = self.execute(
            select(transaction.c.transaction_id, transaction.c.customer_id, transaction.c.processor,
                   transaction.c.created_at, user_credits.c.sfw_processor, user_credits.c.nsfw_processor)
            .outerjoin(user_credits, (user_credits.c.user_id == transaction.c.customer_id)
                       & user_credits.c.deleted_at.is_(None))
            .where(transaction.c.status.in_(("captured", "partially_captured")), transaction.c.created_at >= since)
            .order_by(transaction.c.created_at))
        return [dict(r) for r in rows.mappings()]

@lru_cache(maxsize=1)
def _read_statement():
    """A user's live lock row, built once: every recording reads it (issue 39 item 4)."""
    return select(user_credits).where(_live(bindparam("user_id")))


@lru_cache(maxsize=8)
def _lock_statement(dialect: str, column: str, columns: tuple[str, ...]):
    from sqlalchemy import text

    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    # Its columns named, each a parameter of its column's type: compiled once, the same for every call.
    statement = insert(user_credits).values({name: bindparam(name, type_=user_credits.c[name].type)
                                             for name in ("user_id", "created_at", *columns)})
    return statement.on_conflict_do_update(
        index_elements=["user_id"], index_where=text("deleted_at IS NULL"),
        set_={name: statement.excluded[name] for name in columns}, where=_unlocked(column),
    ).returning(user_credits.c.id)
