"""Engine construction for PostgreSQL (psycopg 3) and the embedded SQLite default."""

from __future__ import annotations

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

from billingctl.domain.errors import ConfigError


def make_engine(url: str) -> Engine:
    try:
        parsed = make_url(url)
    except Exception:
        raise ConfigError("configuration error: BILLING_DATABASE_URL is not a valid URL") from None
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed)
    # No pre-ping (a round trip per transaction): a dropped connection is retried by the unit of work.
    # hide_parameters: a database error's message (logged, with its traceback) never carries the
    # statement's parameters, which hold emails and payloads (issue 37). No column is hstore: an engine's
    # first connection does not look the type up (a savepoint and a query, issue 39 item 5).
    return create_engine(parsed, pool_size=10, max_overflow=20, hide_parameters=True, use_native_hstore=False)


def autocommit_engine(engine: Engine) -> Engine:
    """The engine for statements that each stand alone (`UnitOfWork(autocommit=True)`). On PostgreSQL a
    pool of its own whose connections are in autocommit from their first connect: lending one changes
    nothing on it, and taking it back has no transaction to roll back. Switching a shared connection to
    autocommit and back cost the duplicate webhook a fifth of its CPU (issue 39 item 4). On SQLite every
    connection is in the driver's autocommit already (we send BEGIN IMMEDIATE ourselves): the shared pool,
    with an option that tells the begin hook to send nothing."""
    if engine.dialect.name == "sqlite":
        return engine.execution_options(standalone=True)
    return create_engine(engine.url, pool_size=5, max_overflow=20, hide_parameters=True, use_native_hstore=False,
                         isolation_level="AUTOCOMMIT", pool_reset_on_return=None)


def _sqlite_engine(url) -> Engine:
    engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False}, hide_parameters=True)

    # pysqlite's own transaction handling defers BEGIN and never takes a write lock up front, so two
    # writers can deadlock on upgrade. We open every transaction with BEGIN IMMEDIATE: writers queue
    # on the busy timeout instead, which is what exactly-once recording needs.
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        if conn.get_execution_options().get("standalone"):
            return  # UnitOfWork(autocommit=True): each statement alone; a read takes no write lock
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def redact(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<invalid>"
