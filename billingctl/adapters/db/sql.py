"""Small SQL helpers that read the same on PostgreSQL and SQLite."""

from __future__ import annotations

import os
import threading
from functools import lru_cache

from sqlalchemy import Table
from sqlalchemy.exc import DBAPIError


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


class DriverStatement:
    """A hot statement compiled once per dialect and run on the driver's own cursor: no SQLAlchemy execution
    context, result or connection wrapper per call (issue 39 item 4: they were a third of a duplicate
    webhook's CPU, and about 85 µs of each statement of a new payment). What it does is SQLAlchemy's own:
    its compiled SQL (an IN list of constants expanded once), its types' processing of every parameter and
    every column (JSON text and times on SQLite). Two ways to run it:
    - `first(engine, params)`: standing alone, on a pooled connection of an autocommit engine (a
      duplicate's one read). A pooled connection the server dropped is invalidated and the statement
      retried once, as the unit of work does;
    - `UnitOfWork.first(statement, params)`: inside the unit of work's transaction.
    A driver error, a refused connect included, is raised as SQLAlchemy's DBAPIError with its parameters
    hidden, so the error table and the jobs' exit codes see what they always saw."""

    def __init__(self, statement):
        self.statement = statement
        self._compiled: dict = {}

    def _compile(self, dialect):
        compiled = self.statement.compile(dialect=dialect)
        required = [name for name, bind in compiled.binds.items() if bind.required]
        # The statement's own values (literals, constants, an IN list's members) bound once; the named ones
        # each call, through their type's processor when it has one.
        expanded = compiled.construct_expanded_state(dict.fromkeys(required))
        base = dict(expanded.parameters)
        processors = {name: compiled.binds[name].type.dialect_impl(dialect).bind_processor(dialect)
                      for name in required}
        for name, value in base.items():
            bind = compiled.binds.get(name)
            if name not in processors and value is not None and bind is not None:
                process = bind.type.dialect_impl(dialect).bind_processor(dialect)
                base[name] = process(value) if process else value
        columns = self.statement.exported_columns  # a SELECT's columns, or what a write RETURNs
        results = [(column.key, column.type.dialect_impl(dialect).result_processor(dialect, None))
                   for column in columns]
        return expanded.statement, expanded.positiontup, base, processors, results

    def run(self, dbapi_connection, dialect, params: dict) -> dict | None:
        """The first row as a dict of its columns, or None; the driver's own errors."""
        compiled = self._compiled.get(dialect)
        if compiled is None:
            compiled = self._compiled[dialect] = self._compile(dialect)
        sql, order, base, processors, results = compiled
        values = dict(base)
        for name, process in processors.items():
            values[name] = process(params[name]) if process else params[name]
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(sql, tuple(values[name] for name in order) if order is not None else values)
            row = cursor.fetchone()  # a SELECT, or a write that RETURNs: there is always a result
        finally:
            cursor.close()
        if row is None:
            return None
        return {name: (value if process is None else process(value))
                for (name, process), value in zip(results, row, strict=True)}

    def run_translated(self, dbapi_connection, dialect, params: dict, invalidate) -> dict | None:
        """`run`, the driver's error raised as SQLAlchemy raises it (its subclass by the driver's class,
        parameters hidden); a connection the error shows dropped is first given to `invalidate`."""
        try:
            return self.run(dbapi_connection, dialect, params)
        except dialect.loaded_dbapi.Error as exc:
            dropped = dialect.is_disconnect(exc, dbapi_connection, None)
            if dropped:
                invalidate(exc)
            raise self._wrapped(exc, dialect, dropped) from exc

    def _wrapped(self, exc, dialect, dropped: bool):
        sql = self._compiled[dialect][0] if dialect in self._compiled else None
        return DBAPIError.instance(sql, None, exc, dialect.loaded_dbapi.Error, hide_parameters=True,
                                   connection_invalidated=dropped, dialect=dialect)

    def first(self, engine, params: dict, held: HeldConnection | None = None) -> dict | None:
        """Standing alone on a pooled connection of `engine` (in autocommit): `held`'s when it has one
        for this thread, else one checked out for the statement and returned after it."""
        dialect = engine.dialect
        for attempt in (1, 2):
            try:
                pooled = held.connection() if held is not None else None
                keep = pooled is not None
                if not keep:
                    pooled = engine.raw_connection()
            except dialect.loaded_dbapi.Error as exc:  # a refused connect
                raise self._wrapped(exc, dialect, False) from exc
            try:
                return self.run_translated(pooled.dbapi_connection, dialect, params, pooled.invalidate)
            except DBAPIError as exc:
                keep = False  # a failed statement gives the held connection back (invalidated when dropped)
                if held is not None:
                    held.forget(pooled)
                if not (exc.connection_invalidated and attempt == 1):
                    raise
            finally:
                if not keep:
                    pooled.close()
        return None


class HeldConnection:
    """One pooled connection of an autocommit engine kept checked out by the thread that first asks for
    it: a sync web worker's one request thread (issue 39 item 4). The pool's check-out and return were
    62,000 of a duplicate webhook's 879,000 instructions; a worker holding its connection between
    requests, as Django's persistent connections do, skips them. Any other thread gets None and uses
    the pool. A statement that fails gives the connection back (`forget`): invalidated when the server
    dropped it, so the next request checks out a fresh one. `close` returns it (Container.close, before
    the engine is disposed); a forked child never uses its parent's."""

    def __init__(self, engine):
        self.engine = engine
        self._guard = threading.Lock()
        self._owner: tuple[int, int] | None = None
        self._pooled = None

    def connection(self):
        """The held pooled connection, checked out on first use; None on a thread that does not own it."""
        me = (os.getpid(), threading.get_ident())
        if self._owner != me:
            with self._guard:
                if self._owner is None or self._owner[0] != me[0]:  # unclaimed, or the parent's copy
                    self._owner, self._pooled = me, None
                elif self._owner != me:
                    return None
        if self._pooled is None:
            self._pooled = self.engine.raw_connection()
        return self._pooled

    def forget(self, pooled) -> None:
        """The caller returns `pooled` to the pool itself; the next use checks out another."""
        if self._pooled is pooled:
            self._pooled = None

    def close(self) -> None:
        pooled, self._pooled = self._pooled, None
        if pooled is not None and self._owner is not None and self._owner[0] == os.getpid():
            pooled.close()


_ON_DRIVER: dict[int, DriverStatement] = {}


def on_driver(statement) -> DriverStatement:
    """The DriverStatement of a statement its builder makes once (`lru_cache`): compiled on its first run."""
    found = _ON_DRIVER.get(id(statement))
    if found is None:  # it holds the statement, so the id stays this statement's
        found = _ON_DRIVER.setdefault(id(statement), DriverStatement(statement))
    return found
