"""Small SQL helpers that read the same on PostgreSQL and SQLite."""

from __future__ import annotations

from functools import lru_cache

from sqlalchemy import Table


@lru_cache(maxsize=256)
def _insert_ignore_statement(dialect: str, table: Table, conflict: tuple[str, ...], index_where: str | None):
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    from sqlalchemy import text

    key = list(table.primary_key.columns)[0]
    where = text(index_where) if index_where else None
    # RETURNING, not rowcount: psycopg reports -1 for a statement that may return rows.
    return insert(table).on_conflict_do_nothing(index_elements=list(conflict), index_where=where).returning(key)


def insert_ignore(uow, table: Table, values: dict, conflict: list[str], index_where: str | None = None) -> bool:
    """INSERT … ON CONFLICT DO NOTHING; True when this call inserted the row. The statement is built once
    per table and column set (the hot path of recording runs it several times a payment)."""
    statement = _insert_ignore_statement(uow.dialect, table, tuple(conflict), index_where)
    return uow.execute(statement, values).first() is not None
