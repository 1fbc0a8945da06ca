"""The one table from errors to HTTP status codes, and the JSON error body `{"error", "message"}`.

Anything unexpected becomes a generic 500 without internals; the details go to the log only.
"""

from __future__ import annotations

import logging
import math

from flask import Flask, current_app, jsonify, request
from sqlalchemy import exc as sa_exc
from werkzeug.exceptions import HTTPException

from billingctl.domain import errors as e

log = logging.getLogger("webhooks_app")
DATABASE_RETRY_AFTER = 5  # seconds
# A webhook view that has authenticated and checked its event names it here, (source, event_type, payload,
# event_id), so that a database outage meeting it keeps it on disk instead of losing it (decision 208).
SPOOL_KEY = "billing.spool"


def _spooled() -> dict | None:
    """Keep the current request's authenticated event in the spool; None when it names none, the spool is
    off, or the disk refuses it (then the sender is answered 503 and retries, as before)."""
    event = request.environ.get(SPOOL_KEY)
    container = current_app.extensions.get("billing")
    if event is None or container is None or not container.settings.webhook_spool_dir:
        return None
    from billingctl.services.spool import spool
    from billingctl.services.webhook_events import event_id_for

    source, event_type, payload, event_id = event
    try:  # the payment receiver types its payload after the duplicate read: only a typed event is kept
        event_id = event_id_for(source, event_type, payload, event_id)
    except Exception:  # noqa: BLE001 - a body the normal path answers 400 once the database is back
        return None
    try:
        name = spool(container.settings.webhook_spool_dir, source, event_type, payload, event_id)
    except OSError as exc:
        log.error("webhook not spooled: %s", type(exc).__name__)
        return None
    container.metrics.webhooks_spooled.labels(source=event[0]).inc()
    return {"outcome": "spooled", "event_type": event[1], "file": name}

# Subclasses before bases.
STATUS: tuple[tuple[type[Exception], int], ...] = (
    (e.PaymentNotRecorded, 409),
    (e.QuotaExhausted, 429),
    (e.TooManyRequests, 429),
    (e.AccountFrozen, 403),
    (e.InvalidInput, 400),
    (e.AuthenticationFailed, 401),
    (e.NotFound, 404),
    (e.Refused, 409),
    (e.CircuitOpen, 503),
    (e.ProcessorLockUnavailable, 503),
    (e.RateLimited, 429),  # spec 7: the provider's budget is spent; the client retries after Retry-After
    (e.ExternalError, 502),
    (e.LeaseHeld, 409),
    (e.BatchFailed, 500),
    (e.ConfigError, 500),
)


def status_for(exc: Exception) -> int:
    for cls, status in STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def error_response(status: int, code: str, message: str):
    response = jsonify({"error": code, "message": message})
    response.status_code = status
    return response


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(e.BillingError)
    def _billing_error(exc: e.BillingError):
        status = status_for(exc)
        if status >= 500:
            log.error("request failed: %s", exc.message, extra={"error_code": exc.code})
        response = error_response(status, exc.code, exc.message)
        if status == 429:
            after = exc.details.get("retry_after") or getattr(exc, "retry_after", None) or 1
            response.headers["Retry-After"] = str(max(1, math.ceil(float(after))))
        return response

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        code = (exc.name or "error").lower().replace(" ", "_")
        return error_response(exc.code or 500, code, exc.description or exc.name)

    @app.errorhandler(RecursionError)
    def _too_deep(exc: RecursionError):
        # json.loads recurses per nesting level: a body of 50,000 '[' is bad input, not a server error.
        return error_response(400, "invalid_input", "invalid JSON body: nested too deeply")

    @app.errorhandler(sa_exc.OperationalError)
    @app.errorhandler(sa_exc.InterfaceError)
    @app.errorhandler(sa_exc.TimeoutError)
    def _database_unavailable(exc: Exception):
        # One line, no traceback per request; the client (a webhook sender, the front end) retries.
        cause = type(getattr(exc, "orig", None) or exc).__name__
        if (spooled := _spooled()) is not None:  # a 2xx: the sender does not retry; the poll dispatches it
            log.error("database unavailable: %s; webhook spooled", cause,
                      extra={"event_type": spooled["event_type"], "file": spooled.pop("file")})
            return jsonify(spooled), 202
        log.error("database unavailable: %s", cause)
        response = error_response(503, "database_unavailable", "temporarily unavailable; retry shortly")
        response.headers["Retry-After"] = str(DATABASE_RETRY_AFTER)
        return response

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unhandled error in request")
        return error_response(500, "internal_error", "internal error")
