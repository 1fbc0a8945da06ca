"""Webhook receivers on the public host. Each verifies before it reads the body, answers 401 to any
authentication failure and 400 to a malformed body after authentication, answers quickly, and does
nothing the second time an event arrives (the event inbox)."""

from __future__ import annotations

import logging

from flask import Blueprint, current_app, jsonify, request

from billingctl.domain.errors import InvalidInput
from billingctl.services.inbox import duplicate_answer, finished_duplicate
from billingctl.services.payments import followups_after_response
from billingctl.services.webhook_events import dispatch, payment_event_id, plain_payment_event_id
from webhooks_app import schemas
from webhooks_app.errors import SPOOL_KEY
from webhooks_app.signatures import check_timestamp, matches_any, secrets_of, verify_orchestrator

log = logging.getLogger("webhooks_app.webhooks")
bp = Blueprint("webhooks", __name__, url_prefix="/webhooks")


def container():
    return current_app.extensions["billing"]


def _json(raw: bytes) -> dict:
    try:
        body = schemas.strict_json(raw)  # no NaN, Infinity or NUL: PostgreSQL refuses them (issue 37)
    except ValueError:
        raise InvalidInput("malformed JSON body") from None
    if not isinstance(body, dict):
        raise InvalidInput("the body must be a JSON object")
    return body


def _orchestrator_body(c, secret_name: str) -> dict:
    """The payment receiver: the signature (primary or secondary header) over the raw body, then the
    body, then `signedAt` within 5 minutes (part of authentication, checked before anything in the body
    is used), then the fields every event needs; the body as it came (typed by the caller)."""
    req = request._get_current_object()  # one look-up of the request, not one per use
    raw = req.get_data(cache=False)
    verify_orchestrator(raw, req.headers.get("X-Signature-Primary"), req.headers.get("X-Signature-Secondary"),
                        secrets_of(c.settings.secret(secret_name)))
    body = _json(raw)  # signature verified: a malformed body is a 400
    check_timestamp(body.get("signedAt"), c.clock.now().timestamp())
    payment, event_type = body.get("payment"), body.get("eventType")
    if not isinstance(payment, dict) or not payment.get("id") or not isinstance(event_type, str):
        raise InvalidInput("eventType and payment.id are required")
    req.environ[SPOOL_KEY] = ("orchestrator", event_type, {"payment": payment}, None)
    return body


@bp.post("/orchestrator/payments")
def orchestrator_payments():
    """No import inside: one costs a duplicate about 7,000 instructions (issue 39 item 4)."""
    c = container()
    body = _orchestrator_body(c, "orchestrator_webhook_secret")
    event_type, payment = body["eventType"], body["payment"]
    # A finished duplicate is answered from the inbox's one read before its body is typed: its key was
    # stored from a body that typed, and nothing else of this one is used (issue 39 item 4, decision 162).
    plain_id = plain_payment_event_id(event_type, payment)
    if plain_id is not None and finished_duplicate(c, "orchestrator", plain_id, "webhook") is not None:
        return jsonify(duplicate_answer(plain_id)), 200
    # The inbox key from the copy typed once; the handler reads the payment as it came.
    event_id = payment_event_id(event_type, schemas.PaymentEvent.read(body).payment)
    with followups_after_response(c) as deferred:
        response = jsonify(dispatch(c, "orchestrator", event_type, {"payment": payment}, event_id=event_id,
                                    duplicate_read=event_id != plain_id))
    if deferred.subscriptions:  # once the answer is sent (issue 39 item 3), inline or on the follow-up thread
        run = current_app.extensions["billing_followups"]
        response.call_on_close(lambda: run(deferred.run))
    return response, 200


@bp.post("/subscription-provider")
def subscription_provider():
    from billingctl.services.provider_events import handle_event
    from webhooks_app.auth import constant_time_equal

    c = container()
    auth = request.authorization
    username, password = c.settings.secret("provider_webhook_username"), c.settings.secret("provider_webhook_password")
    given_user = auth.username if auth and auth.type == "basic" else None
    given_password = auth.password if auth and auth.type == "basic" else None
    # Both compared, always, in constant time; a missing configured value fails closed. The password may
    # hold two comma-separated values while it is rotated, like every other webhook secret.
    user_ok = constant_time_equal(given_user, username)
    password_ok = matches_any(given_password, secrets_of(password))
    if not (username and password and user_ok and password_ok):
        from billingctl.domain.errors import AuthenticationFailed

        raise AuthenticationFailed("invalid or missing basic authentication")
    body = _json(request.get_data(cache=False))
    event = body.get("event") if isinstance(body.get("event"), dict) else body
    if not isinstance(event, dict) or not event.get("id") or not isinstance(event.get("event_type"), str):
        raise InvalidInput("event id and event_type are required")
    schemas.check(schemas.ProviderEvent, event)
    request.environ[SPOOL_KEY] = ("provider", event["event_type"], event, None)
    status = handle_event(c, event, via="webhook")
    return jsonify({"event_id": event["id"], "status": status}), 200


@bp.post("/orchestrator/disputes")
def orchestrator_disputes():
    """DISPUTE.* bodies are flat (eventType, processorId, processorDisputeId, paymentId, transactionId,
    orderId, primerAccountId) and carry no signedAt: the signature authenticates, and a replay is a
    no-op because the inbox is keyed on the dispute id. Other bodies (the dashboard's test webhook)
    are answered 200 and ignored."""
    from billingctl.services.webhook_events import dispatch

    c = container()
    raw = request.get_data(cache=False)
    verify_orchestrator(raw, request.headers.get("X-Signature-Primary"), request.headers.get("X-Signature-Secondary"),
                        secrets_of(c.settings.secret("orchestrator_disputes_secret")))
    body = _json(raw)
    if body.get("signedAt") is not None:
        check_timestamp(body.get("signedAt"), c.clock.now().timestamp())
    event_type = body.get("eventType")
    if not isinstance(event_type, str) or not event_type.startswith("DISPUTE."):
        return jsonify({"outcome": "ignored"}), 200
    if not all(isinstance(body.get(k), str) and body.get(k) for k in ("paymentId", "processorDisputeId")):
        raise InvalidInput("paymentId and processorDisputeId are required")
    schemas.check(schemas.DisputeEvent, body)
    request.environ[SPOOL_KEY] = ("orchestrator", event_type, body, None)
    return jsonify(dispatch(c, "orchestrator", event_type, body)), 200


@bp.post("/workflow-completion")
def workflow_completion():
    c = container()
    expected = secrets_of(c.settings.secret("workflow_callback_secret"))
    if not expected or not matches_any(request.headers.get("X-Webhook-Secret"), expected):
        from billingctl.domain.errors import AuthenticationFailed

        raise AuthenticationFailed("invalid or missing webhook secret")
    body = _json(request.get_data(cache=False))
    workflow_id, status = body.get("workflow_id"), body.get("status")
    if not isinstance(workflow_id, str) or not workflow_id or not isinstance(status, str):
        raise InvalidInput("workflow_id and status are required")
    schemas.check(schemas.WorkflowCallback, body)

    from billingctl.services.webhook_events import dispatch

    request.environ[SPOOL_KEY] = ("workflow", f"workflow.{status}", body, None)
    return jsonify(dispatch(c, "workflow", f"workflow.{status}", body)), 200


@bp.post("/identity-verification")
def identity_verification():
    from billingctl.services.webhook_events import dispatch
    from webhooks_app.signatures import verify_timestamped

    c = container()
    raw = request.get_data(cache=False)
    verify_timestamped(raw, request.headers.get("Verification-Signature"),
                       secrets_of(c.settings.secret("idv_webhook_secret")), c.clock.now().timestamp())
    body = _json(raw)
    event_id, user_id, outcome = body.get("id"), body.get("user_id"), body.get("status")
    if not all(isinstance(v, str) and v for v in (event_id, user_id, outcome)):
        raise InvalidInput("id, user_id and status are required")
    schemas.check(schemas.Verification, body)
    request.environ[SPOOL_KEY] = ("idv", f"verification.{outcome}", body, None)
    return jsonify(dispatch(c, "idv", f"verification.{outcome}", body)), 200


@bp.post("/identity")
def identity():
    from billingctl.services.webhook_events import dispatch
    from webhooks_app.signatures import verify_standard_webhook

    c = container()
    raw = request.get_data(cache=False)
    message_id = verify_standard_webhook(raw, request.headers, c.settings.secret("identity_webhook_secret"))
    body = _json(raw)
    event_type, data = body.get("type"), body.get("data")
    if not isinstance(event_type, str) or not isinstance(data, dict):
        raise InvalidInput("type and data are required")
    schemas.check(schemas.IdentityEvent, body)
    request.environ[SPOOL_KEY] = ("identity", event_type, body, message_id)
    return jsonify(dispatch(c, "identity", event_type, body, event_id=message_id)), 200


def register(app) -> None:
    app.register_blueprint(bp)
