"""Small SQL helpers that read the same on PostgreSQL and SQLite."""

from __future__ import annotations

from sqlalchemy import Table


def insert_ignore(uow, table: Table, values: dict, conflict: list[str]) -> bool:
    """INSERT … ON CONFLICT DO NOTHING; True when this call inserted the row."""
    if uow.dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    key = list(table.primary_key.columns)[0]
    statement = insert(table).values(**values).on_conflict_do_nothing(index_elements=conflict).returning(key)
    # RETURNING, not rowcount: psycopg reports -1 for a statement that may return rows.
    return uow.execute(statement).first() is not None
