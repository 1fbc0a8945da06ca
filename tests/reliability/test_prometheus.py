"""A real Prometheus (Debian's package, on loopback, bounded) scrapes the internal app running under
gunicorn with multiprocess metrics, with the project's rules loaded. Jobs and commands run as their own
processes, as cron and systemd run them. Planted conditions fire their alerts on the first occurrence,
and a condition that ends clears its alert (issue "Observability")."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import insert, update

from billingctl.adapters.db.tables import users
from billingctl.services.checkout import create_checkout
from tests.helpers import billingctl
from tests.servers import free_port, stop_process

pytestmark = pytest.mark.reliability
ROOT = Path(__file__).resolve().parents[2]
SPEC_METRICS = ("payment_recording_latency_seconds_bucket", "events_polled_total",
                "billing_provider_rate_limit_errors_total", "billing_processor_lock_outcome_total",
                "billing_circuit_breaker_state", "billing_reconcile_violations", "billing_job_runs_total",
                "billing_job_last_success_timestamp_seconds", "billing_job_interval_seconds", "billing_outbox_pending")


def wait_for(predicate, timeout=45.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def stack(settings, container, tmp_path, redis_url):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus is not installed (make servers installs it)")
    gunicorn = shutil.which("gunicorn") or os.path.join(os.path.dirname(sys.executable), "gunicorn")
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    env = {"BILLING_DATABASE_URL": settings.database_url, "BILLING_SANDBOX_DB": settings.sandbox_db,
           "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "BILLING_REDIS_URL": redis_url}
    app_port, prom_port = free_port(), free_port()
    app_log = open(tmp_path / "gunicorn.log", "wb")  # noqa: SIM115 - a pipe nobody reads would block
    app = subprocess.Popen([gunicorn, "--bind", f"127.0.0.1:{app_port}", "--workers", "2", "--log-level", "warning",
                            "--no-control-socket", "webhooks_app.wsgi:internal()"],
                           env={"PATH": os.environ["PATH"], **env}, cwd=ROOT, stdout=subprocess.DEVNULL,
                           stderr=app_log)
    # The project's rules with every `for` cut to five seconds: what this test holds is the scrape and the
    # aggregation across processes; how long each alert waits is held by promtool (prometheus/alerts_test.yml).
    rules = tmp_path / "alerts.yml"
    rules.write_text(re.sub(r"(?m)^(\s+for:) \S+$", r"\1 5s", (ROOT / "prometheus" / "alerts.yml").read_text()))
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: ["{rules}"]
scrape_configs:
  - job_name: billing-internal
    static_configs: [{{targets: ["127.0.0.1:{app_port}"]}}]
""")
    prom_log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115
    prom = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}", "--storage.tsdb.retention.time=1h"],
                            stdout=subprocess.DEVNULL, stderr=prom_log)
    api = httpx.Client(base_url=f"http://127.0.0.1:{prom_port}", timeout=5)
    try:
        wait_for(lambda: _ok(api, "/-/ready"), what="prometheus ready")
        yield api, env, redis_url
    finally:
        for process in (prom, app):
            stop_process(process)
        api.close()


def _ok(api, path) -> bool:
    try:
        return api.get(path).status_code == 200
    except httpx.TransportError:
        return False


def query(api, expr) -> list[dict]:
    return api.get("/api/v1/query", params={"query": expr}).json()["data"]["result"]


def firing(api) -> dict[str, list[dict]]:
    alerts = api.get("/api/v1/alerts").json()["data"]["alerts"]
    out: dict[str, list[dict]] = {}
    for alert in alerts:
        if alert["state"] == "firing":
            out.setdefault(alert["labels"]["alertname"], []).append(alert["labels"])
    return out


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_real_prometheus_scrapes_and_the_alerts_fire_and_clear(stack, container):
    api, env, redis_url = stack
    # A healthy scrape with every spec metric, once a job has run in a process of its own.
    assert billingctl(["jobs", "run", "velocity-watch"], env).returncode == 0
    wait_for(lambda: [r for r in query(api, 'up{job="billing-internal"}') if r["value"][1] == "1"], what="up == 1")
    # A reconcile violation fires ReconcileViolations; fixed and re-run, the alert clears.
    with container.uow() as uow:
        uow.execute(insert(users).values(id="user_drift", created_at=container.clock.now(), credits=9))
        uow.commit()
    assert billingctl(["reconcile"], env).returncode == 5
    wait_for(lambda: "ReconcileViolations" in firing(api), what="ReconcileViolations firing")
    with container.uow() as uow:
        uow.execute(update(users).where(users.c.id == "user_drift").values(credits=0))
        uow.commit()
    assert billingctl(["reconcile"], env).returncode == 0
    wait_for(lambda: "ReconcileViolations" not in firing(api), what="ReconcileViolations cleared")

    def names():
        return {r["metric"]["__name__"] for r in query(api, '{__name__=~"billing_.*|events_.*|payment_recording_.*"}')}

    try:
        wait_for(lambda: set(SPEC_METRICS) <= names(), what="spec metrics")
    except AssertionError:
        raise AssertionError(f"missing: {sorted(set(SPEC_METRICS) - names())}") from None

    # The first settle on an unknown processor (a counter born at 1 in a process that then exited).
    co = create_checkout(container, "user_u", "credits-pro-USD-monthly")
    payment = container.sandbox.pay(co["order_id"], processor="ACME_PAY", drop_webhook=True)
    assert billingctl(["payments", "record", payment["id"]], env).returncode == 0
    alert = wait_for(lambda: firing(api).get("ProcessorLockUnknownProcessor"),
                     what="ProcessorLockUnknownProcessor firing")
    assert [a["lane"] for a in alert] == ["sfw"]

    # The first repair that finds the orchestrator failing.
    container.sandbox.store.add_fault("orchestrator", "500", path="/payments", count=-1)
    billingctl(["lock", "repair", "user_r", "--lane", "nsfw"], env)
    container.sandbox.store.clear_faults()
    wait_for(lambda: firing(api).get("ProcessorRepairUnavailable"), what="ProcessorRepairUnavailable firing")

    # A poller whose newest run is ten minutes old (read from the database at scrape, any host's run).
    from datetime import timedelta

    from billingctl.adapters.db.tables import event_poller_state

    with container.uow() as uow:
        uow.execute(event_poller_state.delete())
        uow.execute(insert(event_poller_state).values(created_at=container.clock.now() - timedelta(minutes=10)))
        uow.commit()
    wait_for(lambda: "EventPollerStale" in firing(api), what="EventPollerStale firing")
    with container.uow() as uow:
        uow.execute(insert(event_poller_state).values(created_at=container.clock.now()))
        uow.commit()
    wait_for(lambda: "EventPollerStale" not in firing(api), what="EventPollerStale cleared")

    # A breaker opened by any process (its state shared through Redis) shows at once, and so does its
    # closing: the gauge is read at scrape time, never a max over processes that exited.
    import redis

    shared = redis.Redis.from_url(redis_url)
    breaker = 'billing_circuit_breaker_state{dependency="subscription_provider"}'
    shared.set("billing:breaker:subscription_provider:opened_at", repr(time.time()))
    wait_for(lambda: [r for r in query(api, breaker) if r["value"][1] == "2"], what="breaker open (2)")
    shared.delete("billing:breaker:subscription_provider:opened_at")
    wait_for(lambda: [r for r in query(api, breaker) if r["value"][1] == "0"], what="breaker closed (0)")

    # Issue 38 item 2: an orphan recovery gave up on pages (whatever happened to its chat alert) and clears
    # once a person resolves it; parked events and undelivered chat messages are scraped for their alerts
    # (whose `for` is held by promtool's tests).
    from billingctl.adapters.db.tables import alert_outbox, event_inbox, orphan_recovery

    now = container.clock.now()
    with container.uow() as uow:
        uow.execute(insert(orphan_recovery).values(payment_id="pay_gave_up", user_id="user_o", status="exhausted",
                                                   attempts=10, created_at=now, updated_at=now))
        uow.execute(insert(event_inbox).values(source="provider", event_id="ev_parked", event_type="x", payload={},
                                               status="parked", attempts=5, received_at=now))
        uow.execute(insert(alert_outbox).values(sink="chat", dedupe_key="k_stuck", payload={"text": "x"},
                                                status="pending", created_at=now - timedelta(hours=1)))
        uow.commit()
    alert = wait_for(lambda: firing(api).get("OrphanRecoveryExhausted"), what="OrphanRecoveryExhausted firing")
    assert alert[0]["severity"] == "page"
    wait_for(lambda: [r for r in query(api, 'billing_inbox_events{state="parked"}') if r["value"][1] == "1"],
             what="parked events scraped")
    wait_for(lambda: [r for r in query(api, 'billing_outbox_oldest_pending_age_seconds{sink="chat"} > 900')],
             what="the chat backlog's age scraped")
    with container.uow() as uow:
        uow.execute(update(orphan_recovery).where(orphan_recovery.c.payment_id == "pay_gave_up")
                    .values(status="resolved", resolution="refunded"))
        uow.commit()
    wait_for(lambda: "OrphanRecoveryExhausted" not in firing(api), what="OrphanRecoveryExhausted cleared")
    # Every scheduled job has its last-success series, including those that never ran (JobNotRunning).
    from jobs.schedule import JOBS

    wait_for(lambda: len(query(api, "billing_job_last_success_timestamp_seconds")) == len(JOBS),
             what="a last-success series for every job")

    assert "MetricsScrapeFailing" not in firing(api)
    assert "CircuitBreakerOpen" not in firing(api)  # a process that saw failures and exited latches nothing
