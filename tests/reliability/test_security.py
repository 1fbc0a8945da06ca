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
