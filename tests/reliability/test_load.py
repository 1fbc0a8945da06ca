"""A bounded load test: 5,001 signed payment webhooks (a third of them repeats) from 8 concurrent
clients to gunicorn on loopback, on PostgreSQL. Zero 5xx, exactly-once credits; the run stops by itself
(fixed request count, per-request timeout, overall deadline)."""

import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy import func, select

from bench.common import seed_payments
from billingctl.adapters.db.tables import credit_ledger, purchase, users
from billingctl.sandbox.model import sign_body
from tests.servers import free_port, serving, stop_process

pytestmark = pytest.mark.reliability
UNIQUE, CLIENTS, DEADLINE = int(os.environ.get("LOAD_UNIQUE", 3334)), 8, 600
FIGURES: dict = {}


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_five_thousand_webhooks_through_gunicorn(settings, container, tmp_path):
    gunicorn = shutil.which("gunicorn") or os.path.join(os.path.dirname(sys.executable), "gunicorn")
    payments = seed_payments(container, UNIQUE, prefix="load")
    deliveries = payments + random.Random(7).sample(payments, UNIQUE // 2)  # a third of the 5,001 are repeats
    random.Random(11).shuffle(deliveries)
    port = free_port()
    # The provider's real limit, as in production: each webhook's follow-ups (start the subscription, record on
    # its invoice) run after its answer while the budget lasts and are left to the activations job after.
    env = {"PATH": os.environ["PATH"], "BILLING_DATABASE_URL": settings.database_url,
           "BILLING_SANDBOX_DB": settings.sandbox_db}
    log_file = open(tmp_path / "gunicorn.log", "wb")  # noqa: SIM115 - a pipe nobody reads would block the workers
    server = subprocess.Popen([gunicorn, "--bind", f"127.0.0.1:{port}", "--workers", "4", "--timeout", "60",
                               "--log-level", "warning",
                               "--no-control-socket", "webhooks_app.wsgi:public()"], env=env, cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=log_file)
    secret = container.settings.secret("orchestrator_webhook_secret")
    statuses: dict[int, int] = {}
    lock = threading.Lock()
    started = time.monotonic()
    try:
        serving(f"http://127.0.0.1:{port}/robots.txt")

        def send(chunk):
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                for payment in chunk:
                    if time.monotonic() - started > DEADLINE:
                        return
                    body = json.dumps({"eventType": "PAYMENT.STATUS", "signedAt": str(int(time.time())),
                                       "payment": payment}).encode()
                    code = client.post("/webhooks/orchestrator/payments", content=body,
                                       headers={"X-Signature-Primary": sign_body(secret, body),
                                                "Content-Type": "application/json"}).status_code
                    with lock:
                        statuses[code] = statuses.get(code, 0) + 1

        chunks = [deliveries[i::CLIENTS] for i in range(CLIENTS)]
        with ThreadPoolExecutor(CLIENTS) as pool:
            list(pool.map(send, chunks))
    finally:
        stop_process(server, 30)
        log_file.close()
    elapsed = time.monotonic() - started
    FIGURES.update(requests=sum(statuses.values()), statuses=statuses, seconds=round(elapsed, 1),
                   per_second=round(sum(statuses.values()) / elapsed, 1))
    print(f"load: {FIGURES}")
    assert sum(statuses.values()) == len(deliveries) >= min(5000, UNIQUE * 3 // 2)
    assert not any(code >= 500 for code in statuses), statuses
    assert statuses == {200: len(deliveries)}
    with container.uow() as uow:
        assert uow.execute(select(func.count()).select_from(purchase)).scalar_one() == UNIQUE
        assert uow.execute(select(func.count(func.distinct(purchase.c.transaction_id)))).scalar_one() == UNIQUE
        total = uow.execute(select(func.sum(users.c.credits))).scalar_one()
        ledger = uow.execute(select(func.sum(credit_ledger.c.amount))).scalar_one()
    assert total == ledger == UNIQUE * 1000  # the basic plan: 1000 credits
