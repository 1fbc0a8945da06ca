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

    report = health_report(container(), scope="app")
    return jsonify(report), (200 if report["ok"] else 503)


@bp.get("/metrics")
def metrics():
    import os

    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    from billingctl.adapters.metrics import LiveState, WithoutLive
    from billingctl.services.observed import observed_state

    c = container()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from billingctl.adapters.metrics import FoldedDirectory

        source = FoldedDirectory(os.environ["PROMETHEUS_MULTIPROC_DIR"])  # every process's files
    else:
        source = c.metrics.registry  # this process only (tests, a single-process deployment)
    registry = CollectorRegistry()
    registry.register(WithoutLive(source))
    registry.register(LiveState(lambda: observed_state(c)))
    # content_type, not mimetype: Flask would append a second charset to the one the constant carries.
    return Response(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)


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


def _since(body: dict):
    from billingctl.domain.clock import parse_time

    value = body.get("since")
    if value in (None, ""):
        return None
    try:
        return parse_time(value)
    except (TypeError, ValueError):
        raise InvalidInput("since must be an ISO 8601 timestamp") from None


@bp.post("/internal/billing/poll")
def billing_poll():
    from billingctl.services.events import poll

    body = request.get_json(silent=True) or {}
    if not isinstance(body, dict) or not isinstance(body.get("all_invoices", False), bool):
        raise InvalidInput("all_invoices must be a boolean")
    return jsonify(poll(container(), all_invoices=body.get("all_invoices", False), since=_since(body)))


@bp.post("/internal/billing/sync")
def billing_sync():
    from billingctl.services.sync import sync_subscription

    subscription_id = json_body().get("subscription_id")
    if not isinstance(subscription_id, str) or not subscription_id:
        raise InvalidInput("subscription_id is required")
    return jsonify(sync_subscription(container(), subscription_id))


@bp.post("/internal/billing/sync-all")
def billing_sync_all():
    from billingctl.services.sync import sync_all

    body = json_body()
    since = _since(body)
    if since is None:
        raise InvalidInput("since (ISO 8601) is required")
    return jsonify(sync_all(container(), since))


@bp.post("/internal/cache/invalidate")
def cache_invalidate():
    from billingctl.services.subscriptions import invalidate_customer

    customer_id = json_body().get("customer_id")
    if not isinstance(customer_id, str) or not customer_id:
        raise InvalidInput("customer_id is required")
    return jsonify(invalidate_customer(container(), customer_id))


@bp.post("/internal/users/<user_id>/freeze")
def users_freeze(user_id):
    from billingctl.services.users import freeze

    body = request.get_json(silent=True) or {}
    if not isinstance(body, dict):
        raise InvalidInput("the body, when given, must be a JSON object")
    reason = body.get("reason") or "frozen through the internal API"
    # The fraud flow: freezing goes with voiding pending invoices and notifying the user.
    result = freeze(container(), user_id, str(reason), request.headers.get("X-Actor", "internal-api"),
                    void_invoices=body.get("void_invoices", True) is not False,
                    notify=body.get("notify", True) is not False)
    return jsonify(result)


def register(app: Flask) -> None:
    app.register_blueprint(bp)
