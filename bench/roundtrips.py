"""Round trips per operation at production shape (PostgreSQL and Redis), counted by the servers' side of
the wire (libpq's protocol trace and Redis's commandstats; `tests.helpers.RoundTrips`):
a duplicate recording, a duplicate webhook, a new payment by webhook up to its answer (inbox, recording,
lock, outbox) and its follow-ups once the answer is sent (the provider's invoice and the activation, with
the in-process sandbox standing in for the provider)."""

from __future__ import annotations

import json
import time

from bench.common import container, seed_payments, workdir
from billingctl.sandbox.model import sign_body
from tests.helpers import RoundTrips

GOALS = {"duplicate_recording": {"pg": 1, "redis": 0}, "duplicate_webhook": {"pg": 2, "redis": 0},
         "new_payment_by_webhook": {"pg": 12, "redis": 4}, "its_followups_after_the_answer": None}


def _post(client, c, payment, buffered: bool = True):
    body = json.dumps({"eventType": "PAYMENT.STATUS", "signedAt": str(int(time.time())), "payment": payment})
    signature = sign_body(c.settings.secret("orchestrator_webhook_secret"), body.encode())
    return client.post("/webhooks/orchestrator/payments", data=body, content_type="application/json",
                       headers={"X-Signature-Primary": signature}, buffered=buffered)


def measure(database_url: str, redis_url: str | None) -> dict:
    from billingctl.services.payments import record_payment
    from webhooks_app import create_public_app

    c = container(database_url, workdir(), redis_url=redis_url)
    counter = RoundTrips(c, redis_url)
    client = create_public_app(container=c).test_client()
    warmup, first, second = seed_payments(c, 3, prefix="rt")
    assert _post(client, c, warmup).status_code == 200  # warm: statement caches, the catalog, the pool
    out = {}
    with counter.measure() as new:  # up to the answer: the provider follow-ups run once it is sent
        response = _post(client, c, first, buffered=False)
        assert response.status_code == 200
    out["new_payment_by_webhook"] = new
    with counter.measure() as followups:
        response.close()
    out["its_followups_after_the_answer"] = followups
    with counter.measure() as dup_hook:
        assert _post(client, c, first).status_code == 200
    out["duplicate_webhook"] = dup_hook
    record_payment(c, second, "webhook")
    with counter.measure() as dup_rec:
        record_payment(c, second, "webhook")
    out["duplicate_recording"] = dup_rec
    counter.close()
    c.close()
    return {name: {"pg": v["pg"], "redis": v["redis"], "goal": GOALS[name],
                   "met": GOALS[name] is None or (v["pg"] <= GOALS[name]["pg"] and v["redis"] <= GOALS[name]["redis"]),
                   "statements": v["statements"], "redis_commands_executed": v["redis_commands_executed"]}
            for name, v in out.items()}


def run(database_url: str, redis_url: str) -> dict:
    return measure(database_url, redis_url)


if __name__ == "__main__":
    from bench.common import standalone

    standalone(run)
