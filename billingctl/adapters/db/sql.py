"""Small SQL helpers that read the same on PostgreSQL and SQLite."""

from __future__ import annotations

from sqlalchemy import Table


def insert_ignore(uow, table: Table, values: dict, conflict: list[str]) -> bool:
    """INSERT … ON CONFLICT DO NOTHING; True when this call inserted the row."""
    if uow.dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    statement = insert(table).values(**values).on_conflict_do_nothing(index_elements=conflict)
    return uow.execute(statement).rowcount == 1
