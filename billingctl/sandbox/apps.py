"""Flask apps speaking the wire contracts of DESIGN section 3, over one Sandbox model, with fault
injection: 429 with Retry-After, 5xx, timeouts, connection resets, malformed JSON, slow answers,
401, and a call that errors after taking effect."""

from __future__ import annotations

import time

from flask import Flask, Response, g, jsonify, request

from billingctl.sandbox.model import Sandbox, SandboxError

RATE_LIMIT_BODY = {"message": "Please try after some time", "type": "operation_failed",
                   "api_error_code": "api_request_limit_exceeded", "error_code": "api_request_limit_exceeded",
                   "http_status_code": 429}
BEFORE_KINDS = ("429", "500", "503", "timeout", "reset", "malformed", "slow", "401")


def _install_faults(app: Flask, sandbox: Sandbox, system: str) -> None:
    store = sandbox.store

    @app.before_request
    def _fault_before():
        store.log_request(system, request.method, request.path)
        fault = store.take_fault(system, request.method, request.path, BEFORE_KINDS)
        if fault is None:
            return None
        kind = fault["kind"]
        in_process = request.headers.get("X-Sandbox-In-Process") == "1"
        if kind == "429":
            response = jsonify(RATE_LIMIT_BODY)
            response.status_code = 429
            response.headers["Retry-After"] = str(fault["retry_after"] if fault["retry_after"] is not None else 1)
            return response
        if kind in ("500", "503"):
            return jsonify({"message": "internal error", "type": "api_error", "api_error_code": "internal_error"}), \
                int(kind)
        if kind == "401":
            return jsonify({"message": "Sorry, authentication failed. Invalid api key",
                            "type": "invalid_request", "api_error_code": "api_authentication_failed"}), 401
        if kind in ("timeout", "reset"):
            if not in_process:
                time.sleep(fault["delay"] or 0)
            response = Response(b"", status=504 if kind == "timeout" else 502)
            response.headers["X-Sandbox-Fault"] = kind
            return response
        if kind == "malformed":
            return Response(b'{"subscription": {"id": ', status=200, mimetype="application/json")
        if kind == "slow":
            time.sleep(fault["delay"] or 0.2)
        return None

    @app.after_request
    def _fault_after(response):
        if 200 <= response.status_code < 300 and request.method == "POST":
            fault = store.take_fault(system, request.method, request.path, ("error_after_effect",))
            if fault is not None:
                failed = jsonify({"message": "internal error", "type": "api_error", "api_error_code": "internal_error"})
                failed.status_code = 500
                return failed
        return response


def _install_errors(app: Flask) -> None:
    @app.errorhandler(SandboxError)
    def _sandbox_error(exc: SandboxError):
        return jsonify(exc.body), exc.status


def _idempotent(sandbox: Sandbox, header: str, fn):
    """Replay the first successful answer to a repeated idempotency key."""
    key = request.headers.get(header)
    if key:
        saved = sandbox.store.idempotent_result(f"{request.path}:{key}")
        if saved is not None:
            return jsonify(saved[1]), saved[0]
    body = fn()
    if key:
        sandbox.store.save_idempotent_result(f"{request.path}:{key}", 200, body)
    return jsonify(body)


def create_provider_app(sandbox: Sandbox) -> Flask:
    app = Flask("sandbox-provider")
    _install_faults(app, sandbox, "provider")
    _install_errors(app)
    prefix = "/api/v2"

    @app.before_request
    def _auth():
        header = request.headers.get("Authorization", "")
        revoked = sandbox.store.meta("revoked_provider_keys", [])
        key = header.removeprefix("Bearer ").strip()
        if not header.startswith("Bearer ") or not key or key in revoked:
            return jsonify({"message": "Sorry, authentication failed. Invalid api key",
                            "type": "invalid_request", "api_error_code": "api_authentication_failed"}), 401
        g.key = key
        return None

    def page(items: list[dict], wrapper: str | None):
        limit = min(int(request.args.get("limit", 100)), 100)
        offset = int(request.args.get("offset") or 0)
        chunk = items[offset: offset + limit]
        body = {"list": [{wrapper: item} if wrapper else item for item in chunk]}
        if offset + limit < len(items):
            body["next_offset"] = str(offset + limit)
        return jsonify(body)

    def after(name: str) -> int | None:
        value = request.args.get(f"{name}[after]")
        return int(value) if value not in (None, "") else None

    @app.get(f"{prefix}/subscriptions/<sub_id>")
    def get_subscription(sub_id):
        sub = sandbox.subscription(sub_id)
        return jsonify({"subscription": sub, "customer": sandbox.customer(sub["customer_id"], create=True)})

    @app.get(f"{prefix}/subscriptions")
    def list_subscriptions():
        since = after("updated_at")
        subs = [s for s in sandbox.store.all("subscription") if since is None or s["updated_at"] > since]
        subs.sort(key=lambda s: (s["updated_at"], s["id"]))
        customers = {}
        items = []
        for s in subs:
            customers.setdefault(s["customer_id"], sandbox.customer(s["customer_id"], create=True))
            items.append({"subscription": s, "customer": customers[s["customer_id"]]})
        return page(items, None)

    @app.post(f"{prefix}/customers/<customer_id>/subscription_for_items")
    def subscription_for_items(customer_id):
        item_price_id = request.form.get("subscription_items[item_price_id][0]")
        if not item_price_id:
            raise SandboxError(400, "subscription_items[item_price_id][0] is required", param="item_price_id")
        start = request.form.get("start_date")
        return _idempotent(sandbox, "Idempotency-Key", lambda: sandbox.create_subscription_for_items(
            customer_id, item_price_id, int(start) if start else None))

    @app.post(f"{prefix}/subscriptions/<sub_id>/change_term_end")
    def change_term_end(sub_id):
        term = request.form.get("term_ends_at")
        if not term:
            raise SandboxError(400, "term_ends_at is required", param="term_ends_at")
        return _idempotent(sandbox, "Idempotency-Key", lambda: sandbox.change_term_end(sub_id, int(term)))

    @app.post(f"{prefix}/subscriptions/<sub_id>/cancel_for_items")
    def cancel(sub_id):
        return _idempotent(sandbox, "Idempotency-Key", lambda: sandbox.cancel(sub_id))

    @app.get(f"{prefix}/events")
    def events():
        since = after("occurred_at")
        items = [ev for ev in sandbox.store.all("event") if since is None or ev["occurred_at"] > since]
        items.sort(key=lambda ev: ev["occurred_at"])
        return page(items, "event")

    @app.get(f"{prefix}/invoices/<invoice_id>")
    def get_invoice(invoice_id):
        return jsonify({"invoice": sandbox.invoice(invoice_id)})

    @app.get(f"{prefix}/invoices")
    def list_invoices():
        sandbox.renew_due()  # renewals materialize lazily, on the sandbox's clock
        status = request.args.get("status[is]")
        sub_id = request.args.get("subscription_id[is]")
        since = after("updated_at")
        items = [i for i in sandbox.store.all("invoice")
                 if (not status or i["status"] == status) and (not sub_id or i["subscription_id"] == sub_id)
                 and (since is None or i["updated_at"] > since)]
        return page(items, "invoice")

    @app.post(f"{prefix}/invoices/<invoice_id>/void")
    def void(invoice_id):
        return _idempotent(sandbox, "Idempotency-Key", lambda: sandbox.void_invoice(invoice_id))

    @app.post(f"{prefix}/invoices/<invoice_id>/record_payment")
    def record_payment(invoice_id):
        amount = request.form.get("transaction[amount]")
        reference = request.form.get("transaction[reference_number]")
        if not amount or not reference:
            raise SandboxError(400, "transaction[amount] and transaction[reference_number] are required")
        return _idempotent(sandbox, "Idempotency-Key",
                           lambda: sandbox.record_payment(invoice_id, int(amount), reference))

    @app.get(f"{prefix}/item_prices/<item_price_id>")
    def get_item_price(item_price_id):
        return jsonify({"item_price": sandbox.item_price(item_price_id)})

    @app.get(f"{prefix}/item_prices")
    def list_item_prices():
        return page(sandbox.store.all("item_price"), "item_price")

    @app.get(f"{prefix}/customers/<customer_id>")
    def get_customer(customer_id):
        return jsonify({"customer": sandbox.customer(customer_id)})

    return app


def create_orchestrator_app(sandbox: Sandbox) -> Flask:
    app = Flask("sandbox-orchestrator")
    _install_faults(app, sandbox, "orchestrator")
    _install_errors(app)

    @app.before_request
    def _auth():
        key = request.headers.get("X-API-KEY", "")
        if not key or key in sandbox.store.meta("revoked_orchestrator_keys", []):
            return jsonify({"error": {"errorId": "Unauthorized", "description": "Invalid API key"}}), 401
        return None

    def body() -> dict:
        data = request.get_json(silent=True)
        if not isinstance(data, dict):
            raise SandboxError(400, "a JSON object body is required")
        return data

    @app.post("/client-session")
    def client_session():
        data = body()
        return _idempotent(sandbox, "X-Idempotency-Key", lambda: sandbox.create_client_session(data))

    @app.post("/payments")
    def create_payment():
        data = body()
        return _idempotent(sandbox, "X-Idempotency-Key", lambda: sandbox.charge(data))

    @app.get("/payments")
    def list_payments():
        status = request.args.get("status")
        from_date = request.args.get("from_date")
        since = None
        if from_date:
            from datetime import datetime

            since = datetime.fromisoformat(from_date).timestamp()
        items = sandbox.payments(status, since)
        if request.args.get("customer_id"):
            items = [p for p in items if p["customerId"] == request.args["customer_id"]]
        limit = min(int(request.args.get("limit", 100)), 100)
        offset = int(request.args.get("cursor") or 0)
        result = {"data": items[offset: offset + limit]}
        if offset + limit < len(items):
            result["nextCursor"] = str(offset + limit)
        return jsonify(result)

    @app.get("/payments/<payment_id>")
    def get_payment(payment_id):
        payment = sandbox.store.get("payment", payment_id)
        if payment is None:
            raise SandboxError(404, f"Payment {payment_id} not found", "resource_not_found")
        return jsonify(payment)

    @app.post("/payments/<payment_id>/refund")
    def refund(payment_id):
        data = request.get_json(silent=True) or {}
        return _idempotent(sandbox, "X-Idempotency-Key", lambda: sandbox.refund(payment_id, data.get("amount")))

    @app.get("/payment-instruments")
    def instruments():
        customer_id = request.args.get("customer_id")
        if not customer_id:
            raise SandboxError(400, "customer_id is required", param="customer_id")
        return jsonify({"data": sandbox.instruments(customer_id)})

    @app.post("/payment-instruments/<token>/default")
    def set_default(token):
        return jsonify(sandbox.set_default(token))

    return app


def create_combined_app(sandbox: Sandbox):
    """Both simulators on one listener: {url}/provider/api/v2/… and {url}/orchestrator/…"""
    from werkzeug.middleware.dispatcher import DispatcherMiddleware
    from werkzeug.wrappers import Response as WResponse

    return DispatcherMiddleware(WResponse("sandbox: use /provider or /orchestrator", status=404), {
        "/provider": create_provider_app(sandbox),
        "/orchestrator": create_orchestrator_app(sandbox),
    })
