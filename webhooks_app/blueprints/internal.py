"""The private listener: /internal/* operations (bearer token), /metrics and /healthz."""

from __future__ import annotations

from flask import Blueprint, Flask, Response, current_app, jsonify

bp = Blueprint("internal", __name__)


def container():
    return current_app.extensions["billing"]


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


def register(app: Flask) -> None:
    app.register_blueprint(bp)
