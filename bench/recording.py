"""Recording under a duplicate storm on PostgreSQL: settled payments each delivered three times by N
workers through `record_payment`, against a minimal hand-written psycopg loop issuing the equivalent
statements with the same concurrency. Two figures for ours: the local recording (the SQL the baseline
mirrors) and the full path with the provider follow-ups through the in-process sandbox."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import psycopg

from bench.common import container, median, percentile, seed_payments, workdir
from billingctl.services.payments import record_payment
from tests.conftest import _truncate_postgres


def deliveries(payments: list[dict]) -> list[dict]:
    items = payments * 3
    random.Random(5).shuffle(items)
    return items


def timed(items, workers: int, deliver) -> dict:
    """Deliver every item from `workers` threads; throughput and per-delivery latency."""
    latencies: list[float] = []
    lock = threading.Lock()

    def one(payment):
        started = time.perf_counter()
        deliver(payment)
        with lock:
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, items))
    elapsed = time.perf_counter() - started
    return {"deliveries_per_s": round(len(items) / elapsed, 1), "payments_per_s": round(len(items) / 3 / elapsed, 1),
            "p50_ms": round(percentile(latencies, 50) * 1000, 2), "p99_ms": round(percentile(latencies, 99) * 1000, 2),
            "seconds": round(elapsed, 2)}


def run_ours(c, items, workers: int, followups: bool) -> dict:
    return timed(items, workers, lambda payment: record_payment(c, payment, "webhook", followups=followups))


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def baseline_one(conn, p: dict) -> None:
    now = datetime.now(UTC)
    meta = p["metadata"]
    with conn.transaction():
        conn.execute("SELECT status FROM subscription WHERE id = %s", (meta["subscription_id"],))
        conn.execute("INSERT INTO users (id, created_at, credits) VALUES (%s, %s, 0) ON CONFLICT (id) DO NOTHING",
                     (p["customerId"], now))
        new = conn.execute(
            "INSERT INTO purchase (invoice_id, transaction_id, subscription_id, user_id, item_price_id, amount, "
            "currency_code, credits, processor, recorded_via, settled_at, created_at) VALUES "
            "(%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s) ON CONFLICT (transaction_id) DO NOTHING RETURNING id",
            (p["orderId"], p["id"], meta["subscription_id"], p["customerId"], meta["item_price_id"], p["amount"],
             "USD", 1000, "SFW_STRIPE", "webhook", now, now)).fetchone()
        if new is None:
            conn.execute("SELECT subscription_id, user_id FROM purchase WHERE transaction_id = %s", (p["id"],))
            return
        conn.execute('INSERT INTO "transaction" (transaction_id, status, created_at, amount, currency_code, '
                     "customer_id, invoice_id, subscription_id, processor, processor_merchant_id) VALUES "
                     "(%s,'captured',%s,%s,'USD',%s,%s,%s,'SFW_STRIPE','acct_1') ON CONFLICT DO NOTHING "
                     "RETURNING transaction_id", (p["id"], now, p["amount"], p["customerId"], p["orderId"],
                                                  meta["subscription_id"]))
        conn.execute("INSERT INTO credit_ledger (user_id, amount, source_key, reason, payment_id, created_at) VALUES "
                     "(%s, 1000, %s, 'payment', %s, %s) ON CONFLICT (source_key) DO NOTHING RETURNING id",
                     (p["customerId"], f"payment:{p['id']}", p["id"], now))
        conn.execute("UPDATE users SET credits = credits + 1000 WHERE id = %s", (p["customerId"],))
        conn.execute("INSERT INTO invoice (id, created_at) VALUES (%s, %s) ON CONFLICT DO NOTHING RETURNING id",
                     (p["orderId"], now))
        conn.execute("UPDATE invoice SET subscription_id=%s, customer_id=%s, total_amount=%s, currency_code='USD', "
                     "status='paid', paid_at=%s WHERE id=%s",
                     (meta["subscription_id"], p["customerId"], p["amount"], now, p["orderId"]))
        conn.execute("INSERT INTO subscription (id, status, customer_id, created_at, coupon_ids, item_price_id, lane) "
                     "VALUES (%s,'future',%s,%s,'[]','credits-basic-USD-monthly','sfw') ON CONFLICT DO NOTHING "
                     "RETURNING id", (meta["subscription_id"], p["customerId"], now))
        conn.execute("UPDATE subscription SET activation_pending_since=%s WHERE id=%s AND status != 'active' AND "
                     "activation_pending_since IS NULL", (now, meta["subscription_id"]))
        row = conn.execute("SELECT * FROM user_credits WHERE user_id=%s AND deleted_at IS NULL",
                           (p["customerId"],)).fetchone()
        if row is None:
            conn.execute("INSERT INTO user_credits (user_id, created_at) VALUES (%s, %s) ON CONFLICT (user_id) "
                         "WHERE deleted_at IS NULL DO NOTHING", (p["customerId"], now))
            conn.execute("SELECT * FROM user_credits WHERE user_id=%s AND deleted_at IS NULL", (p["customerId"],))
        with conn.transaction():  # the savepoint
            conn.execute("UPDATE user_credits SET sfw_processor='SFW_STRIPE' WHERE user_id=%s AND deleted_at IS NULL "
                         "AND (sfw_processor IS NULL OR sfw_processor = '')", (p["customerId"],))
        conn.execute("INSERT INTO alert_outbox (sink, dedupe_key, payload, status, created_at) VALUES "
                     "('analytics', %s, '{}', 'pending', %s) ON CONFLICT (dedupe_key) DO NOTHING RETURNING id",
                     (f"analytics:payment:{p['id']}", now))


def run_baseline(url: str, items, workers: int) -> dict:
    local = threading.local()
    connections = []

    def deliver(payment):
        if not hasattr(local, "conn"):  # one connection per thread, opened on its first delivery
            local.conn = psycopg.connect(_libpq(url), autocommit=True)
            connections.append(local.conn)
        baseline_one(local.conn, payment)

    try:
        return timed(items, workers, deliver)
    finally:
        for conn in connections:
            conn.close()


def run(url: str, redis_url: str | None = None, payments_n: int = 2000, curve_n: int = 400, rounds: int = 3,
        durable_url: str | None = None) -> dict:
    """Interleaved rounds (ours, the baseline, ours, …) with Redis on for ours, medians reported; the
    full path once; the worker curve; one round on a durable (fsync=on) server when given."""
    result = {"payments": payments_n, "deliveries_each": 3, "rounds": rounds,
              "shape": "PostgreSQL (fsync off) + Redis" if redis_url else "PostgreSQL (fsync off), no Redis"}

    def fresh(n, database=url):
        _truncate_postgres(database)
        c = container(database, workdir(), redis_url=redis_url)
        c.engine.pool.dispose()
        return c, deliveries(seed_payments(c, n))

    ours, base = [], []
    for _ in range(rounds):
        c, items = fresh(payments_n)
        ours.append(run_ours(c, items, 8, followups=False))
        c.close()
        _truncate_postgres(url)
        base.append(run_baseline(url, items, 8))
    result["ours_local_8"] = _median_of(ours)
    result["baseline_8"] = _median_of(base)
    result["ratio_local_vs_baseline"] = round(result["ours_local_8"]["payments_per_s"]
                                              / result["baseline_8"]["payments_per_s"], 2)
    result["ratio_each_round"] = [round(o["payments_per_s"] / b["payments_per_s"], 2) for o, b in zip(ours, base,
                                                                                                      strict=True)]
    result["goal_ratio"] = 0.5
    c, items = fresh(payments_n)
    result["ours_full_8"] = run_ours(c, items, 8, followups=True)
    c.close()
    curve = {}
    for workers in (1, 2, 4, 8):
        c, items = fresh(curve_n)
        o = run_ours(c, items, workers, followups=False)
        c.close()
        _truncate_postgres(url)
        b = run_baseline(url, items, workers)
        curve[workers] = {"ours_payments_per_s": o["payments_per_s"], "baseline_payments_per_s": b["payments_per_s"],
                          "ratio": round(o["payments_per_s"] / b["payments_per_s"], 2)}
    result["curve"] = curve
    if durable_url:
        c, items = fresh(payments_n, durable_url)
        o = run_ours(c, items, 8, followups=False)
        c.close()
        _truncate_postgres(durable_url)
        b = run_baseline(durable_url, items, 8)
        result["durable_fsync_on"] = {"ours_local_8": o, "baseline_8": b,
                                      "ratio": round(o["payments_per_s"] / b["payments_per_s"], 2)}
    return result


def _median_of(runs: list[dict]) -> dict:
    return {key: median([r[key] for r in runs]) for key in runs[0]}
