"""The two app factories: the internal token gate, the public surface, the error registry."""

import re

import pytest

from webhooks_app import create_internal_app, create_public_app

pytestmark = pytest.mark.e2e

TOKEN = "test-internal-token"


@pytest.fixture
def internal(container):
    return create_internal_app(container=container).test_client()


@pytest.fixture
def public(container):
    return create_public_app(container=container).test_client()


@pytest.mark.parametrize("path", ["/internal/health/circuit-breaker", "/internal/anything"])
@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic dGVzdA==", f"Token {TOKEN}", "Bearer "])
def test_internal_routes_refuse_without_the_token(internal, path, header):
    headers = {"Authorization": header} if header else {}
    response = internal.get(path, headers=headers)
    assert response.status_code == 401
    assert response.get_json()["error"] == "unauthorized"


def test_internal_routes_fail_closed_when_no_token_is_configured(make_settings, db_url):
    app = create_internal_app(make_settings(database_url=db_url, internal_token=None))
    response = app.test_client().get("/internal/anything", headers={"Authorization": "Bearer "})
    assert response.status_code == 401
    assert "BILLING_INTERNAL_TOKEN" in response.get_json()["message"]


def test_internal_token_admits(internal):
    # Authenticated: the gate lets the request through to routing (no such route -> 404 JSON).
    response = internal.get("/internal/anything", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 404
    assert response.get_json()["error"] == "not_found"


def test_healthz_and_metrics_on_the_private_listener(internal):
    health = internal.get("/healthz")
    assert health.status_code == 200
    assert {c["name"] for c in health.get_json()["checks"]} >= {"database", "migrations", "redis"}
    metrics = internal.get("/metrics")
    assert metrics.status_code == 200
    assert b"billing_provider_rate_limit_errors_total" in metrics.data
    # Issue "Observability" 1: one charset parameter; Prometheus 3 refuses a duplicated one.
    from prometheus_client import CONTENT_TYPE_LATEST

    assert metrics.headers["Content-Type"] == CONTENT_TYPE_LATEST
    assert metrics.headers["Content-Type"].count("charset") == 1


@pytest.mark.parametrize("path", ["/internal/anything", "/internal/health/circuit-breaker", "/metrics",
                                  "/healthz", "/debug/pprof/"])
def test_public_app_routes_nothing_internal(public, path):
    response = public.get(path)
    assert response.status_code == 404
    assert response.is_json


def test_unexpected_errors_are_a_generic_json_500(container):
    app = create_public_app(container=container)

    @app.get("/boom")
    def boom():
        raise RuntimeError("secret internals: password=hunter2")

    response = app.test_client().get("/boom")
    assert response.status_code == 500
    assert response.get_json() == {"error": "internal_error", "message": "internal error"}
    assert b"hunter2" not in response.data


def test_domain_errors_map_through_the_registry(container):
    from billingctl.domain.errors import PaymentNotRecorded

    app = create_public_app(container=container)

    @app.get("/refuse")
    def refuse():
        raise PaymentNotRecorded()

    response = app.test_client().get("/refuse")
    assert response.status_code == 409
    assert response.get_json()["error"] == "payment_not_recorded"


def test_apps_refuse_to_start_on_a_missing_production_secret(monkeypatch):
    from billingctl.domain.errors import ConfigError

    monkeypatch.setenv("BILLING_ENV", "production")
    with pytest.raises(ConfigError, match="BILLING_"):
        create_public_app()
    with pytest.raises(ConfigError, match="BILLING_"):
        create_internal_app()


def _series(response) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {f"{s.name}{sorted(s.labels.items())}": s.value
            for family in text_string_to_metric_families(response.data.decode()) for s in family.samples}


def test_every_scheduled_job_has_a_success_series_from_the_first_scrape(internal, container):
    """Issue 38 item 1: a job that never succeeded (or whose timer was never enabled) had no last-success
    series, so JobNotRunning could not fire for it. Every job of the table now has one: its newest success,
    or when this deployment began watching it; a failed run is a series of its own."""
    from jobs.runner import release
    from jobs.schedule import BY_NAME, JOBS

    series = _series(internal.get("/metrics"))
    for job in JOBS:
        assert f"billing_job_last_success_timestamp_seconds[('job_name', '{job.name}')]" in series
        assert series[f"billing_job_interval_seconds[('job_name', '{job.name}')]"] == job.interval_seconds
    with container.uow() as uow:
        uow.leases.create("activations", "host:1", container.clock.now(), container.clock.now())
        uow.commit()
    release(container, BY_NAME["activations"], "host:1", "ExternalUnavailable: provider down")
    series = _series(internal.get("/metrics"))
    failed = series["billing_job_last_failure_timestamp_seconds[('job_name', 'activations')]"]
    assert failed > series["billing_job_last_success_timestamp_seconds[('job_name', 'activations')]"] - 1
    assert series["billing_dependency_up[('dependency', 'database')]"] == 1


def test_metrics_with_the_database_down_serve_what_can_still_be_read(make_settings):
    """Issue 38 item 3: with the database down, /metrics answered 503 and every series vanished, the
    breakers' state included, and the only page blamed scraping. It now answers 200 with what it can read,
    and billing_dependency_up says the database is down; nothing read from it is made up."""
    settings = make_settings(database_url="postgresql+psycopg://postgres@127.0.0.1:9/nowhere")
    response = create_internal_app(settings).test_client().get("/metrics")
    assert response.status_code == 200
    series = _series(response)
    assert series["billing_dependency_up[('dependency', 'database')]"] == 0
    assert any(name.startswith("billing_circuit_breaker_state[") for name in series)
    assert not any(name.startswith(("billing_job_", "billing_inbox_", "billing_reconcile_")) for name in series)


def test_the_inbox_the_outbox_and_the_review_queue_are_series(internal, container):
    """Issue 38 item 2: what EventsParked, ChatAlertsUndelivered and OrphanRecoveryExhausted read."""
    from sqlalchemy import insert

    from billingctl.adapters.db.tables import alert_outbox, event_inbox, orphan_recovery

    now = container.clock.now()
    with container.uow() as uow:
        uow.execute(insert(event_inbox).values(source="provider", event_id="ev_parked", event_type="x",
                                               payload={}, status="parked", attempts=5, received_at=now))
        uow.execute(insert(alert_outbox).values(sink="chat", dedupe_key="k1", payload={"text": "x"},
                                                created_at=now, status="pending"))
        uow.execute(insert(orphan_recovery).values(payment_id="pay_x", status="exhausted", attempts=10,
                                                   created_at=now, updated_at=now))
        uow.commit()
    series = _series(internal.get("/metrics"))
    assert series["billing_inbox_events[('state', 'parked')]"] == 1
    assert series["billing_outbox_pending[('sink', 'chat')]"] == 1
    assert "billing_outbox_oldest_pending_age_seconds[('sink', 'chat')]" in series
    assert series["billing_orphans[('status', 'exhausted')]"] == 1


@pytest.mark.parametrize(("level", "expected"), [("ERROR", "40"), ("debug", "10"), (None, "20")])
def test_the_web_apps_honour_billing_log_level(level, expected):
    """Issue 39 item 3: only the CLI read BILLING_LOG_LEVEL; the web apps logged at INFO whatever it said
    (a benchmark that set it measured INFO logging). A level no one knows stops the worker with one line."""
    import os
    import subprocess
    import sys

    code = ("import logging; from webhooks_app.wsgi import _build; _build(lambda: None); "
            "print(logging.getLogger().level)")
    env = {"PATH": os.environ["PATH"], **({"BILLING_LOG_LEVEL": level} if level else {})}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == expected, result.stderr
    bad = subprocess.run([sys.executable, "-c", code], env={**env, "BILLING_LOG_LEVEL": "LOUD"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "error: BILLING_LOG_LEVEL: 'LOUD' is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL")


def test_metrics_before_any_process_wrote_its_directory(container, tmp_path, monkeypatch):
    """Found by the runbook tests (issue 38 item 8): a metrics directory that does not exist yet (no
    process has written, or the runtime directory was cleaned) made /metrics a 500 (`archive.lock` could
    not be opened), which silences every alert. It is an empty directory: the live series are served."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "not-yet"))
    response = create_internal_app(container=container).test_client().get("/metrics")
    assert response.status_code == 200
    assert _series(response)["billing_dependency_up[('dependency', 'database')]"] == 1


def test_metrics_with_redis_down_say_so_and_invent_no_breaker_state(make_settings, db_url):
    """Found by the runbook tests (issue 38 item 8): with Redis stopped, billing_dependency_up{redis} read 1,
    because the breakers fall back to the scraping process's own state when Redis fails, and that stand-in
    was served as the breakers' state. Redis is now asked directly; its series are left out while it is down."""
    from billingctl.bootstrap import Container
    from tests.servers import RedisServer

    redis = RedisServer()
    container = Container(make_settings(database_url=db_url, redis_url=redis.start()))
    try:
        internal = create_internal_app(container=container).test_client()
        assert _series(internal.get("/metrics"))["billing_dependency_up[('dependency', 'redis')]"] == 1
        redis.stop()
        series = _series(internal.get("/metrics"))
        assert series["billing_dependency_up[('dependency', 'redis')]"] == 0
        assert not [name for name in series if name.startswith("billing_circuit_breaker_state")]
        assert series["billing_dependency_up[('dependency', 'database')]"] == 1
    finally:
        container.close()
        redis.stop()


def test_the_apps_decide_once_per_function_whether_it_runs_synchronously(container):
    """BillingFlask keeps Flask's `ensure_sync` answer per function (issue 39 item 4: `inspect` ran twice
    on every request): a plain view is served as it is, and an `async def` one gets exactly what Flask
    gives it (here, without Flask's async extra, the same refusal)."""
    from flask import Flask

    app = create_public_app(container=container)

    def plain():
        return "ok"

    async def coroutine():
        return "ok"

    assert app.ensure_sync(plain) is plain and app.ensure_sync(plain) is plain
    try:
        expected = Flask("reference").ensure_sync(coroutine)
    except RuntimeError as refused:
        with pytest.raises(RuntimeError, match=re.escape(str(refused))):
            app.ensure_sync(coroutine)
    else:
        assert type(app.ensure_sync(coroutine)) is type(expected)


def test_the_vendor_models_are_built_when_a_web_app_starts_and_not_on_import(tmp_path):
    """Issue 39 item 5: the pydantic payload models are built on first use (an idle job reads no vendor
    object and builds none), so the web apps build them all at start: no request pays for it."""
    import os
    import subprocess
    import sys

    code = ("import sys; from billingctl.adapters import payloads as p\n"
            "def unbuilt():\n"
            "    found, pending = [], [p.Open]\n"
            "    while pending:\n"
            "        m = pending.pop(); pending.extend(m.__subclasses__())\n"
            "        found += [] if m.__pydantic_complete__ else [m.__name__]\n"
            "    return found\n"
            "print(len(unbuilt()))\n"
            "from webhooks_app import create_public_app; create_public_app()\n"
            "print(unbuilt())\n")
    env = {"PATH": os.environ["PATH"], "BILLING_DATABASE_URL": f"sqlite:///{tmp_path / 'b.db'}",
           "BILLING_SANDBOX_DB": str(tmp_path / "s.db")}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    on_import, after_start = result.stdout.split("\n")[:2]
    assert int(on_import) > 20, result.stderr[-500:]
    assert after_start == "[]"
