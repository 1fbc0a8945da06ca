"""Test fixtures: real PostgreSQL and Redis (started here unless BILLING_TEST_* URLs are given),
the embedded SQLite default, and containers built exactly as production builds them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

import webhooks_app  # noqa: F401 - the receiver of the in-process sandbox's webhooks
from billingctl.adapters.db.engine import make_engine
from billingctl.adapters.db.migrate import upgrade
from billingctl.adapters.db.tables import metadata
from billingctl.bootstrap import Container
from billingctl.settings import load_settings
from tests.servers import PostgresServer, RedisServer

# Never let a developer's environment leak into the tests.
for _key in list(os.environ):
    if _key.startswith("BILLING_") and not _key.startswith("BILLING_TEST_"):
        del os.environ[_key]


def pytest_collection_modifyitems(config, items):
    """The longest tests first (the simulations: the month in separate processes alone takes minutes), so
    that under pytest-xdist one worker runs them while the others take the rest, instead of the whole run
    waiting on them at its end (`make test` stays under its 15 minutes)."""
    def rank(item) -> int:
        if not item.get_closest_marker("simulation"):
            return 2
        return 0 if "test_processes" in item.nodeid else 1

    items.sort(key=rank)  # stable: the order within each rank is kept


@pytest.fixture(scope="session")
def pg_server_url():
    url = os.environ.get("BILLING_TEST_DATABASE_URL")
    if url:
        yield url
        return
    server = PostgresServer()
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_server_url():
    url = os.environ.get("BILLING_TEST_REDIS_URL")
    if url:
        yield url
        return
    server = RedisServer()
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


def create_database(server_url: str, name: str) -> str:
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return server_url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture(scope="session")
def pg_url(pg_server_url):
    """A migrated PostgreSQL database shared by the session; tables are emptied between tests."""
    url = create_database(pg_server_url, "billing_test")
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    return url


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sqlite-template") / "billing.db"
    engine = make_engine(f"sqlite:///{path}")
    upgrade(engine)
    engine.dispose()
    return path


def clock_to_sandbox(container, store=None) -> None:
    """Set the container's manual clock to the sandbox's instant (`store`: the container's in-process
    sandbox unless another, e.g. a production stack's, is named)."""
    from datetime import UTC, datetime

    store = store or container.sandbox.store
    container.clock.set(datetime.fromtimestamp(store.now(), UTC))


def advance_with_sandbox(container, seconds: float, store=None) -> None:
    """Move the sandbox's clock, and the container's manual clock to the same instant. The
    sandbox's clock is real time plus an offset, so it runs on between steps: advancing both by the same
    amount leaves ours behind by the real time elapsed, and on a slow machine a payment 16 s old looked
    14 s old, so orphan recovery called it too recent (CI failed on it)."""
    own = store is None or store is container.sandbox.store
    store = store or container.sandbox.store
    store.advance_clock(seconds)
    clock_to_sandbox(container, store)
    if own:  # the orchestrator's retries of failed webhook deliveries fall due as its time passes
        container.sandbox.redeliver_due()


def _truncate_postgres(url: str) -> None:
    engine = make_engine(url)
    names = ", ".join(f'"{t.name}"' for t in metadata.sorted_tables)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {names} RESTART IDENTITY CASCADE"))
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """Every database test runs on the embedded SQLite default and on PostgreSQL."""
    if request.param == "sqlite":
        path = tmp_path / "billing.db"
        shutil.copy(request.getfixturevalue("sqlite_template"), path)
        return f"sqlite:///{path}"
    url = request.getfixturevalue("pg_url")
    _truncate_postgres(url)
    return url


@pytest.fixture
def redis_url(redis_server_url):
    import redis

    client = redis.Redis.from_url(redis_server_url)
    client.flushdb()
    client.close()
    return redis_server_url


@pytest.fixture
def make_settings(tmp_path):
    def build(**overrides):
        base = {
            "env": "development",
            "sandbox_db": str(tmp_path / "sandbox.db"),
            "auth_content_dir": str(tmp_path / "auth-content"),
            "webhook_spool_dir": str(tmp_path / "webhook-spool"),
            "internal_token": "test-internal-token",
            # The per-user checkout rate counts real seconds while the tests' clocks are manual: a test that
            # models it names the real figure (tests/e2e/test_user_api.py, the flood).
            "checkout_starts_per_user_per_minute": 1000,
        }
        base.update(overrides)
        return load_settings(**base)

    return build


@pytest.fixture
def settings(make_settings, db_url):
    return make_settings(database_url=db_url)


@pytest.fixture
def container(settings):
    c = Container(settings)
    yield c
    c.close()


@pytest.fixture(autouse=True)
def _fresh_warning_throttle():
    """Each test sees the first warning of a lasting condition (they are throttled per process)."""
    from billingctl.adapters import logs

    logs._last_warned.clear()
