"""Reconcile's cost per run as history grows (issue 36, item 2): at 10k, 100k and 1M settled payments of
history, each in our books (purchase, transaction, ledger row) and in the sandbox's lists (the orchestrator's
payments, the provider's paid invoices, their transactions and the subscriptions, 90 days old), plus one
day's traffic (100 payments in all three books), the daily run reads from its watermark: its time and its
calls to the orchestrator and the provider should not grow with history. The full pass (the refund window
and every subscription) is measured beside it at the smallest size.

`python -m bench.reconcile_window` runs it alone (BENCH_RECONCILE_SIZES=10000,100000 to choose sizes)."""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta

import psycopg

from bench.common import container, workdir
from bench.scale import _libpq, seed
from billingctl.services.cursors import write_value

DAY = 100  # the day's new payments
PLAN = "credits-basic-USD-monthly"


def _documents(first: int, last: int, at: float, prefix: str = "") -> dict[str, list[dict]]:
    """The three external books' copies of payments first..last (ids as bench.scale.seed writes ours)."""
    payments, invoices, transactions, subscriptions = [], [], [], []
    for g in range(first, last + 1):
        pay, inv, sub, user = f"pay_{prefix}{g}", f"inv_{prefix}{g}", f"sub_{prefix}{g}", f"u{g % 10000}"
        payments.append({"id": pay, "status": "SETTLED", "orderId": f"order_{prefix}{g}", "customerId": user,
                         "amount": 999, "currencyCode": "USD", "date": at,
                         "processor": {"name": "SFW_STRIPE", "processorMerchantId": "acct_1"},
                         "metadata": {"user_id": user, "subscription_id": sub, "item_price_id": PLAN, "lane": "sfw"}})
        invoices.append({"id": inv, "status": "paid", "subscription_id": sub, "customer_id": user, "total": 999,
                         "amount_paid": 999, "amount_due": 0, "currency_code": "USD", "date": int(at),
                         "paid_at": int(at), "updated_at": int(at), "resource_version": int(at * 1000),
                         "line_items": [{"entity_type": "plan_item_price", "entity_id": PLAN, "amount": 999}],
                         "linked_payments": [{"txn_id": f"txn_{prefix}{g}", "applied_amount": 999}]})
        transactions.append({"id": f"txn_{prefix}{g}", "type": "payment", "status": "success", "amount": 999,
                             "currency_code": "USD", "date": int(at), "updated_at": int(at), "customer_id": user,
                             "reference_number": pay, "payment_method": "other",
                             "linked_invoices": [{"invoice_id": inv, "applied_amount": 999}]})
        subscriptions.append({"id": sub, "customer_id": user, "status": "cancelled", "created_at": int(at),
                              "updated_at": int(at), "currency_code": "USD", "coupons": [], "deleted": False,
                              "subscription_items": [{"item_price_id": PLAN, "unit_price": 999}]})
    return {"payment": payments, "invoice": invoices, "transaction": transactions, "subscription": subscriptions}


def _seed_sandbox(store, first: int, last: int, at: float, prefix: str = "", chunk: int = 50_000) -> None:
    for start in range(first, last + 1, chunk):
        for kind, docs in _documents(start, min(last, start + chunk - 1), at, prefix).items():
            store.put_many(kind, docs)


def _seed_day(url: str, at_sql: str) -> None:
    """The day's payments in our books: recorded, on their invoices, credited."""
    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        conn.execute("INSERT INTO purchase (invoice_id, transaction_id, subscription_id, user_id, item_price_id, "
                     "amount, currency_code, credits, processor, recorded_via, created_at, provider_recorded_at) "
                     f"SELECT 'inv_d' || g, 'pay_d' || g, 'sub_d' || g, 'u' || (g % 10000), '{PLAN}', 999, 'USD', "
                     f"10, 'SFW_STRIPE', 'webhook', {at_sql}, {at_sql} FROM generate_series(1, {DAY}) g")
        conn.execute("INSERT INTO credit_ledger (user_id, amount, source_key, reason, payment_id, created_at) "
                     f"SELECT 'u' || (g % 10000), 10, 'payment:pay_d' || g, 'payment', 'pay_d' || g, {at_sql} "
                     f"FROM generate_series(1, {DAY}) g")
        conn.execute("UPDATE users SET credits = l.total FROM (SELECT user_id, sum(amount) AS total "
                     "FROM credit_ledger GROUP BY user_id) l WHERE l.user_id = users.id")
        conn.execute("ANALYZE")


def _run(c, full: bool = False) -> dict:
    from billingctl.services.reconcile import reconcile
    from billingctl.services.reconcile.local_books import check_local
    from billingctl.services.reconcile.rules import Findings

    store = c.sandbox.store
    before = {system: store.count_requests(system) for system in ("orchestrator", "provider")}
    started = time.perf_counter()
    report = reconcile(c, full=full)
    seconds = time.perf_counter() - started
    started = time.perf_counter()  # our own books' part of the same window
    since = report["window"]["since"]
    check_local(c, c.clock.now(), Findings({}), datetime.fromisoformat(since) if since else None)
    local = time.perf_counter() - started
    return {"seconds": round(seconds, 2), "our_books_seconds": round(local, 2),
            "orchestrator_calls": store.count_requests("orchestrator") - before["orchestrator"],
            "provider_calls": store.count_requests("provider") - before["provider"],
            "window": report["window"]["why"], "violations": sum(report["counts"].values())}


def at_size(url: str, history: int) -> dict:
    wd = workdir()
    seed(url, history)  # ours: purchases pay_1..N, 90 days old, credited
    c = container(url, wd)
    try:
        now = c.clock.now()
        old = (now - timedelta(days=90)).timestamp()
        started = time.perf_counter()
        c.sandbox.store.put_many("customer", [{"id": f"u{i}", "auto_collection": "off", "deleted": False,
                                               "created_at": int(old), "updated_at": int(old), "object": "customer",
                                               "card_status": "no_card", "preferred_currency_code": "USD"}
                                              for i in range(10_000)])
        _seed_sandbox(c.sandbox.store, 1, history, old)
        _seed_sandbox(c.sandbox.store, 1, DAY, (now - timedelta(hours=3)).timestamp(), prefix="d")
        _seed_day(url, "now() - interval '3 hours'")
        seeded = round(time.perf_counter() - started, 1)
        write_value(c, "reconcile_watermark", (now - timedelta(days=1)).isoformat())
        write_value(c, "reconcile_full_at", (now - timedelta(days=1)).isoformat())
        daily = _run(c)
        return {"history_payments": history, "seeding_seconds": seeded, "daily_run": daily,
                **({"full_pass": _run(c, full=True)} if history <= 10_000 else {})}
    finally:
        c.close()


def run(url: str, sizes=(10_000, 100_000, 1_000_000)) -> dict:
    result = {"day_payments": DAY, "sizes": [at_size(url, n) for n in sizes]}
    first, last = result["sizes"][0]["daily_run"], result["sizes"][-1]["daily_run"]
    result["daily_time_ratio_largest_vs_smallest"] = round(last["seconds"] / max(first["seconds"], 0.01), 2)
    calls = [r["orchestrator_calls"] + r["provider_calls"] for r in (last, first)]
    result["daily_calls_largest_vs_smallest"] = f"{calls[0]} vs {calls[1]}"
    return result


if __name__ == "__main__":
    from bench.common import standalone

    sizes = tuple(int(s) for s in os.environ.get("BENCH_RECONCILE_SIZES", "10000,100000,1000000").split(","))
    standalone(lambda url, _redis: run(url, sizes))
