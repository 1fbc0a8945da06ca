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


class DriverRead:
    """A hot read that stands alone (a duplicate's one read), compiled once per engine and run on the
    driver's own cursor of a pooled autocommit connection: no SQLAlchemy execution context, result or
    connection wrapper per call, which were a third of a duplicate webhook's CPU (issue 39 item 4). Its
    columns' result processing is the SQLAlchemy types' own (JSON text on SQLite). A pooled connection the
    server dropped is invalidated and the read retried once on a fresh one, as the unit of work does; any
    other driver error is raised as SQLAlchemy's DBAPIError, like every other statement's."""

    def __init__(self, statement):
        self.statement = statement
        self._compiled: dict = {}

    def _compile(self, engine):
        dialect = engine.dialect
        compiled = self.statement.compile(dialect=dialect)
        columns = self.statement.selected_columns
        processors = [column.type.dialect_impl(dialect).result_processor(dialect, None) for column in columns]
        # The statement's own values (literals, constants) bound once; the named ones each call, through
        # their type's processor when it has one.
        base = compiled.construct_params(_check=False)
        given = {name: bind.type.dialect_impl(dialect).bind_processor(dialect)
                 for name, bind in compiled.binds.items() if bind.required}
        for name, bind in compiled.binds.items():
            if name not in given and base.get(name) is not None:
                process = bind.type.dialect_impl(dialect).bind_processor(dialect)
                base[name] = process(base[name]) if process else base[name]
        order = compiled.positiontup if compiled.positional else None
        return compiled.string, order, processors, [column.key for column in columns], base, given

    def first(self, engine, params: dict):
        """The first row as a dict of its columns, or None."""
        from sqlalchemy.exc import DBAPIError

        compiled = self._compiled.get(engine)
        if compiled is None:
            compiled = self._compiled[engine] = self._compile(engine)
        sql, order, processors, names, base, given = compiled
        values = dict(base)
        for name, process in given.items():
            values[name] = process(params[name]) if process else params[name]
        args = tuple(values[name] for name in order) if order is not None else values
        dialect = engine.dialect
        for attempt in (1, 2):
            pooled = cursor = None
            try:
                pooled = engine.raw_connection()  # a refused connect is the driver's error too
                cursor = pooled.dbapi_connection.cursor()
                cursor.execute(sql, args)
                row = cursor.fetchone()
            except dialect.loaded_dbapi.Error as exc:
                dropped = pooled is not None and dialect.is_disconnect(exc, pooled.dbapi_connection, cursor)
                if dropped:
                    pooled.invalidate(exc)
                if dropped and attempt == 1:
                    continue
                raise DBAPIError.instance(sql, args, exc, dialect.loaded_dbapi.Error, hide_parameters=True,
                                          connection_invalidated=dropped, dialect=dialect) from exc
            finally:
                if cursor is not None:
                    cursor.close()
                if pooled is not None:
                    pooled.close()
            if row is None:
                return None
            return {name: (value if process is None else process(value))
                    for name, process, value in zip(names, processors, row, strict=True)}
        return None
