"""Small SQL helpers that read the same on PostgreSQL and SQLite."""

from __future__ import annotations

from functools import lru_cache

from sqlalchemy import Table


def _insert(dialect: str):
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert


@lru_cache(maxsize=256)
def _insert_ignore_statement(dialect: str, table: Table, conflict: tuple[str, ...], index_where: str | None):
    from sqlalchemy import text

    insert = _insert(dialect)

    key = list(table.primary_key.columns)[0]
    where = text(index_where) if index_where else None
    # RETURNING, not rowcount: psycopg reports -1 for a statement that may return rows.
    return insert(table).on_conflict_do_nothing(index_elements=list(conflict), index_where=where).returning(key)


def insert_ignore(uow, table: Table, values: dict, conflict: list[str], index_where: str | None = None) -> bool:
    """INSERT … ON CONFLICT DO NOTHING; True when this call inserted the row. The statement is built once
    per table and column set (the hot path of recording runs it several times a payment)."""
    statement = _insert_ignore_statement(uow.dialect, table, tuple(conflict), index_where)
    return uow.execute(statement, values).first() is not None


@lru_cache(maxsize=64)
def _upsert_statement(dialect: str, table: Table, conflict: tuple[str, ...], increment: str,
                      returning: tuple[str, ...]):
    statement = _insert(dialect)(table)
    column = table.c[increment]
    return statement.on_conflict_do_update(index_elements=list(conflict), set_={increment: column + 1}) \
        .returning(*(table.c[name] for name in returning))


def insert_or_count(uow, table: Table, values: dict, conflict: list[str], counter: str, returning: list[str]):
    """INSERT the row, or add one to `counter` on the row already there; one statement, returning the
    named columns of the row as it is afterwards."""
    statement = _upsert_statement(uow.dialect, table, tuple(conflict), counter, tuple(returning))
    return uow.execute(statement, values).one()


@lru_cache(maxsize=64)
def _upsert_all_statement(dialect: str, table: Table, conflict: tuple[str, ...], columns: tuple[str, ...],
                          keep: tuple[str, ...]):
    statement = _insert(dialect)(table)
    return statement.on_conflict_do_update(
        index_elements=list(conflict),
        set_={name: statement.excluded[name] for name in columns if name not in conflict and name not in keep})


def upsert(uow, table: Table, values: dict, conflict: list[str], keep: tuple[str, ...] = ("created_at",)) -> None:
    """INSERT the row, or overwrite the given columns of the row already there (except `keep`): one
    statement instead of an insert-ignore and an update."""
    statement = _upsert_all_statement(uow.dialect, table, tuple(conflict), tuple(sorted(values)), keep)
    uow.execute(statement, values)
