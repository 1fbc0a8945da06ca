"""The walk a new user takes against the real systems' shape: `billingctl sandbox serve` on loopback,
the provider reached with BILLING_PROVIDER_AUTH=basic, every step a separate `billingctl` process (or
the public app for the front end's checkout): checkout, pay, record, activate, renewal due, renewal
charged exactly once, and the provider's own books (invoices, transactions) checked at the end."""

import json

import httpx
import pytest

from tests.e2e.test_user_api import token
from tests.helpers import billingctl, sandbox_served

pytestmark = pytest.mark.e2e
PRO = "credits-pro-USD-monthly"


@pytest.fixture
def served(tmp_path):
    sandbox_db = str(tmp_path / "served-sandbox.db")
    with sandbox_served({"BILLING_SANDBOX_DB": sandbox_db,
                         "BILLING_DATABASE_URL": f"sqlite:///{tmp_path / 'serve.db'}"}) as base:
        yield base, sandbox_db


def provider_books(base: str, path: str, **params) -> list[dict]:
    """The provider's own view, read the way the real one is read (Basic auth, the API key as user)."""
    page = httpx.get(f"{base}/provider/api/v2/{path}", params={"limit": 100, **params}, auth=("walk-key", "")).json()
    return [row[path.removesuffix("s")] for row in page["list"]]


def test_checkout_to_renewal_on_the_served_sandbox_with_basic_auth(served, db_url, tmp_path):
    from billingctl.bootstrap import Container
    from billingctl.settings import load_settings
    from webhooks_app import create_public_app

    base, sandbox_db = served
    env = {"BILLING_DATABASE_URL": db_url, "BILLING_SANDBOX_DB": sandbox_db, "BILLING_PROVIDER_AUTH": "basic",
           "BILLING_PROVIDER_URL": f"{base}/provider", "BILLING_PROVIDER_API_KEY": "walk-key",
           "BILLING_ORCHESTRATOR_URL": f"{base}/orchestrator", "BILLING_ORCHESTRATOR_API_KEY": "walk-key"}

    # The front end's checkout, through the public app, for a user the provider has never seen.
    c = Container(load_settings(**{k.removeprefix("BILLING_").lower(): v for k, v in env.items()}))
    try:
        client = create_public_app(container=c).test_client()
        session = {"Authorization": f"Bearer {token('walker', c.settings.secret('session_jwt_key'))}"}
        response = client.post("/api/billing/checkout", json={"item_price_id": PRO}, headers=session)
        assert response.status_code == 201, response.get_json()
        order_id = response.get_json()["order_id"]
        subs = provider_books(base, "subscriptions")
        assert [(s["id"], s["status"]) for s in subs] == [(order_id, "future")]  # the order id is the subscription
        assert provider_books(base, "invoices") == []  # a future subscription has no invoice yet
        status = client.get(f"/api/checkout/status?order_id={order_id}", headers=session)
        assert status.status_code == 200 and status.get_json()["status"] == "pending", status.get_json()
    finally:
        c.close()

    # The shopper pays; the webhook is lost; the operator records the payment by id.
    paid = json.loads(billingctl(["--json", "sandbox", "pay", order_id, "--drop-webhook"], env).stdout)
    recorded = json.loads(billingctl(["--json", "payments", "record", paid["id"]], env).stdout)
    assert recorded["outcome"] == "recorded" and recorded["credits_applied"] == 2000
    assert recorded["activation"] == "activated" and recorded["provider_recorded"] is True
    assert json.loads(billingctl(["--json", "activate", order_id], env).stdout)["outcome"] == "already_active"
    invoices = provider_books(base, "invoices")
    assert [(i["subscription_id"], i["status"]) for i in invoices] == [(order_id, "paid")]
    first_txn = httpx.get(f"{base}/provider/api/v2/transactions/{invoices[0]['linked_payments'][0]['txn_id']}",
                          auth=("walk-key", "")).json()["transaction"]
    assert first_txn["reference_number"] == paid["id"]

    # A month later the renewal is due: the dunning tick charges it once, however often it runs.
    assert billingctl(["sandbox", "clock", str(31 * 86400)], env).returncode == 0
    first = json.loads(billingctl(["--json", "renewals", "run"], env).stdout)
    assert first["outcomes"].get("succeeded") == 1, first
    again = json.loads(billingctl(["--json", "renewals", "run"], env).stdout)
    assert "succeeded" not in again["outcomes"] and again["errors"] == []

    # The outside world's books: two invoices, both paid, each by exactly one orchestrator payment.
    invoices = provider_books(base, "invoices")
    assert [i["status"] for i in invoices] == ["paid", "paid"]
    charges = [p for p in httpx.get(f"{base}/orchestrator/payments", params={"status": "SETTLED"},
                                    headers={"X-API-KEY": "walk-key"}).json()["data"]]
    assert sorted(p["orderId"] for p in charges) == sorted([order_id, invoices[1]["id"]])
    user = json.loads(billingctl(["--json", "users", "show", "walker"], env).stdout)
    assert (user["credits"], user["ledger_sum"]) == (4000, 4000)
    assert json.loads(billingctl(["--json", "reconcile"], env).stdout)["ok"] is True
