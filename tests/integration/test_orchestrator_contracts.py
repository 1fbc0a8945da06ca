"""The orchestrator has no official Python SDK: its public API reference is the referee. The payloads
in tests/contracts/orchestrator/ keep its shapes (each file names its source page); our receivers and
our client must accept them as they are."""

import json
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from billingctl.adapters.db.tables import fraud_event, purchase
from billingctl.adapters.http import HttpPolicy, ResilientClient
from billingctl.adapters.orchestrator import OrchestratorClient
from billingctl.domain import errors as e
from billingctl.sandbox.model import sign_body
from billingctl.services.checkout import create_checkout
from webhooks_app import create_public_app

pytestmark = pytest.mark.integration
CONTRACTS = Path(__file__).parent.parent / "contracts" / "orchestrator"


def contract(name: str) -> dict:
    body = json.loads((CONTRACTS / name).read_text())
    assert body.pop("_source").startswith("https://primer.io/docs/")
    return body


def client_answering(status: int, body: dict) -> OrchestratorClient:
    transport = httpx.MockTransport(lambda request: httpx.Response(status, json=body))
    http = httpx.Client(base_url="http://orchestrator.test", transport=transport)
    return OrchestratorClient(ResilientClient("orchestrator", http, policy=HttpPolicy(max_attempts=1),
                                              sleep=lambda s: None))


def test_a_page_of_payment_summaries_is_read(container):
    page = contract("payments_list_page.json")
    [summary] = list(client_answering(200, page).list_payments("SETTLED"))
    assert summary.id == "pay_contract_1" and summary.is_summary and summary.customer_id is None


def test_a_nested_error_becomes_a_typed_error_with_its_description():
    with pytest.raises(e.ExternalNotFound) as info:
        client_answering(404, contract("error_not_found.json")).get_payment("pay_nope")
    assert info.value.message == "orchestrator: The payment with id pay_nope was not found"
    assert info.value.details["api_error_code"] == "ResourceNotFound"


def test_the_payment_status_webhook_as_documented_is_recorded(container):
    co = create_checkout(container, "user_c2", "credits-pro-USD-monthly")
    body = contract("webhook_payment_status.json")
    body["signedAt"] = str(int(time.time()))
    body["payment"]["orderId"] = body["payment"]["metadata"]["subscription_id"] = co["order_id"]
    raw = json.dumps(body).encode()
    client = create_public_app(container=container).test_client()
    signature = sign_body(container.settings.secret("orchestrator_webhook_secret"), raw)
    response = client.post("/webhooks/orchestrator/payments", data=raw, headers={"X-Signature-Primary": signature})
    assert response.status_code == 200 and response.get_json()["outcome"] == "recorded"
    with container.uow() as uow:
        assert uow.execute(select(purchase.c.user_id).where(purchase.c.transaction_id == "pay_contract_2")).scalar() \
            == "user_c2"


def test_a_refund_notification_saying_the_processor_refused_it_alerts_and_takes_nothing_back(container):
    """Decision 174: the refund's final state is the latest REFUND transaction's processorStatus; FAILED is
    news (one alert, counted), and nothing is reversed. Delivered twice, it is one event."""
    from billingctl.adapters.db.tables import alert_outbox
    from billingctl.services.payments import REFUND_FAILED_TEXT

    co = create_checkout(container, "user_c2", "credits-pro-USD-monthly")
    client = create_public_app(container=container).test_client()
    secret = container.settings.secret("orchestrator_webhook_secret")
    refused = "webhook_payment_refund_failed.json"
    for name in ("webhook_payment_status.json", refused, refused):
        body = contract(name)
        body["signedAt"] = str(int(time.time()))
        body["payment"]["orderId"] = body["payment"]["metadata"]["subscription_id"] = co["order_id"]
        raw = json.dumps(body).encode()
        response = client.post("/webhooks/orchestrator/payments", data=raw,
                               headers={"X-Signature-Primary": sign_body(secret, raw)})
        assert response.status_code == 200, response.get_json()
    with container.uow() as uow:
        keys = uow.execute(select(alert_outbox.c.dedupe_key, alert_outbox.c.payload).where(
            alert_outbox.c.dedupe_key.like("refund-failed:%"))).all()
        credits = uow.execute(select(purchase.c.credits).where(purchase.c.transaction_id == "pay_contract_2")).scalar()
        reversed_ = uow.ledger.reversed_for("pay_contract_2")
    assert [(k, p["text"]) for k, p in keys] == [
        ("refund-failed:pay_contract_2:1", REFUND_FAILED_TEXT.format(payment_id="pay_contract_2"))]
    assert credits == 2000 and reversed_ == 0
    assert container.metrics.registry.get_sample_value("billing_payments_held_total", {"reason": "refund_failed"}) == 1


def test_the_dispute_webhook_as_documented_is_recorded(container):
    raw = json.dumps(contract("dispute_opened.json")).encode()
    client = create_public_app(container=container).test_client()
    signature = sign_body(container.settings.secret("orchestrator_disputes_secret"), raw)
    response = client.post("/webhooks/orchestrator/disputes", data=raw, headers={"X-Signature-Primary": signature})
    assert response.status_code == 200 and response.get_json()["outcome"] == "recorded"
    with container.uow() as uow:
        [row] = uow.execute(select(fraud_event)).mappings().all()
    assert row["metadata"]["dispute_id"] == "dp_1NvZ3kKx" and row["metadata"]["payment_id"] == "pay_contract_1"
    unsigned = client.post("/webhooks/orchestrator/disputes", data=raw)
    assert unsigned.status_code == 401


# ---- typed at the edge (issue 34): services read a Payment, never Primer's dict -------------------------

def counting_client(status: int, body: dict) -> tuple[OrchestratorClient, list]:
    failures = []
    transport = httpx.MockTransport(lambda request: httpx.Response(status, json=body))
    http = httpx.Client(base_url="http://orchestrator.test", transport=transport)
    return OrchestratorClient(ResilientClient("orchestrator", http, policy=HttpPolicy(max_attempts=1),
                                              sleep=lambda s: None, on_error=failures.append)), failures


def test_a_payment_is_read_into_its_typed_copy_by_primers_names_and_given_back_as_sent():
    from billingctl.adapters.payloads import Payment

    sent = contract("webhook_payment_status.json")["payment"]
    payment, _ = counting_client(200, sent)
    read = payment.get_payment(sent["id"])
    assert isinstance(read, Payment)
    assert (read.order_id, read.customer_id, read.currency_code, read.charged) == (
        sent["orderId"], sent["customerId"], sent["currencyCode"], sent["amount"])
    assert (read.processor.name, read.processor.merchant_id) == (
        sent["processor"]["name"], sent["processor"]["processorMerchantId"])
    assert read.payment_method.token == sent["paymentMethod"]["paymentMethodToken"]
    assert read.wire() == sent  # nothing defaulted, nothing dropped (unknown fields kept)


@pytest.mark.parametrize("broken", [{"amount": "lots"}, {"status": None}, {"metadata": {"subscription_id": 1.5}},
                                    {"processor": "SFW_STRIPE"}, {"orderId": "o" * 65}])
def test_an_answer_in_a_shape_primer_does_not_document_is_a_counted_external_error(broken):
    payment = contract("webhook_payment_status.json")["payment"] | broken
    client, failures = counting_client(200, payment)
    with pytest.raises(e.ExternalPayloadInvalid, match="the orchestrator answered a payment we cannot read"):
        client.get_payment(payment["id"])
    assert [(f.code, f.details["dependency"]) for f in failures] == [("external_payload_invalid", "orchestrator")]


def test_one_unreadable_entry_of_a_list_is_skipped_named_and_counted_and_the_others_are_read(caplog):
    page = contract("payments_list_page.json")
    good = page["data"][0]
    page["data"] = [good | {"id": "pay_bad", "amount": -5}, good]
    client, failures = counting_client(200, page)
    with caplog.at_level("ERROR", logger="billingctl.http"):
        assert [p.id for p in client.list_payments("SETTLED")] == [good["id"]]
    assert [r.entry_id for r in caplog.records] == ["pay_bad"]
    assert [f.code for f in failures] == ["external_payload_invalid"]


def test_no_service_reads_primers_spelling_of_a_field():
    """The services read the typed copy: a Primer field name in a subscript or .get() there is a vendor
    dict read past the edge."""
    import re

    root = Path(__file__).parents[2] / "billingctl"
    primer = "|".join(("orderId", "customerId", "currencyCode", "paymentMethod", "paymentType", "paymentMethodToken",
                       "amountRefunded", "amountCaptured", "processorMerchantId", "statusReason", "paymentId",
                       "processorDisputeId", "processorId", "paymentMethodType", "paymentMethodData",
                       "expirationYear", "expirationMonth", "clientToken", "clientExpirationDate"))
    pattern = re.compile(r"""(\.get\(|\[)["'](""" + primer + r""")["']""")
    readers = [path for path in sorted((root / "services").rglob("*.py")) + sorted((root / "domain").glob("*.py"))
               + [root / "cli" / "payments.py"]
               if pattern.search(path.read_text())]
    assert readers == []


def test_vaulted_instruments_are_typed_and_one_the_renewal_rules_can_judge(container):
    """Primer sends the card's expiry as digits in strings; a wallet has none (the processor decides)."""
    from datetime import UTC, datetime

    from billingctl.domain.instruments import stored_instrument, usable_card

    page = {"data": [
        {"token": "tok_old", "paymentMethodType": "PAYMENT_CARD", "default": True,
         "paymentMethodData": {"last4Digits": "4242", "expirationMonth": "12", "expirationYear": "2020"}},
        {"token": "tok_paypal", "paymentMethodType": "PAYPAL", "paymentMethodData": {"email": "a@b.test"}},
        {"token": "tok_new", "paymentMethodType": "PAYMENT_CARD",
         "paymentMethodData": {"expirationMonth": "01", "expirationYear": "2035"}},
        {"token": None, "paymentMethodType": "PAYMENT_CARD"}]}
    client, failures = counting_client(200, page)
    found = client.list_payment_instruments("user_1")
    assert [i.token for i in found] == ["tok_old", "tok_paypal", "tok_new"]  # the tokenless one: skipped, counted
    assert [f.code for f in failures] == ["external_payload_invalid"]
    now = datetime(2026, 11, 26, tzinfo=UTC)
    assert stored_instrument(found).token == "tok_old"
    assert [i.token for i in found if usable_card(i, now)] == ["tok_new"]


def test_a_delivery_without_a_2xx_answer_is_retried_signed_afresh_until_the_schedule_ends(container):
    """Primer retries a webhook that gets no 2xx answer (Configure webhooks, "Delivery model"); each attempt
    is signed at its own time, as the receiver accepts `signedAt` only within five minutes. A 2xx answer
    ends the retries; after the fifth retry (about 31 minutes on) the event is dropped."""
    from billingctl.sandbox.model import WEBHOOK_RETRIES, Sandbox
    from billingctl.sandbox.store import SandboxStore

    answers, seen = [500, None, 429], []

    def receiver(path, body, headers):
        seen.append((json.loads(body)["signedAt"], headers["X-Signature-Primary"] == sign_body("s", body)))
        answer = answers.pop(0) if answers else 200
        if answer is None:
            raise httpx.ConnectError("refused")
        return answer

    sandbox = Sandbox(SandboxStore(container.settings.sandbox_db), webhook_secret="s", deliver=receiver)
    payment = {"id": "pay_1", "status": "SETTLED"}
    assert sandbox.send_webhook("PAYMENT.STATUS", payment) == 500
    assert sandbox.redeliver_due() == []  # not due yet
    codes = []
    for wait in WEBHOOK_RETRIES[:3]:
        sandbox.store.advance_clock(wait)
        codes += sandbox.redeliver_due()
    assert codes == [None, 429, 200] and sandbox.store.all("webhook_retry") == []
    assert [signed for _, signed in seen] == [True] * 4
    assert len({at for at, _ in seen}) == 4  # each attempt signed at its own time

    answers[:] = [503] * 10
    sandbox.send_webhook("PAYMENT.STATUS", payment)
    for wait in WEBHOOK_RETRIES:
        sandbox.store.advance_clock(wait)
        sandbox.redeliver_due()
    assert len(answers) == 10 - 1 - 5  # the first attempt and five retries, then none
    assert sum(WEBHOOK_RETRIES) == 1870  # ~10 s, ~60 s, ~5, ~10 and ~15 minutes
    assert sandbox.store.all("webhook_retry") == []
