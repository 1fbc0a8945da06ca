"""Test helpers: real HTTP servers on loopback (the sandbox, a recording chat sink)."""

from __future__ import annotations

import base64
import threading
from contextlib import contextmanager
from pathlib import Path

from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

from tests.servers import free_port


class LoopbackServer:
    """Serve a WSGI app on 127.0.0.1 in a background thread."""

    def __init__(self, app):
        self.port = free_port()
        from billingctl.sandbox.apps import handler_dated_by_the_app

        self.server = make_server("127.0.0.1", self.port, app, threaded=True,
                                  request_handler=handler_dated_by_the_app())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.thread.join(5)


class RecordingSink:
    """A Slack-compatible incoming webhook that records what it accepts; `up=False` answers 503."""

    def __init__(self):
        self.up = True
        self.received: list[bytes] = []

    def __call__(self, environ, start_response):
        request = Request(environ)
        if not self.up:
            return Response("down", status=503)(environ, start_response)
        self.received.append(request.get_data())
        return Response("ok")(environ, start_response)


class ProductionStack:
    """A container configured as production (every secret, RS256 sessions, real URLs) whose external
    systems are the sandbox served on loopback."""

    AUDIENCE, ISSUER = "billing", "https://identity.example"

    def __init__(self, make_settings, db_url, tmp_path, clock=None, redis_url=None):
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        from billingctl.sandbox.model import Sandbox
        from billingctl.sandbox.store import SandboxStore

        self.private_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.public_pem = self.private_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
        self.sandbox = Sandbox(SandboxStore(tmp_path / "prod-sandbox.db"))
        self.make_settings, self.db_url, self.clock = make_settings, db_url, clock
        self.redis_url = redis_url

    def __enter__(self):
        from billingctl.bootstrap import Container
        from billingctl.sandbox.apps import create_combined_app
        from billingctl.settings import REQUIRED_IN_PRODUCTION

        self.server = LoopbackServer(create_combined_app(self.sandbox)).__enter__()
        secrets = {name: f"prod-{name}" for name in REQUIRED_IN_PRODUCTION}
        secrets["identity_webhook_secret"] = "whsec_" + base64.b64encode(b"prod-identity-webhook-secret").decode()
        secrets["session_jwt_key"] = self.public_pem
        url = self.server.url
        self.container = Container(self.make_settings(
            env="production", database_url=self.db_url, session_jwt_algorithms="RS256",
            session_jwt_audience=self.AUDIENCE, session_jwt_issuer=self.ISSUER, redis_url=self.redis_url,
            provider_url=f"{url}/provider", provider_api_key="k", provider_auth="basic",
            orchestrator_url=f"{url}/orchestrator",
            orchestrator_api_key="k", **secrets), clock=self.clock)
        self.sandbox.webhook_secret = self.container.settings.secret("orchestrator_webhook_secret")
        from billingctl.sandbox.delivery import WebhookDelivery

        self.sandbox.deliver = WebhookDelivery(self.container)  # signed webhooks into the public app
        return self

    def __exit__(self, *exc):
        self.container.close()
        self.server.__exit__(*exc)


_ZYGOTE: list = []
_ZYGOTE_LOCK = threading.Lock()


def billingctl(args, env, **kw):
    """Run the CLI as a user does: a process of its own, only the given BILLING_ variables. The process is
    forked from the worker's CLI zygote, which has imported the libraries (tests/cli_zygote.py); a fresh
    interpreter with BILLING_TEST_CLI=fresh, with subprocess options, or when `env` sets a variable that
    the interpreter or a preloaded library reads at start-up."""
    import os
    import subprocess

    from tests.cli_zygote import command, needs_fresh_interpreter

    env = {"PATH": os.environ["PATH"], **env}
    if kw or needs_fresh_interpreter(env):
        return subprocess.run(command(args), capture_output=True, text=True, env=env, timeout=120, **kw)
    return cli_zygote().run(list(args), env, timeout=120)


def billingctl_started(args, env, cwd):
    """`billingctl ARGS` started, not waited for, its stdout and stderr kept: a `subprocess.Popen`, or the
    zygote's `Run` that answers the same calls (pid, wait, communicate, send_signal, returncode)."""
    import subprocess

    from tests.cli_zygote import command, needs_fresh_interpreter

    if needs_fresh_interpreter(env):
        return subprocess.Popen(command(args), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    return cli_zygote().start(list(args), env, cwd=str(cwd))


def cli_zygote():
    """This worker's CLI zygote (tests/cli_zygote.py), started on first use."""
    from tests.cli_zygote import Zygote

    with _ZYGOTE_LOCK:
        if not _ZYGOTE:
            _ZYGOTE.append(Zygote(str(Path(__file__).resolve().parents[1])))
    return _ZYGOTE[0]


def billingctl_in_terminal(args, env, columns: int, lines: int = 50) -> str:
    """Run the CLI on a pseudo-terminal of the given size (what an operator sees): its screen output."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
    process = subprocess.Popen([sys.executable, "-m", "billingctl", *args], stdin=follower, stdout=follower,
                               stderr=subprocess.DEVNULL, env={"PATH": os.environ["PATH"], "TERM": "dumb", **env},
                               close_fds=True)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the follower side closed: the process is done writing
            break
        if not chunk:
            break
        chunks.append(chunk)
    process.wait(timeout=120)
    os.close(leader)
    return b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


@contextmanager
def table_away(engine, table: str):
    """The table cannot be read inside the block (renamed away), as when its storage fails; it comes back after."""
    from sqlalchemy import text

    with engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {table} RENAME TO {table}_away"))
    try:
        yield
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"ALTER TABLE {table}_away RENAME TO {table}"))


@contextmanager
def sandbox_served(env: dict):
    """`billingctl sandbox serve` in its own process on a free loopback port; yields its base URL."""
    import os
    import subprocess
    import sys
    import time

    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "billingctl", "sandbox", "serve", "--port", str(port)],
                            env={"PATH": os.environ["PATH"], **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                httpx.get(base, timeout=0.2)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


class RoundTrips:
    """Round trips on the wire: every Query or Sync message libpq sends to PostgreSQL (each waits for the
    server's answer), from libpq's own protocol trace of every pooled connection; every request a Redis
    connection of this process sends (a pipeline or a script is one); and, for the record, the commands
    Redis executed (its INFO commandstats: a script's inner commands count there, the counting left out)."""

    def __init__(self, container, redis_url: str | None = None):
        import tempfile

        from sqlalchemy import event

        engine = container.engine
        self.engine, self.redis_url = engine, redis_url
        self.file = tempfile.NamedTemporaryFile("w+", prefix="pqtrace-", suffix=".log")
        self.redis_sent = 0
        if redis_url:
            self._count_redis_requests()
        if engine.dialect.name == "postgresql":
            for pooled in (engine, container.autocommit_engine):  # transactions, and statements alone
                event.listen(pooled, "connect", self._trace)
                pooled.pool.dispose()  # every connection from now on is traced
        else:  # SQLite runs in process: each statement the library runs counts (its own trace)
            event.listen(engine, "connect", self._sqlite_trace)
            engine.pool.dispose()

    def _count_redis_requests(self) -> None:
        from redis.connection import AbstractConnection

        counter, send = self, AbstractConnection.send_packed_command

        def counted(connection, command, check_health=True):
            counter.redis_sent += 1
            return send(connection, command, check_health)

        AbstractConnection.send_packed_command = counted
        self._restore = lambda: setattr(AbstractConnection, "send_packed_command", send)

    def close(self) -> None:
        if hasattr(self, "_restore"):
            self._restore()

    def _sqlite_trace(self, dbapi_connection, record) -> None:
        def statement(sql: str) -> None:
            self.file.write("F\t0\tQuery\t" + " ".join(sql.split()) + "\n")

        dbapi_connection.set_trace_callback(statement)

    def _trace(self, dbapi_connection, record) -> None:
        from psycopg import pq

        dbapi_connection.pgconn.trace(self.file.fileno())
        dbapi_connection.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)

    def _redis_commands(self) -> dict:
        import redis

        if getattr(self, "_redis", None) is None:  # one connection, opened before any measurement
            self._redis = redis.Redis.from_url(self.redis_url)
            self._redis.ping()
        stats = self._redis.info("commandstats")
        return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()
                if k not in ("cmdstat_info", "cmdstat_config|resetstat", "cmdstat_config")}

    def _pg_lines(self) -> list[str]:
        self.file.flush()
        with open(self.file.name) as f:
            return [line for line in f if line.startswith("F\t")]

    @contextmanager
    def measure(self):
        """Yields a dict filled on exit with `pg` (round trips), `redis` (commands) and `statements`."""
        result: dict = {}
        pg_before = len(self._pg_lines())
        redis_before = self._redis_commands() if self.redis_url else {}
        sent_before = self.redis_sent
        yield result
        result["redis"] = self.redis_sent - sent_before
        lines = self._pg_lines()[pg_before:]
        result["pg"] = sum(1 for line in lines if line.split("\t")[2].split()[0] in ("Query", "Sync"))
        result["statements"] = [line.split("\t", 3)[3].strip()[:90] for line in lines
                                if line.split("\t")[2].split()[0] in ("Query", "Parse")]
        after = self._redis_commands() if self.redis_url else {}
        result["redis_commands"] = {k: n - redis_before.get(k, 0) for k, n in after.items()
                                    if n != redis_before.get(k, 0)}
        result["redis_commands_executed"] = sum(result["redis_commands"].values())


def legacy_checkout(container, user_id: str, item_price_id: str = "credits-pro-USD-monthly") -> dict:
    """A pending checkout made without the one-live-subscription rule (decision 110): one made before the
    rule existed, or by another integration on the account. Only the states the same-plan duplicate path
    exists for are built with it."""
    import uuid

    from billingctl.services import catalog, checkout

    plan = catalog.plan(container, item_price_id)
    _, lock = checkout._read_user_and_lock(container, user_id)
    return checkout._create(container, user_id, plan, lock, None, container.clock.now(), uuid.uuid4().hex)


def plan_not_held(container, user_id: str, plans: tuple[str, ...]) -> str:
    """The first of `plans` the user holds no live subscription of (tests that settle several payments of
    one lane for one user: one live subscription per customer and plan)."""
    with container.uow() as uow:
        for plan in plans:
            if not uow.subscriptions.holding_plan(user_id, plan, None):
                return plan
    raise AssertionError(f"{user_id} holds every plan of {plans}")


def assert_books_hold_at_every_moment(container) -> None:
    """What holds after every step, whatever is in flight: one purchase per payment, credits equal the
    ledger, no payment reversed beyond what it credited (the stateful tests' invariant)."""
    from sqlalchemy import func, select

    from billingctl.adapters.db.purchases import REVERSALS
    from billingctl.adapters.db.tables import credit_ledger, purchase, users

    with container.uow() as uow:
        dupes = uow.execute(select(purchase.c.transaction_id).group_by(purchase.c.transaction_id)
                            .having(func.count() > 1)).all()
        balances = dict(uow.execute(select(users.c.id, users.c.credits)).all())
        sums = dict(uow.execute(select(credit_ledger.c.user_id, func.sum(credit_ledger.c.amount))
                                .group_by(credit_ledger.c.user_id)).all())
        over = uow.execute(select(purchase.c.transaction_id).join(
            credit_ledger, (credit_ledger.c.payment_id == purchase.c.transaction_id)
            & credit_ledger.c.reason.in_(REVERSALS)).group_by(purchase.c.transaction_id, purchase.c.credits)
            .having(-func.sum(credit_ledger.c.amount) > purchase.c.credits)).all()
    assert dupes == []
    assert all(int(balances[u]) == int(sums.get(u) or 0) for u in balances)
    assert over == []


def term_runs_out(sandbox, subscription_id: str, container=None) -> None:
    """Time passes at the provider until the subscription's term has ended, so its renewal falls due (and on
    `container`'s manual clock with it). Cutting the term end to the past instead would shorten a term a
    payment paid, and its renewal would overlap days already paid (decision 204)."""
    seconds = sandbox.subscription(subscription_id)["current_term_end"] - sandbox.now() + 1
    if container is not None and hasattr(container.clock, "set"):  # a manual clock moves with it
        from tests.conftest import advance_with_sandbox

        advance_with_sandbox(container, seconds)
    else:
        sandbox.store.advance_clock(seconds)
