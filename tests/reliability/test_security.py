"""Security evidence: sessions, the internal token, the public route table, and secrets that never
appear in logs or responses."""

import os
import subprocess
import sys
import time

import jwt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from billingctl.adapters.db.tables import metadata
from billingctl.bootstrap import Container
from webhooks_app import create_internal_app, create_public_app

pytestmark = pytest.mark.reliability


def bearer(claims, key, alg="HS256"):
    return {"Authorization": "Bearer " + jwt.encode({"exp": int(time.time()) + 60, **claims}, key, algorithm=alg)}


@pytest.fixture
def aud_container(make_settings, db_url):
    c = Container(make_settings(database_url=db_url, session_jwt_audience="billing", session_jwt_issuer="https://id"))
    yield c
    c.close()


@pytest.mark.parametrize(("claims", "status"), [
    ({"sub": "u", "aud": "billing", "iss": "https://id"}, 200),
    ({"sub": "u", "aud": "other", "iss": "https://id"}, 401),
    ({"sub": "u", "aud": "billing", "iss": "https://evil"}, 401),
    ({"sub": "u", "iss": "https://id"}, 401),
    ({"sub": "u", "aud": "billing"}, 401),
])
def test_audience_and_issuer(aud_container, claims, status):
    client = create_public_app(container=aud_container).test_client()
    key = aud_container.settings.secret("session_jwt_key")
    assert client.get("/api/billing/products", headers=bearer(claims, key)).status_code == status


def test_alg_none_and_expired(aud_container):
    client = create_public_app(container=aud_container).test_client()
    none = jwt.encode({"sub": "u", "exp": int(time.time()) + 60}, None, algorithm="none")
    assert client.get("/api/billing/products", headers={"Authorization": f"Bearer {none}"}).status_code == 401
    key = aud_container.settings.secret("session_jwt_key")
    expired = bearer({"sub": "u", "aud": "billing", "iss": "https://id", "exp": int(time.time()) - 1}, key)
    assert client.get("/api/billing/products", headers=expired).status_code == 307


def db_rows(c):
    with c.uow() as uow:
        return {t.name: uow.execute(select(func.count()).select_from(t)).scalar_one() for t in metadata.sorted_tables}


RECEIVERS = ["/webhooks/orchestrator/payments", "/webhooks/orchestrator/disputes", "/webhooks/subscription-provider",
             "/webhooks/workflow-completion", "/webhooks/identity-verification", "/webhooks/identity"]
HEADER_NAMES = ["X-Signature-Primary", "X-Signature-Secondary", "Authorization", "X-Webhook-Secret",
                "Verification-Signature", "webhook-id", "webhook-timestamp", "webhook-signature", "Content-Type"]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_fuzzed_webhooks_are_only_400_or_401_and_change_nothing(container):
    client = create_public_app(container=container).test_client()
    before = db_rows(container)
    seen = set()

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(RECEIVERS), body=st.binary(max_size=300),
           headers=st.dictionaries(st.sampled_from(HEADER_NAMES),
                                   st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=80),
                                   max_size=5))
    def fuzz(path, body, headers):
        response = client.post(path, data=body, headers=headers)
        seen.add(response.status_code)
        assert response.status_code in (400, 401), (path, response.status_code, response.data[:200])
        assert response.is_json and set(response.get_json()) == {"error", "message"}

    fuzz()
    assert db_rows(container) == before
    assert seen <= {400, 401}


def test_the_internal_app_without_with_a_wrong_or_an_unset_token(make_settings, db_url):
    for token, header, expected in (("t0k", None, 401), ("t0k", "Bearer nope", 401), ("t0k", "Bearer t0k", 200),
                                    (None, "Bearer ", 401), (None, "Bearer None", 401)):
        app = create_internal_app(make_settings(database_url=db_url, internal_token=token))
        headers = {"Authorization": header} if header else {}
        assert app.test_client().get("/internal/health/circuit-breaker", headers=headers).status_code == expected


def test_no_secret_ever_appears_in_logs_or_responses(tmp_path):
    secrets = {
        "BILLING_INTERNAL_TOKEN": "sekret-internal-7f1e", "BILLING_SESSION_JWT_KEY": "sekret-jwt-key-0123456789abcdef",
        "BILLING_ORCHESTRATOR_WEBHOOK_SECRET": "sekret-orch-9c2a",
        "BILLING_ORCHESTRATOR_DISPUTES_SECRET": "sekret-disp-1b",
        "BILLING_PROVIDER_WEBHOOK_USERNAME": "sekret-user-5d", "BILLING_PROVIDER_WEBHOOK_PASSWORD": "sekret-pass-6e",
        "BILLING_WORKFLOW_CALLBACK_SECRET": "sekret-wf-3c", "BILLING_IDV_WEBHOOK_SECRET": "sekret-idv-4d",
        "BILLING_IDENTITY_WEBHOOK_SECRET": "whsec_c2VrcmV0LWlkZW50LThm",
        "BILLING_MEDIA_SIGNING_SECRET": "sekret-media-2a",
        "BILLING_PROVIDER_API_KEY": "sekret-provider-key-77", "BILLING_ORCHESTRATOR_API_KEY": "sekret-orch-key-88",
    }
    env = {"PATH": os.environ["PATH"], "BILLING_LOG_LEVEL": "DEBUG", **secrets}
    captured = ""
    for args in (["--json", "demo"], ["--json", "health"], ["--json", "users", "show", "nobody"],
                 ["--json", "alerts", "list"], ["--json", "events", "list"], ["--json", "jobs", "list"]):
        result = subprocess.run([sys.executable, "-m", "billingctl", *args], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=300)
        captured += result.stdout + result.stderr
    assert "payment" in captured and len(captured) > 5000  # the demo did run and log
    leaked = [name for name, value in secrets.items() if value in captured]
    assert leaked == []


# ---- issue "Hardening" 4: bodies generated behind valid signatures -----------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                    | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)


def shaped(keys: dict) -> st.SearchStrategy:
    """A body with the receiver's own keys, each a well-typed value or any JSON at all."""
    return st.fixed_dictionaries({}, optional={k: v | JSON for k, v in keys.items()})


IDS = st.from_regex(r"[a-z]{2,4}_[a-z0-9]{1,8}", fullmatch=True)
PAYMENT = shaped({"id": IDS, "status": st.sampled_from(["SETTLED", "DECLINED", "PENDING", "AUTHORIZED"]),
                  "orderId": IDS, "customerId": IDS, "amount": st.integers(0, 10**6), "currencyCode": st.just("USD"),
                  "date": st.integers(0, 2**31), "metadata": st.dictionaries(st.sampled_from(
                      ["lane", "subscription_id", "item_price_id", "user_id", "psp"]), st.text(max_size=12)),
                  "processor": shaped({"name": st.text(max_size=12), "amountRefunded": st.integers(0, 10**6)}),
                  "paymentMethod": shaped({"paymentType": st.text(max_size=12),
                                           "paymentMethodToken": st.text(max_size=12)})})


def signed_requests(c, now: int) -> st.SearchStrategy:
    import base64
    import hashlib
    import hmac
    import json

    from standardwebhooks.webhooks import Webhook

    from billingctl.sandbox.model import sign_body

    def orchestrator(body, setting="orchestrator_webhook_secret", path="/webhooks/orchestrator/payments"):
        raw = json.dumps(body).encode()
        return path, raw, {"X-Signature-Primary": sign_body(c.settings.secret(setting), raw),
                           "Content-Type": "application/json"}

    def idv(body):
        raw = json.dumps(body).encode()
        mac = hmac.new(c.settings.secret("idv_webhook_secret").encode(), f"{now}.".encode() + raw, hashlib.sha256)
        return "/webhooks/identity-verification", raw, {"Verification-Signature": f"t={now},v1={mac.hexdigest()}"}

    def identity(body):
        from datetime import UTC, datetime

        raw = json.dumps(body)
        stamp = datetime.fromtimestamp(now, UTC)
        signature = Webhook(c.settings.secret("identity_webhook_secret")).sign("msg_fuzz", stamp, raw)
        return "/webhooks/identity", raw.encode(), {"webhook-id": f"msg_{abs(hash(raw))}", "webhook-timestamp":
                                                    str(now), "webhook-signature": signature}

    def workflow(body):
        return "/webhooks/workflow-completion", json.dumps(body).encode(), {
            "X-Webhook-Secret": c.settings.secret("workflow_callback_secret"), "Content-Type": "application/json"}

    def provider(body):
        user, password = c.settings.secret("provider_webhook_username"), c.settings.secret("provider_webhook_password")
        return "/webhooks/subscription-provider", json.dumps(body).encode(), {
            "Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode(),
            "Content-Type": "application/json"}

    return st.one_of(
        shaped({"eventType": st.sampled_from(["PAYMENT.STATUS", "PAYMENT.REFUND"]), "signedAt": st.just(str(now)),
                "payment": PAYMENT}).map(orchestrator),
        shaped({"eventType": st.just("DISPUTE.OPENED"), "paymentId": IDS, "processorDisputeId": IDS,
                "processorId": st.text(max_size=10)}).map(
            lambda b: orchestrator(b, "orchestrator_disputes_secret", "/webhooks/orchestrator/disputes")),
        shaped({"workflow_id": IDS, "status": st.sampled_from(["completed", "running"]), "payment_id": IDS}
               ).map(workflow),
        shaped({"id": IDS, "user_id": IDS, "status": st.sampled_from(["verified", "rejected"])}).map(idv),
        shaped({"type": st.sampled_from(["user.created", "user.deleted", "session.created"]),
                "data": shaped({"id": IDS, "user_id": IDS, "email": st.emails(), "client_ip": st.ip_addresses().map(
                    str)})}).map(identity),
        shaped({"id": IDS, "event_type": st.sampled_from(["subscription_changed", "payment_succeeded",
                                                         "invoice_generated", "payment_refunded"]),
                "occurred_at": st.integers(0, 2**31), "content": shaped({
                    "subscription": shaped({"id": IDS, "status": st.text(max_size=8)}),
                    "invoice": shaped({"id": IDS}), "transaction": shaped({"reference_number": IDS})})}).map(provider),
    )


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_bodies_generated_behind_valid_signatures_never_get_a_5xx(container):
    """2,100 generated bodies over the six receivers, each correctly signed: zero 5xx, and a rejected
    request changes no row."""
    client = create_public_app(container=container).test_client()
    now = int(container.clock.now().timestamp())
    statuses: dict[int, int] = {}

    @settings(max_examples=2100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(request=signed_requests(container, now))
    def fuzz(request):
        path, raw, headers = request
        before = db_rows(container)
        response = client.post(path, data=raw, headers=headers)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (path, raw[:300], response.data[:300])
        if response.status_code in (400, 401):
            assert db_rows(container) == before, (path, raw[:300])

    fuzz()
    assert sum(statuses.values()) >= 2000 and not [s for s in statuses if s >= 500]
    assert statuses.get(400, 0) > 100 and statuses.get(200, 0) > 100  # both sound and unsound bodies were sent
