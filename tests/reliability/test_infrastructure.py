"""Infrastructure faults: Redis stopped in the middle of a run; PostgreSQL going away in the middle of
a job. Operations stay correct on the database's guarantees; failures are visible and recoverable."""

import logging
import os
import subprocess
import sys
import threading
import time

import pytest

from billingctl.bootstrap import Container
from billingctl.services import events
from billingctl.services.checkout import create_checkout
from billingctl.services.payments import record_payment
from tests.conftest import create_database
from tests.integration.conftest import World
from tests.servers import PostgresServer, RedisServer

pytestmark = pytest.mark.reliability


def test_redis_stopped_mid_run(make_settings, db_url, caplog):
    redis = RedisServer()
    url = redis.start()
    try:
        c = Container(make_settings(database_url=db_url, redis_url=url))
        world = World(c)
        first = world.sandbox.pay(create_checkout(c, "user_r", "credits-basic-USD-monthly")["order_id"])
        assert world.purchases(first["id"]) == 1
        later = [create_checkout(c, user, "credits-pro-USD-monthly") for user in ("user_r", "user_s")]
    finally:
        redis.stop()  # Redis goes away in the middle of the run
    with caplog.at_level(logging.WARNING):
        payments = [world.sandbox.pay(co["order_id"], duplicates=2) for co in later]
        for p in payments:
            assert record_payment(c, p, "settled_poller")["outcome"] == "duplicate"
        events.poll(c)
    assert world.purchases() == 3 and world.credits("user_r") == 1000 + 2000 and world.credits("user_s") == 2000
    assert sum(c.metrics.sample("billing_redis_errors_total", {"component": k})
               for k in ("lock", "cache", "limiter", "breaker")) > 0
    assert any("redis" in r.getMessage() or "rate limiter" in r.getMessage() or "cache" in r.getMessage()
               for r in caplog.records)
    c.close()


def test_postgres_going_away_mid_job(make_settings, tmp_path):
    server = PostgresServer()
    server.start()
    try:
        url = create_database(f"postgresql+psycopg://postgres@127.0.0.1:{server.port}/postgres", "billing_outage")
        settings = make_settings(database_url=url, clock="sandbox")  # a month passes for both clocks
        from billingctl.adapters.db.engine import make_engine
        from billingctl.adapters.db.migrate import upgrade

        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        c = Container(settings)
        world = World(c)
        # Renewals the orchestrator charged and reported to the provider while their webhooks were lost.
        paid = [world.renewal_charged_unseen(f"user_{i}")[2] for i in range(3)]
        c.close()
        # The job reads a slow page of events; the database stops while it waits.
        world.sandbox.store.add_fault("provider", "slow", path="/events", count=1, delay=3)
        env = {"PATH": os.environ["PATH"], "BILLING_DATABASE_URL": url, "BILLING_SANDBOX_DB": settings.sandbox_db,
               "BILLING_CLOCK": "sandbox"}
        job = subprocess.Popen([sys.executable, "-m", "billingctl", "jobs", "run", "poll"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        threading.Timer(1.0, server.halt).start()
        out, err = job.communicate(timeout=120)
        assert job.returncode == 4, (out, err)
        assert err.strip().splitlines()[-1].startswith("error: database unavailable")
        assert "Traceback" not in err
        server.launch()  # the database is back
        time.sleep(0.5)
        again = subprocess.run([sys.executable, "-m", "billingctl", "jobs", "run", "poll"], env=env,
                               capture_output=True, text=True, timeout=120)
        assert again.returncode == 0, again.stderr
        c = Container(settings)
        world = World(c)
        for payment in paid:
            assert world.purchases(payment["id"]) == 1
        assert sum(world.credits(f"user_{i}") for i in range(3)) == 3 * (2000 + 2000)
        c.close()
    finally:
        server.stop()


def test_a_restarted_postgres_costs_no_request(make_settings):
    """Issue "Performance at production shape" item 3: the pool no longer pings before every
    transaction. A connection the restart killed fails on its first statement, which the unit of work
    retries once on a fresh connection: the web worker that outlived the restart answers every request."""
    import json as _json

    from billingctl.sandbox.model import sign_body
    from webhooks_app import create_public_app

    server = PostgresServer()
    server.start()
    try:
        url = create_database(f"postgresql+psycopg://postgres@127.0.0.1:{server.port}/postgres", "billing_restart")
        from billingctl.adapters.db.engine import make_engine
        from billingctl.adapters.db.migrate import upgrade

        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        c = Container(make_settings(database_url=url))
        client = create_public_app(container=c).test_client()

        def post(payment):
            body = _json.dumps({"eventType": "PAYMENT.STATUS", "signedAt": str(int(time.time())), "payment": payment})
            return client.post("/webhooks/orchestrator/payments", data=body, content_type="application/json",
                               headers={"X-Signature-Primary": sign_body(
                                   c.settings.secret("orchestrator_webhook_secret"), body.encode())})

        first = c.sandbox.pay(create_checkout(c, "user_pg", "credits-basic-USD-monthly")["order_id"],
                              drop_webhook=True)
        assert post(first).status_code == 200
        second = c.sandbox.pay(create_checkout(c, "user_pg", "credits-pro-USD-monthly")["order_id"],
                               drop_webhook=True)
        from tests.servers import _pg_bin

        # A clean restart (this throwaway server runs with synchronous_commit=off, so an immediate stop
        # could lose the last commits): every pooled connection is dead afterwards.
        server._run([_pg_bin("pg_ctl"), "-D", str(server.data), "-m", "fast", "-w", "stop"])
        server.launch()
        assert post(first).get_json()["outcome"] == "duplicate"  # a read, on a fresh connection
        answer = post(second)
        assert answer.status_code == 200 and answer.get_json()["outcome"] == "recorded", answer.get_json()
        world = World(c)
        assert world.purchases() == 2 and world.credits("user_pg") == 1000 + 2000
        c.close()
    finally:
        server.stop()
