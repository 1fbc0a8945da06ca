"""Unit of work: one database transaction that rolls back unless committed.

The pool does not ping a connection before lending it (that is one more round trip per transaction).
A connection the server dropped (a restart, an idle timeout) fails on its first statement instead: the
pool is invalidated and that first statement is retried once on a fresh connection, which is safe
because nothing of the transaction has happened yet. A drop later in a transaction is an error the
caller sees (the transaction is gone; the web tier answers 503, a job retries on its next run)."""

from __future__ import annotations

from functools import cached_property

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from billingctl.adapters.db.acks import ReconcileAcks
from billingctl.adapters.db.audit import AuditLog
from billingctl.adapters.db.books import Books
from billingctl.adapters.db.checkouts import Checkouts
from billingctl.adapters.db.cursors import Cursors
from billingctl.adapters.db.disputes import Disputes
from billingctl.adapters.db.dunning import DunningAttempts
from billingctl.adapters.db.fraud import FraudEvents
from billingctl.adapters.db.inbox import Inbox, PollerRuns
from billingctl.adapters.db.leases import Leases
from billingctl.adapters.db.locks import ProcessorLocks
from billingctl.adapters.db.orphans import Orphans
from billingctl.adapters.db.outbox import Outbox
from billingctl.adapters.db.purchases import Ledger, NewPayments, Purchases, Transactions
from billingctl.adapters.db.subscriptions import Invoices, Subscriptions
from billingctl.adapters.db.users import Users


class UnitOfWork:
    """`with uow: ...; uow.commit()` — leaving the block without commit() discards everything.
    `autocommit=True` runs each statement alone (no BEGIN, no COMMIT; on SQLite no write lock for a
    read): a single read, or a single write, is one round trip. Its engine is then one whose connections
    are in autocommit (`engine.autocommit_engine`)."""

    def __init__(self, engine: Engine, autocommit: bool = False):
        self._engine = engine
        self.autocommit = autocommit
        self.conn: Connection | None = None
        self._fresh = True

    def _connect(self) -> None:
        self.conn = self._engine.connect()
        self._tx = self.conn.begin()

    def __enter__(self) -> UnitOfWork:
        self._connect()
        self._fresh = True
        return self

    def commit(self) -> None:
        self._tx.commit()  # with autocommit: nothing left to send

    def rollback(self) -> None:
        if self._tx.is_active:
            self._tx.rollback()

    def __exit__(self, *exc) -> None:
        try:
            self.rollback()
        finally:
            self.conn.close()
            self.conn = None

    # The repositories: each owns the SQL of one aggregate.
    @cached_property
    def acks(self) -> ReconcileAcks:
        return ReconcileAcks(self)

    @cached_property
    def audit(self) -> AuditLog:
        return AuditLog(self)

    @cached_property
    def books(self) -> Books:
        return Books(self)

    @cached_property
    def checkouts(self) -> Checkouts:
        return Checkouts(self)

    @cached_property
    def cursors(self) -> Cursors:
        return Cursors(self)

    @cached_property
    def dunning(self) -> DunningAttempts:
        return DunningAttempts(self)

    @cached_property
    def disputes(self) -> Disputes:
        return Disputes(self)

    @cached_property
    def fraud(self) -> FraudEvents:
        return FraudEvents(self)

    @cached_property
    def inbox(self) -> Inbox:
        return Inbox(self)

    @cached_property
    def poller_runs(self) -> PollerRuns:
        return PollerRuns(self)

    @cached_property
    def invoices(self) -> Invoices:
        return Invoices(self)

    @cached_property
    def leases(self) -> Leases:
        return Leases(self)

    @cached_property
    def ledger(self) -> Ledger:
        return Ledger(self)

    @cached_property
    def locks(self) -> ProcessorLocks:
        return ProcessorLocks(self)

    @cached_property
    def orphans(self) -> Orphans:
        return Orphans(self)

    @cached_property
    def new_payments(self) -> NewPayments:
        return NewPayments(self)

    @cached_property
    def outbox(self) -> Outbox:
        return Outbox(self)

    @cached_property
    def purchases(self) -> Purchases:
        return Purchases(self)

    @cached_property
    def subscriptions(self) -> Subscriptions:
        return Subscriptions(self)

    @cached_property
    def transactions(self) -> Transactions:
        return Transactions(self)

    @cached_property
    def users(self) -> Users:
        return Users(self)

    # The repositories' one door to the connection.
    def execute(self, statement, params=None):
        return self._once_more_if_dead(self._execute, statement, params)

    def first(self, statement, params: dict) -> dict | None:
        """A hot statement (`sql.DriverStatement`) on the driver's cursor, in this transaction: its first row
        as a dict, or None."""
        return self._once_more_if_dead(self._first, statement, params)

    def _once_more_if_dead(self, run, statement, params):
        """A connection found dead on the transaction's first statement is replaced, and the statement run
        again: nothing of the transaction had happened yet."""
        try:
            result = run(statement, params)
        except DBAPIError as exc:
            if not (self._fresh and exc.connection_invalidated):
                raise
            # The pooled connection was dead before this transaction began: start it again once.
            try:
                self.conn.close()
            except DBAPIError:
                pass
            self._connect()
            result = run(statement, params)
        self._fresh = self.autocommit  # autocommit: every statement stands alone
        return result

    def _first(self, statement, params: dict):
        return statement.run_translated(self.conn.connection.dbapi_connection, self._engine.dialect, params,
                                        self.conn.invalidate)

    def _execute(self, statement, params):
        return self.conn.execute(statement, params) if params is not None else self.conn.execute(statement)

    @property
    def dialect(self) -> str:
        return self._engine.dialect.name
