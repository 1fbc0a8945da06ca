"""Flask apps speaking the wire contracts of DESIGN section 3, over one Sandbox model, with fault
injection: 429 with Retry-After, 5xx, timeouts, connection resets, malformed JSON, slow answers,
401, and a call that errors after taking effect."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import time
from email.utils import formatdate

from flask import Flask, Response, g, jsonify, request

from billingctl.sandbox.model import Sandbox, SandboxError

# The header the real provider reads for idempotent POSTs (its official SDK sends this one).
PROVIDER_IDEMPOTENCY_HEADER = "chargebee-idempotency-key"
ORCHESTRATOR_IDEMPOTENCY_HEADER = "X-Idempotency-Key"
# The provider's reference: a replayed answer says so in this header; keys are up to 100 characters and
# kept for 24 hours (its SDK's documentation).
PROVIDER_REPLAYED_HEADER = "chargebee-idempotency-replayed"
IDEMPOTENCY_KEY_MAX = 100
IDEMPOTENCY_WINDOW = 24 * 3600
# Enum values as the provider's official SDK models spell them (tests/integration/test_provider_sdk.py
# holds each to the SDK's enum): a list filtered on another value is refused.
SUBSCRIPTION_STATUSES = ("future", "in_trial", "active", "non_renewing", "paused", "cancelled", "transferred")
INVOICE_STATUSES = ("paid", "posted", "payment_due", "not_paid", "voided", "pending")
TRANSACTION_TYPES = ("authorization", "payment", "refund", "payment_reversal")
ITEM_TYPES = ("plan", "addon", "charge")
ITEM_PRICE_STATUSES = ("active", "archived", "deleted")
AUTH_FAILED = {"message": "Sorry, authentication failed. Invalid api key", "type": "invalid_request",
               "api_error_code": "api_authentication_failed", "http_status_code": 401}

RATE_LIMIT_BODY = {"message": "Please try after some time", "type": "operation_failed",
                   "api_error_code": "api_request_limit_exceeded", "error_code": "api_request_limit_exceeded",
                   "http_status_code": 429}
BEFORE_KINDS = ("429", "500", "503", "timeout", "reset", "malformed", "slow", "slow_answer", "401", "400")


def handler_dated_by_the_app():
    """Werkzeug's request handler adds its own Date (the machine's time) before the app's headers; the
    sandbox's answers name its own clock's (`_server_date`), once."""
    from werkzeug.serving import WSGIRequestHandler

    class Handler(WSGIRequestHandler):
        def send_response(self, code, message=None):
            self.log_request(code)
            self.send_response_only(code, message)
            self.send_header("Server", self.version_string())

    return Handler


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
            # The provider documents a block of about a minute and no Retry-After: the answer names one only
            # when the fault asks for it (a test that models a shorter wait).
            if fault["retry_after"] is not None and fault["retry_after"] >= 0:
                response.headers["Retry-After"] = f"{fault['retry_after']:g}"
            return response
        if kind in ("500", "503"):
            return jsonify({"message": "internal error", "type": "api_error", "api_error_code": "internal_error"}), \
                int(kind)
        if kind == "401":
            return jsonify(AUTH_FAILED), 401
        if kind == "400":  # the request refused as invalid, in each system's documented error shape
            if system == "orchestrator":
                return jsonify({"error": {"errorId": "RequestValidationError", "description": "Invalid request",
                                          "diagnosticsId": "sandbox"}}), 400
            return jsonify({"message": "invalid request", "type": "invalid_request",
                            "api_error_code": "invalid_request", "http_status_code": 400}), 400
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
        if kind == "slow_answer":  # served at once; its answer leaves later (`_server_date`)
            g.slow_answer = fault["delay"] or 1.0
        return None

    @app.after_request
    def _server_date(response):
        # Every HTTP server names its time (RFC 9110 Date); the sandbox's is its own clock, which tests
        # and `sandbox clock` move apart from ours.
        # A late answer (the `slow_answer` fault) is dated when it leaves, as any web server stamps it: a
        # later second, maybe, than the one the provider read its clock in.
        time.sleep(g.pop("slow_answer", 0))
        response.headers["Date"] = formatdate(store.now(), usegmt=True)
        return response

    @app.after_request
    def _fault_after(response):
        if 200 <= response.status_code < 300 and request.method == "POST":
            fault = store.take_fault(system, request.method, request.path, ("error_after_effect",))
            if fault is not None:
                failed = jsonify({"message": "internal error", "type": "api_error", "api_error_code": "internal_error"})
                failed.status_code = 500
                return failed
        return response


def _install_errors(app: Flask, nested: bool = False) -> None:
    """The provider answers {message, type, api_error_code, param}; the orchestrator nests its errors
    as {"error": {"errorId", "description", "diagnosticsId"}}."""

    @app.errorhandler(SandboxError)
    def _sandbox_error(exc: SandboxError):
        if nested:
            return jsonify({"error": {"errorId": exc.api_error_code, "description": str(exc),
                                      "diagnosticsId": f"diag_{int(time.time() * 1000)}"}}), exc.status
        return jsonify(exc.body), exc.status

    @app.errorhandler(ValueError)
    def _bad_value(exc: ValueError):
        return _sandbox_error(SandboxError(400, f"invalid parameter value: {exc}"[:200], "param_wrong_value"))


def provider_key(header: str) -> str | None:
    """The API key from either scheme the provider accepts: Basic (key as user name, empty password,
    what the real provider and its SDK use) or Bearer (spec 5.11)."""
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip() or None
    if scheme.lower() == "basic":
        try:
            user, _, _password = base64.b64decode(value.strip(), validate=True).decode("latin-1").partition(":")
        except (binascii.Error, ValueError):
            return None
        return user or None
    return None


def _idempotent(sandbox: Sandbox, header: str, fn, replayed_header: str | None = None):
    """The provider (`replayed_header` given) replays the first successful answer to a repeated idempotency
    key with the same parameters within IDEMPOTENCY_WINDOW seconds, marked by that header, and refuses the
    key with other parameters. The orchestrator refuses any processed key with 409."""
    key = request.headers.get(header)
    if not key:
        return jsonify(fn())
    if replayed_header and len(key) > IDEMPOTENCY_KEY_MAX:
        raise SandboxError(400, f"{header} : cannot be more than {IDEMPOTENCY_KEY_MAX} characters",
                           "param_wrong_value", header)
    params = hashlib.sha256(repr(sorted(request.form.items(multi=True)) if request.form else
                                 request.get_data()).encode()).hexdigest()
    now = sandbox.store.now()
    saved = sandbox.store.idempotent_result(f"{request.path}:{key}")
    if saved is not None and not replayed_header:
        # Primer: a key whose request it processed is answered 409 IdempotencyKeyAlreadyExists and the
        # request ignored, whatever its parameters; it never replays the first answer.
        raise SandboxError(409, "A request with this idempotency key was already processed",
                           "IdempotencyKeyAlreadyExists")
    if saved is not None and now - saved["at"] < IDEMPOTENCY_WINDOW:
        if saved["params"] not in (None, params):
            raise SandboxError(400, "The idempotency key was used earlier with other parameters", "invalid_request",
                               header)
        response = jsonify(saved["body"])
        response.status_code = saved["status"]
        if replayed_header:
            response.headers[replayed_header] = "true"
        return response
    body = fn()
    sandbox.store.save_idempotent_result(f"{request.path}:{key}", 200, body, params=params, at=now)
    return jsonify(body)


def _cursor_position(cursor: str | None) -> tuple | None:
    """The orchestrator list's cursor (`<date>:<seq>` of the last row given) as a store position."""
    if not cursor:
        return None
    try:
        date, seq = cursor.rsplit(":", 1)
        return float(date), int(seq)
    except ValueError:
        raise SandboxError(400, "cursor : invalid value", "BadRequest") from None


def create_provider_app(sandbox: Sandbox) -> Flask:
    app = Flask("sandbox-provider")
    _install_faults(app, sandbox, "provider")
    _install_errors(app)
    prefix = "/api/v2"
    store = sandbox.store

    @app.before_request
    def _auth():
        key = provider_key(request.headers.get("Authorization", ""))
        if not key or key in store.meta("revoked_provider_keys", []):
            return jsonify(AUTH_FAILED), 401
        g.key = key
        return None

    def idempotent(fn):
        return _idempotent(sandbox, PROVIDER_IDEMPOTENCY_HEADER, fn, replayed_header=PROVIDER_REPLAYED_HEADER)

    def form(name: str, required: bool = True) -> str | None:
        value = request.form.get(name)
        if required and value in (None, ""):
            raise SandboxError(400, f"{name} : cannot be blank", "param_wrong_value", name)
        return value

    def page(kind: str, wrapper: str | None, filters: list, sort: str | None = None, wrap=None):
        """One page read from the store (filtered and sorted by SQLite, decoded page by page);
        next_offset only when more rows exist."""
        limit = int(request.args.get("limit", 10))  # the provider's default page is ten
        if not 1 <= limit <= 100:
            raise SandboxError(400, "limit : should be between 1 and 100", "param_wrong_value", "limit")
        offset = int(request.args.get("offset") or 0)
        chunk, more = store.page(kind, filters, sort, offset, limit)
        rows = [wrap(item) if wrap else ({wrapper: item} if wrapper else item) for item in chunk]
        body = {"list": rows}
        if more:
            body["next_offset"] = str(offset + limit)
        return jsonify(body)

    def after(name: str) -> list:
        value = request.args.get(f"{name}[after]")
        return [(name, ">", int(value))] if value not in (None, "") else []

    def equals(param: str, field: str, allowed: tuple[str, ...] | None = None) -> list:
        """`param[is]`, and for an enumerated attribute `param[in]` too: a list of values, as the provider's
        filters take it (a JSON array; the official SDK sends Python's repr of a list, in single quotes)."""
        value = request.args.get(f"{param}[is]")
        if value not in (None, "") and allowed is not None and value not in allowed:
            raise SandboxError(400, f"{param}[is] : invalid value {value}"[:200], "param_wrong_value",
                               f"{param}[is]")
        filters = [(field, "=", value)] if value not in (None, "") else []
        listed = request.args.get(f"{param}[in]") if allowed is not None else None
        if listed not in (None, ""):
            try:
                values = json.loads(listed.replace("'", '"'))
            except ValueError:
                values = None
            if not isinstance(values, list) or not values or any(v not in allowed for v in values):
                raise SandboxError(400, f"{param}[in] : invalid value {listed}"[:200], "param_wrong_value",
                                   f"{param}[in]")
            filters.append((field, "in", values))
        return filters

    def sort_key(default: str | None, sortable: tuple[str, ...]) -> str | None:
        """The list's sort attribute, ascending (`sort_by[asc]`) or descending (`sort_by[desc]`, given back as
        "-attribute"): only those the provider documents as sortable for the resource, one direction."""
        given = {d: request.args.get(f"sort_by[{d}]") for d in ("asc", "desc")}
        given = {d: v for d, v in given.items() if v not in (None, "")}
        if len(given) > 1:
            raise SandboxError(400, "sort_by : only one of asc and desc may be given", "param_wrong_value", "sort_by")
        for direction, value in given.items():
            if value not in sortable:
                raise SandboxError(400, f"sort_by[{direction}] : invalid value {value}"[:200], "param_wrong_value",
                                   f"sort_by[{direction}]")
            return value if direction == "asc" else f"-{value}"
        return default

    @app.get(f"{prefix}/subscriptions/<sub_id>")
    def get_subscription(sub_id):
        sub = sandbox.subscription(sub_id)
        return jsonify({"subscription": sub, "customer": sandbox.customer(sub["customer_id"])})

    def undeleted() -> list:
        """A deleted resource is listed only when the caller asks for it (`include_deleted=true`)."""
        return [] if request.args.get("include_deleted") == "true" else [("deleted", "is not", 1)]

    @app.get(f"{prefix}/subscriptions")
    def list_subscriptions():
        return page("subscription", None, after("updated_at") + equals("status", "status", SUBSCRIPTION_STATUSES)
                    + equals("customer_id", "customer_id") + undeleted(),
                    sort_key("updated_at", ("created_at", "updated_at")),
                    wrap=lambda s: {"subscription": s, "customer": sandbox.customer(s["customer_id"])})

    @app.post(f"{prefix}/customers")
    def create_customer():
        return idempotent(lambda: sandbox.create_customer(form("id", required=False), form("email", required=False),
                                                          form("auto_collection", required=False)))

    @app.post(f"{prefix}/customers/<customer_id>/subscription_for_items")
    def subscription_for_items(customer_id):
        item_price_id = form("subscription_items[item_price_id][0]")
        start = form("start_date", required=False)
        return idempotent(lambda: sandbox.create_subscription_for_items(
            customer_id, item_price_id, int(start) if start else None, form("auto_collection", required=False)))

    @app.post(f"{prefix}/subscriptions/<sub_id>/update_for_items")
    def update_for_items(sub_id):
        start = form("start_date", required=False)
        if not start:
            raise SandboxError(400, "the sandbox supports update_for_items with start_date only", "param_wrong_value",
                               "start_date")
        return idempotent(lambda: sandbox.start_future_subscription(sub_id, int(start)))

    @app.post(f"{prefix}/subscriptions/<sub_id>/change_term_end")
    def change_term_end(sub_id):
        term = int(form("term_ends_at"))
        return idempotent(lambda: sandbox.change_term_end(sub_id, term))

    @app.post(f"{prefix}/subscriptions/<sub_id>/cancel_for_items")
    def cancel(sub_id):
        end_of_term = form("end_of_term", required=False) == "true"
        return idempotent(lambda: sandbox.cancel(sub_id, end_of_term=end_of_term))

    @app.post(f"{prefix}/subscriptions/<sub_id>/remove_scheduled_cancellation")
    def remove_scheduled_cancellation(sub_id):  # support's action; our client never calls it
        return idempotent(lambda: sandbox.remove_scheduled_cancellation(sub_id))

    @app.post(f"{prefix}/subscriptions/<sub_id>/reactivate")
    def reactivate(sub_id):  # support's action; our client never calls it
        return idempotent(lambda: sandbox.reactivate(sub_id))

    @app.get(f"{prefix}/events")
    def events():
        return page("event", "event", after("occurred_at") + equals("event_type", "event_type"),
                    sort_key("occurred_at", ("occurred_at",)))

    @app.get(f"{prefix}/invoices/<invoice_id>")
    def get_invoice(invoice_id):
        return jsonify({"invoice": sandbox.invoice(invoice_id)})

    @app.get(f"{prefix}/invoices")
    def list_invoices():
        sandbox.renew_due()  # renewals materialize lazily, on the sandbox's clock
        return page("invoice", "invoice", equals("status", "status", INVOICE_STATUSES)
                    + equals("subscription_id", "subscription_id") + after("updated_at") + undeleted(),
                    sort_key(None, ("date", "updated_at")))

    @app.post(f"{prefix}/subscriptions/<sub_id>/delete")
    def delete_subscription(sub_id):  # support's action; our client never calls it
        return idempotent(lambda: sandbox.delete_subscription(sub_id))

    @app.post(f"{prefix}/invoices/<invoice_id>/void")
    def void(invoice_id):
        return idempotent(lambda: sandbox.void_invoice(invoice_id))

    @app.post(f"{prefix}/invoices/<invoice_id>/delete")
    def delete_invoice(invoice_id):  # finance's action; our client never calls it
        return idempotent(lambda: sandbox.delete_invoice(invoice_id))

    @app.post(f"{prefix}/invoices/<invoice_id>/record_payment")
    def record_payment(invoice_id):
        method = form("transaction[payment_method]")
        reference = form("transaction[reference_number]", required=False) or ""
        amount = form("transaction[amount]", required=False)
        due = sandbox.invoice(invoice_id)["amount_due"]
        return idempotent(lambda: sandbox.record_payment(invoice_id, int(amount) if amount else due, reference,
                                                         method))

    def refund_fields(name) -> tuple:
        """(amount, payment method, date, reference number) of a recorded refund, each optional here: the
        sandbox's model refuses what the provider refuses."""
        amount, date = form(name("amount"), required=False), form(name("date"), required=False)
        return (int(amount) if amount else None, form(name("payment_method"), required=False),
                int(date) if date else None, form(name("reference_number"), required=False))

    @app.post(f"{prefix}/invoices/<invoice_id>/record_refund")
    def record_refund(invoice_id):  # finance's action; our client never calls it
        fields = refund_fields(lambda n: f"transaction[{n}]")
        return idempotent(lambda: sandbox.record_refund(invoice_id, *fields))

    @app.post(f"{prefix}/invoices/<invoice_id>/write_off")
    def write_off(invoice_id):  # finance's action; our client never calls it
        return idempotent(lambda: sandbox.write_off(invoice_id))

    @app.post(f"{prefix}/credit_notes")
    def create_credit_note():  # finance's action; our client never calls it
        return idempotent(lambda: sandbox.create_credit_note(
            form("reference_invoice_id"), int(form("total")), form("type"), form("create_reason_code", required=False)))

    @app.post(f"{prefix}/invoices/<invoice_id>/remove_payment")
    def remove_payment(invoice_id):  # finance's action; our client never calls it
        return idempotent(lambda: sandbox.remove_payment(invoice_id, form("transaction[id]")))

    @app.post(f"{prefix}/invoices/<invoice_id>/apply_payments")
    def apply_payments(invoice_id):  # finance's action; our client never calls it
        return idempotent(lambda: sandbox.apply_payments(invoice_id, form("transactions[id][0]")))

    @app.get(f"{prefix}/transactions")
    def list_transactions():
        return page("transaction", "transaction", equals("type", "type", TRANSACTION_TYPES) + after("date")
                    + equals("id", "id") + equals("reference_number", "reference_number") + undeleted(),
                    sort_key("date", ("date", "updated_at")))

    @app.post(f"{prefix}/transactions/<txn_id>/record_refund")
    def record_transaction_refund(txn_id):  # finance's action; our client never calls it
        fields = refund_fields(lambda n: n)
        return idempotent(lambda: sandbox.record_transaction_refund(txn_id, *fields))

    @app.get(f"{prefix}/transactions/<txn_id>")
    def get_transaction(txn_id):
        return jsonify({"transaction": sandbox.transaction(txn_id)})

    @app.get(f"{prefix}/item_prices/<item_price_id>")
    def get_item_price(item_price_id):
        return jsonify({"item_price": sandbox.item_price(item_price_id)})

    @app.get(f"{prefix}/item_prices")
    def list_item_prices():
        return page("item_price", "item_price", equals("item_type", "item_type", ITEM_TYPES)
                    + equals("status", "status", ITEM_PRICE_STATUSES))

    @app.get(f"{prefix}/customers/<customer_id>")
    def get_customer(customer_id):
        return jsonify({"customer": sandbox.customer(customer_id)})

    return app


def create_orchestrator_app(sandbox: Sandbox) -> Flask:
    app = Flask("sandbox-orchestrator")
    _install_faults(app, sandbox, "orchestrator")
    _install_errors(app, nested=True)

    @app.before_request
    def _auth():
        key = request.headers.get("X-API-KEY", "")
        if not key or key in sandbox.store.meta("revoked_orchestrator_keys", []):
            return jsonify({"error": {"errorId": "Unauthorized", "description": "Invalid API key"}}), 401
        return None

    def idempotent(fn):
        return _idempotent(sandbox, ORCHESTRATOR_IDEMPOTENCY_HEADER, fn)

    def body() -> dict:
        data = request.get_json(silent=True)
        if not isinstance(data, dict):
            raise SandboxError(400, "a JSON object body is required")
        return data

    @app.post("/client-session")
    def client_session():
        data = body()
        return idempotent(lambda: sandbox.create_client_session(data))

    @app.post("/payments")
    def create_payment():
        data = body()
        return idempotent(lambda: sandbox.charge(data))

    @app.get("/payments")
    def list_payments():
        """Primer's search: statuses (comma-separated), from_date (inclusive), customer, order; summaries
        oldest first, up to 100 a page, an opaque cursor to the next."""
        filters = []
        if request.args.get("status"):
            filters.append(("status", "in", request.args["status"].split(",")))
        if request.args.get("from_date"):
            from datetime import datetime

            filters.append(("date", ">=", datetime.fromisoformat(request.args["from_date"]).timestamp()))
        for param, field in (("customer_id", "customerId"), ("order_id", "orderId")):
            if request.args.get(param):
                filters.append((field, "=", request.args[param]))
        limit = min(int(request.args.get("limit", 100)), 100)
        after = _cursor_position(request.args.get("cursor"))
        items, more = sandbox.store.page_after("payment", filters, "date", after, limit)
        result = {"data": [sandbox.summary(p) for p in items]}
        if more is not None:
            result["nextCursor"] = f"{more[0]!r}:{more[1]}"
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
        return idempotent(lambda: sandbox.refund(payment_id, data.get("amount"), reason=data.get("reason")))

    @app.post("/payments/<payment_id>/capture")
    def capture(payment_id):
        data = request.get_json(silent=True) or {}
        return idempotent(lambda: sandbox.capture(payment_id, data.get("amount"), bool(data.get("final", True))))

    @app.post("/payments/<payment_id>/cancel")
    def cancel(payment_id):
        return idempotent(lambda: sandbox.cancel_payment(payment_id))

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
