"""The signed-webhook fuzzer (issue 37): Hypothesis mutates a valid body of every receiver (a field's type,
nesting where a string belongs, huge and non-standard numbers, unicode, NUL, over-long strings, a field
missing, fields added), signs the mutated bytes with the receiver's real scheme, and posts them to the public
app on PostgreSQL. Behind a valid signature every answer is below 500: bad input is a 4xx and changes
nothing, never a server error. `make test` runs FUZZ_EXAMPLES (500) per receiver, 3,000 in all; `make fuzz`
runs 3,400 per receiver (20,400)."""

import base64
import hashlib
import hmac
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from billingctl.bootstrap import Container
from billingctl.domain.clock import ManualClock
from billingctl.sandbox.model import sign_body
from webhooks_app import create_public_app

pytestmark = pytest.mark.e2e
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", 500))

LEAVES = st.one_of(
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.text(min_size=60, max_size=700),
    st.sampled_from(["\x00", "a\x00b", "x" * 5000, "\u202e\u0000", "é" * 70, "1e309", "-0", "NaN", "\ud7ff" * 3]),
    st.none(),
    st.booleans(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
)


def paths(value, prefix=()):
    """Every place in a JSON document: the document itself, then each key or index below it."""
    yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from paths(child, (*prefix, index))


def mutated(data, base):
    """`base` with one to three places changed: replaced by a leaf, removed, or given a new sibling."""
    body = json.loads(json.dumps(base))
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(list(paths(body))))
        if not where:
            continue
        parent = body
        for step in where[:-1]:
            parent = parent[step]
        action = data.draw(st.sampled_from(["replace", "replace", "remove", "add"]))
        if action == "replace":
            parent[where[-1]] = data.draw(LEAVES)
        elif action == "remove" and isinstance(parent, dict):
            parent.pop(where[-1])
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=12))] = data.draw(LEAVES)
    return json.dumps(body, allow_nan=True, ensure_ascii=data.draw(st.booleans())).encode()


def standard_headers(secret, msg_id, body, ts):
    key = base64.b64decode(secret.removeprefix("whsec_") + "==")
    sig = base64.b64encode(hmac.new(key, f"{msg_id}.{ts}.".encode() + body, hashlib.sha256).digest()).decode()
    return {"webhook-id": msg_id, "webhook-timestamp": str(ts), "webhook-signature": f"v1,{sig}"}


def receivers(c):
    """(path, valid body, how to sign raw bytes) of every signed receiver."""
    now = int(c.clock.now().timestamp())
    secret = c.settings.secret
    payment = {"id": "pay_fz", "status": "SETTLED", "orderId": "sub_fz", "customerId": "user_fz", "amount": 999,
               "currencyCode": "USD", "date": now, "processor": {"name": "SFW_STRIPE", "processorMerchantId": "m"},
               "paymentMethod": {"paymentType": "FIRST_PAYMENT", "paymentMethodToken": "tok_fz"},
               "metadata": {"user_id": "user_fz", "subscription_id": "sub_fz", "lane": "sfw",
                            "item_price_id": "credits-basic-USD-monthly"}}
    plan = "credits-basic-USD-monthly"
    basic = "Basic " + base64.b64encode(
        f"{secret('provider_webhook_username')}:{secret('provider_webhook_password')}".encode()).decode()

    def hmac_hex(name, body):
        return hmac.new(secret(name).encode(), f"{now}.".encode() + body, hashlib.sha256).hexdigest()

    return {
        "orchestrator": ("/webhooks/orchestrator/payments",
                         {"eventType": "PAYMENT.STATUS", "signedAt": str(now), "payment": payment},
                         lambda b: {"X-Signature-Primary": sign_body(secret("orchestrator_webhook_secret"), b)}),
        "disputes": ("/webhooks/orchestrator/disputes",
                     {"eventType": "DISPUTE.STATUS", "paymentId": "pay_fz", "processorDisputeId": "dp_fz",
                      "type": "DISPUTE", "status": "OPEN", "processor": "SFW_STRIPE", "amount": 999, "currency": "USD"},
                     lambda b: {"X-Signature-Primary": sign_body(secret("orchestrator_disputes_secret"), b)}),
        "provider": ("/webhooks/subscription-provider",
                     {"id": "ev_fz", "event_type": "subscription_changed", "occurred_at": now,
                      "content": {"subscription": {"id": "sub_fz", "customer_id": "user_fz", "status": "active",
                                                   "current_term_end": now + 86400, "resource_version": 1,
                                                   "subscription_items": [{"item_price_id": plan}]},
                                  "invoice": {"id": "inv_fz", "status": "paid", "total": 999, "currency_code": "USD",
                                              "line_items": [{"entity_id": plan}]}}},
                     lambda b: {"Authorization": basic}),
        "workflow": ("/webhooks/workflow-completion", {"workflow_id": "wf_fz", "status": "completed",
                                                       "payment_id": "pay_fz"},
                     lambda b: {"X-Webhook-Secret": secret("workflow_callback_secret")}),
        "idv": ("/webhooks/identity-verification", {"id": "iv_fz", "user_id": "user_fz", "status": "verified"},
                lambda b: {"Verification-Signature": f"t={now},v1={hmac_hex('idv_webhook_secret', b)}"}),
        "identity": ("/webhooks/identity", {"type": "user.created",
                                            "data": {"id": "user_fz", "email_addresses": [{"email_address": "a@b.c"}]}},
                     lambda b: standard_headers(secret("identity_webhook_secret"), "msg_fz", b, now)),
    }


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("receiver", ["orchestrator", "disputes", "provider", "workflow", "idv", "identity"])
def test_no_signed_body_is_a_server_error(make_settings, db_url, receiver):
    c = Container(make_settings(database_url=db_url, http_max_attempts=1), clock=ManualClock())
    c.provider.http.sleep = c.orchestrator.http.sleep = lambda s: None
    client = create_public_app(container=c).test_client()
    path, base, sign = receivers(c)[receiver]
    assert client.post(path, data=json.dumps(base).encode(), headers={
        **sign(json.dumps(base).encode()), "Content-Type": "application/json"}).status_code < 500
    answers: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def fuzz(data):
        body = mutated(data, base)
        status = client.post(path, data=body, headers={**sign(body), "Content-Type": "application/json"}).status_code
        answers[status] = answers.get(status, 0) + 1
        assert status < 500, body[:300]

    try:
        fuzz()
    finally:
        print(f"fuzz {receiver}: {sum(answers.values())} signed bodies, answers {sorted(answers.items())}")
        c.close()
    assert sum(answers.values()) >= EXAMPLES * 0.9
