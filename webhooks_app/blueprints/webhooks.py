"""Webhook receivers on the public host. Each verifies before it reads the body, answers 401 to any
authentication failure and 400 to a malformed body after authentication, answers quickly, and does
nothing the second time an event arrives (the event inbox)."""

from __future__ import annotations

import json
import logging

from flask import Blueprint, current_app, jsonify, request

from billingctl.domain.errors import BillingError, InvalidInput
from webhooks_app.signatures import check_timestamp, secrets_of, verify_orchestrator

log = logging.getLogger("webhooks_app.webhooks")
bp = Blueprint("webhooks", __name__, url_prefix="/webhooks")


def container():
    return current_app.extensions["billing"]


def _json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError:
        raise InvalidInput("malformed JSON body") from None
    if not isinstance(body, dict):
        raise InvalidInput("the body must be a JSON object")
    return body


@bp.post("/orchestrator/payments")
def orchestrator_payments():
    c = container()
    raw = request.get_data(cache=False)
    verify_orchestrator(raw, request.headers.get("X-Signature-Primary"), request.headers.get("X-Signature-Secondary"),
                        secrets_of(c.settings.secret("orchestrator_webhook_secret")))
    body = _json(raw)  # signature verified: a malformed body is a 400
    # The timestamp is part of authentication: checked before anything in the body is used.
    check_timestamp(body.get("signedAt"), c.clock.now().timestamp())
    payment = body.get("payment")
    event_type = body.get("eventType")
    if not isinstance(payment, dict) or not payment.get("id") or not isinstance(event_type, str):
        raise InvalidInput("eventType and payment.id are required")
    result = handle_payment_event(c, event_type, payment)
    return jsonify(result), 200


def handle_payment_event(c, event_type: str, payment: dict) -> dict:
    from billingctl.services import inbox
    from billingctl.services.payments import record_payment, update_transaction_status

    refunded = (payment.get("processor") or {}).get("amountRefunded") or 0
    event_id = f"{event_type}:{payment['id']}:{payment.get('status')}" + (
        f":{refunded}" if event_type == "PAYMENT.REFUND" else "")
    with c.uow() as uow:
        status = inbox.accept(uow, c.clock, "orchestrator", event_id, event_type, {"payment": payment})
        uow.commit()
    if status != "pending":
        return {"event_id": event_id, "outcome": "duplicate"}
    error = None
    try:
        if event_type == "PAYMENT.STATUS" and payment.get("status") == "SETTLED":
            # One attempt per provider call here: the webhook answers quickly, the activations job finishes.
            with c.provider.http.attempts(1):
                result = record_payment(c, payment, "webhook")
        elif event_type == "PAYMENT.STATUS":
            result = update_transaction_status(c, payment)
        elif event_type == "PAYMENT.REFUND":
            from billingctl.services.payments import reverse_refund

            refunded = int((payment.get("processor") or {}).get("amountRefunded") or 0)
            result = reverse_refund(c, payment["id"], refunded, "webhook")
        else:
            result = {"outcome": "ignored"}
    except BillingError as exc:
        error, result = exc.message, {"outcome": "failed", "error": exc.message}
        log.warning("payment event failed; kept in the inbox: %s", exc.message, extra={"event_id": event_id})
    with c.uow() as uow:
        inbox.finish(uow, c.clock, "orchestrator", event_id, error)
        uow.commit()
    return {"event_id": event_id, **result}


@bp.post("/subscription-provider")
def subscription_provider():
    from billingctl.services.events import handle_event
    from webhooks_app.auth import constant_time_equal

    c = container()
    auth = request.authorization
    username, password = c.settings.secret("provider_webhook_username"), c.settings.secret("provider_webhook_password")
    given_user = auth.username if auth and auth.type == "basic" else None
    given_password = auth.password if auth and auth.type == "basic" else None
    # Both compared, always, in constant time; a missing configured value fails closed.
    user_ok = constant_time_equal(given_user, username)
    password_ok = constant_time_equal(given_password, password)
    if not (username and password and user_ok and password_ok):
        from billingctl.domain.errors import AuthenticationFailed

        raise AuthenticationFailed("invalid or missing basic authentication")
    body = _json(request.get_data(cache=False))
    event = body.get("event") if isinstance(body.get("event"), dict) else body
    if not event.get("id") or not isinstance(event.get("event_type"), str):
        raise InvalidInput("event id and event_type are required")
    status = handle_event(c, event)
    return jsonify({"event_id": event["id"], "status": status}), 200


def register(app) -> None:
    app.register_blueprint(bp)
