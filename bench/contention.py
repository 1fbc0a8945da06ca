"""Webhook latency while a poller catch-up spends the provider budget, at production shape: PostgreSQL,
Redis, the real limit of 60 provider requests a minute, the public app under gunicorn, and the scheduled
command (`billingctl jobs run poll --loop`) catching up 10,000 provider events. Meanwhile new settled
payments arrive by webhook; each needs two provider calls (recording on the invoice, activation), which
take the money share. A web request never waits for the limiter: when the budget is spent it records the
payment, answers at once and leaves the follow-ups to the activations job."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import httpx
import psycopg

from bench.common import container, percentile, seed_payments, workdir
from bench.webhook import _gunicorn, unit_workers
from billingctl.sandbox.model import sign_body
from jobs.units import JOB_NICE

EVENTS = int(os.environ.get("BENCH_CATCH_UP_EVENTS", "10000"))
PAYMENTS = int(os.environ.get("BENCH_CONTENTION_PAYMENTS", "200"))
WARM = 6  # the first request of each worker loads the recording path; not measured
DEADLINE = float(os.environ.get("BENCH_CONTENTION_SECONDS", "420"))


def _inbox_count(url: str) -> int:
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        return conn.execute("SELECT count(*) FROM event_inbox WHERE source = 'provider' AND event_id LIKE 'ev_c%'")\
            .fetchone()[0]


def _pending_follow_ups(url: str) -> int:
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        # This benchmark's own payments only: in `make bench` the database holds the earlier benchmarks' rows.
        return conn.execute("SELECT count(*) FROM subscription WHERE activation_pending_since IS NOT NULL "
                            "AND id LIKE 'sub_ct_%'").fetchone()[0]


def run(database_url: str, redis_url: str) -> dict:
    wd = workdir()
    c = container(database_url, wd, redis_url=redis_url, provider_rate_limit=60)
    store = c.sandbox.store
    now = int(store.now())
    store.put_many("event", [{"id": f"ev_c{i:05d}", "occurred_at": now - 20_000 + i, "event_type": "customer_changed",
                              "content": {}} for i in range(EVENTS)])
    payments = seed_payments(c, PAYMENTS + WARM, prefix="ct")
    warm, payments = payments[:WARM], payments[WARM:]
    secret = c.settings.secret("orchestrator_webhook_secret")
    c.close()
    env = {"PATH": os.environ["PATH"], "BILLING_DATABASE_URL": database_url, "BILLING_REDIS_URL": redis_url,
           "BILLING_SANDBOX_DB": str(wd / "sandbox.db"), "BILLING_PROVIDER_RATE_LIMIT": "60",
           "BILLING_LOG_LEVEL": "WARNING", "PYTHONPATH": os.getcwd()}
    billingctl = shutil.which("billingctl") or os.path.join(os.path.dirname(sys.executable), "billingctl")
    app, port = _gunicorn("webhooks_app.wsgi:public()", env, os.getcwd())
    poll_out = wd / "poll.jsonl"
    started = time.monotonic()
    poll_err = wd / "poll.err"
    with open(poll_out, "w") as out, open(poll_err, "w") as err:
        # At the priority its unit gives it (Nice=, jobs/units.py): the web apps keep the default.
        poller = subprocess.Popen(["nice", "-n", str(JOB_NICE), billingctl, "--json", "jobs", "run", "poll", "--loop",
                                   "--interval", "5"], env=env, stdout=out, stderr=err)
    latencies, statuses, lock = [], {}, threading.Lock()
    client = httpx.Client(timeout=120)  # one client: its set-up is not the server's latency

    def send(payment):
        body = json.dumps({"eventType": "PAYMENT.STATUS", "signedAt": str(int(time.time())), "payment": payment})
        headers = {"Content-Type": "application/json", "X-Signature-Primary": sign_body(secret, body.encode())}
        t0 = time.perf_counter()
        answer = client.post(f"http://127.0.0.1:{port}/webhooks/orchestrator/payments", content=body,
                             headers=headers)
        with lock:
            latencies.append(time.perf_counter() - t0)
            statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1

    caught_up_at = None
    try:
        for payment in warm:
            send(payment)
        latencies.clear()
        statuses.clear()
        time.sleep(3)  # the catch-up is under way
        spacing = max(0.2, min(1.0, (DEADLINE / 2) / PAYMENTS))
        threads = []
        for payment in payments:  # a steady trickle of new payments through the catch-up
            thread = threading.Thread(target=send, args=(payment,))
            thread.start()
            threads.append(thread)
            time.sleep(spacing)
        for thread in threads:
            thread.join(180)
        while time.monotonic() - started < DEADLINE:
            if _inbox_count(database_url) >= EVENTS:
                caught_up_at = time.monotonic() - started
                break
            time.sleep(2)
    finally:
        client.close()
        poller.terminate()
        poller.wait(60)
        app.terminate()
        app.wait(30)
    runs = [json.loads(line) for line in poll_out.read_text().splitlines() if line.startswith("{")]
    results = [r.get("result", r) for r in runs]
    ordered = sorted(latencies)
    return {
        "shape": f"PostgreSQL + Redis, provider limit 60/min, gunicorn {unit_workers()} workers, "
                 f"`jobs run poll --loop` at nice {JOB_NICE}",
        "events": EVENTS, "webhooks": len(latencies), "webhook_statuses": statuses,
        "webhook_p50_ms": round(percentile(ordered, 50) * 1000, 1),
        "webhook_p99_ms": round(percentile(ordered, 99) * 1000, 1),
        "webhook_max_ms": round(ordered[-1] * 1000, 1) if ordered else None, "goal_p99_ms": 50,
        "poll_runs": len(runs), "poll_runs_paused_for_budget": sum(1 for r in results if r.get("budget_spent")),
        "poll_runs_with_error": sum(1 for r in results if r.get("error"))
        + sum(1 for line in poll_err.read_text().splitlines() if line.startswith("error:")),
        "events_in_inbox": _inbox_count(database_url),
        "payments_with_follow_ups_left_to_the_activations_job": _pending_follow_ups(database_url),
        "caught_up_after_s": round(caught_up_at, 1) if caught_up_at else None,
    }


if __name__ == "__main__":
    from bench.common import standalone

    standalone(run)
