"""The private listener: /internal/* operations (bearer token, checked app-wide), /metrics, /healthz.
Responses have the same shape as the matching `billingctl … --json` output."""

from __future__ import annotations

from flask import Blueprint, Flask, Response, current_app, jsonify, request

from billingctl.domain.errors import InvalidInput

bp = Blueprint("internal", __name__)


def container():
    return current_app.extensions["billing"]


def json_body() -> dict:
    data = request.get_json(silent=True)
    if not isinstance(data, dict):
        raise InvalidInput("a JSON object body is required")
    return data


@bp.get("/healthz")
def healthz():
    from billingctl.services.health import health_report

    report = health_report(container())
    return jsonify(report), (200 if report["ok"] else 503)


@bp.get("/metrics")
def metrics():
    import os

    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    else:
        registry = container().metrics.registry
    return Response(generate_latest(registry), mimetype=CONTENT_TYPE_LATEST)


@bp.get("/internal/health/circuit-breaker")
def circuit_breaker():
    from billingctl.services.health import breaker_status

    return jsonify(breaker_status(container()))


@bp.post("/internal/notifications/alert")
def notifications_alert():
    from billingctl.services.alerts import send_alert

    body = json_body()
    message, user_id = body.get("message"), body.get("user_id")
    if not isinstance(message, str) or (user_id is not None and not isinstance(user_id, str)):
        raise InvalidInput("message must be a string and user_id, when given, a string")
    result = send_alert(container(), message, user_id=user_id, dedupe_key=request.headers.get("Idempotency-Key"))
    return jsonify(result), 202


@bp.post("/internal/billing/activate")
def billing_activate():
    from billingctl.services.payments import activate_subscription

    subscription_id = json_body().get("subscription_id")
    if not isinstance(subscription_id, str) or not subscription_id:
        raise InvalidInput("subscription_id is required")
    return jsonify(activate_subscription(container(), subscription_id))


def register(app: Flask) -> None:
    app.register_blueprint(bp)
