"""`billingctl sandbox …` as an operator runs it: serve on loopback, catalog, faults, alerts."""

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.helpers import billingctl
from tests.servers import free_port

pytestmark = pytest.mark.e2e




@pytest.fixture
def env(tmp_path):
    return {"BILLING_DATABASE_URL": f"sqlite:///{tmp_path / 'b.db'}", "BILLING_SANDBOX_DB": str(tmp_path / 's.db')}


def test_sandbox_serve_speaks_the_wire_contract_on_loopback(env):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "billingctl", "sandbox", "serve", "--port", str(port)],
                            env={"PATH": os.environ["PATH"], **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                httpx.get(base, timeout=0.2)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        unauth = httpx.get(f"{base}/provider/api/v2/item_prices")
        assert unauth.status_code == 401
        page = httpx.get(f"{base}/provider/api/v2/item_prices", headers={"Authorization": "Bearer k"}).json()
        lanes = {row["item_price"]["metadata"]["lane"] for row in page["list"]}
        assert lanes == {"sfw", "nsfw"}
        session = httpx.post(f"{base}/orchestrator/client-session", headers={"X-API-KEY": "k"},
                             json={"orderId": "inv_9", "customerId": "u", "amount": 999, "currencyCode": "USD"})
        assert session.status_code == 200 and session.json()["clientToken"]
    finally:
        proc.terminate()
        proc.wait(10)


def test_catalog_fault_and_clock_verbs(env):
    catalog = json.loads(billingctl(["--json", "sandbox", "catalog"], env).stdout)
    assert {row["lane"] for row in catalog} == {"sfw", "nsfw"}
    assert all(row["credits"] > 0 and row["amount"] > 0 for row in catalog)
    bad = billingctl(["sandbox", "fault", "provider", "explode"], env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert billingctl(["sandbox", "fault", "provider", "429", "--count", "1"], env).returncode == 0
    before = json.loads(billingctl(["--json", "sandbox", "clock"], env).stdout)["now"]
    after = json.loads(billingctl(["--json", "sandbox", "clock", "3600"], env).stdout)["now"]
    assert after - before >= 3600


def test_pay_for_an_unknown_order_is_refused_cleanly(env):
    result = billingctl(["sandbox", "pay", "inv_nope"], env)
    assert result.returncode == 3
    assert result.stderr.strip() == "error: No checkout session for order inv_nope"


def test_alerts_send_and_list(env):
    sent = billingctl(["--json", "alerts", "send", "hello ops", "--key", "k1"], env)
    assert json.loads(sent.stdout)["queued"] is True
    again = billingctl(["--json", "alerts", "send", "hello ops", "--key", "k1"], env)
    assert json.loads(again.stdout)["queued"] is False
    rows = json.loads(billingctl(["--json", "alerts", "list"], env).stdout)
    assert [(r["dedupe_key"], r["status"]) for r in rows] == [("k1", "pending")]
