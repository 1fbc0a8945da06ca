"""Unit of work: one database transaction that rolls back unless committed."""

from __future__ import annotations

from sqlalchemy import Connection, Engine


class UnitOfWork:
    """`with uow: ...; uow.commit()` — leaving the block without commit() discards everything."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self.conn: Connection | None = None
        self.committed = False

    def __enter__(self) -> UnitOfWork:
        self.conn = self._engine.connect()
        self._tx = self.conn.begin()
        self.committed = False
        return self

    def commit(self) -> None:
        self._tx.commit()
        self.committed = True

    def rollback(self) -> None:
        if self._tx.is_active:
            self._tx.rollback()

    def __exit__(self, *exc) -> None:
        try:
            self.rollback()
        finally:
            self.conn.close()
            self.conn = None

    # Thin helpers so services read naturally.
    def execute(self, statement, params=None):
        return self.conn.execute(statement, params) if params is not None else self.conn.execute(statement)

    @property
    def dialect(self) -> str:
        return self._engine.dialect.name
