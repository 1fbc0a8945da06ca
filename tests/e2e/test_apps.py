"""The two app factories: the internal token gate, the public surface, the error registry."""

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
