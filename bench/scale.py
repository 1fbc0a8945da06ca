"""At production scale on PostgreSQL: the hot lookups (the refund reversal's sum under the user's row lock,
the purchase of an invoice, the velocity watch) at 1M ledger rows, and the peak memory of `billingctl
reconcile` at 10k and at 1M ledger rows (its own books are checked in SQL, so it should stay flat)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import psycopg

from bench.common import median, workdir
from tests.conftest import _truncate_postgres

MAXRSS = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, "
          "stderr=subprocess.PIPE, text=True); print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN)"
          ".ru_maxrss)")

HOT = {
    # The refund reversal reads what was already reversed for one payment while it holds the user's row.
    "refund_reversal": ("SELECT credits FROM users WHERE id = %(user)s FOR UPDATE",
                        "SELECT coalesce(sum(amount), 0) FROM credit_ledger WHERE payment_id = %(payment)s "
                        "AND reason = 'refund'"),
    "purchase_by_invoice": ("SELECT id FROM purchase WHERE invoice_id = %(invoice)s",),
    "velocity_watch": ("SELECT customer_id, count(*) FROM transaction WHERE status = 'captured' "
                       "AND created_at > now() - interval '1 minute' GROUP BY customer_id",),
}


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def seed(url: str, ledger_rows: int) -> None:
    """`ledger_rows` settled payments over 10,000 users, 90 days old (outside the window reconcile reads
    from the external systems): a purchase, a captured transaction and a ledger row each, and each user's
    credits equal to its ledger, a clean book as reconcile expects."""
    _truncate_postgres(url)
    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        conn.execute("INSERT INTO users (id, created_at, credits) SELECT 'u' || g, now(), 0 "
                     "FROM generate_series(0, 9999) g")
        conn.execute("INSERT INTO purchase (invoice_id, transaction_id, subscription_id, user_id, item_price_id, "
                     "amount, currency_code, credits, processor, recorded_via, created_at, provider_recorded_at) "
                     "SELECT 'inv_' || g, 'pay_' || g, 'sub_' || g, 'u' || (g %% 10000), 'credits-basic-USD-monthly', "
                     "999, 'USD', 10, 'SFW_STRIPE', 'webhook', now() - interval '90 days', now() - interval '90 days' "
                     "FROM generate_series(1, %s) g", (ledger_rows,))
        conn.execute("INSERT INTO transaction (transaction_id, amount, status, created_at, customer_id) "
                     "SELECT 'pay_' || g, 999, 'captured', now() - interval '90 days' - (g || ' seconds')::interval, "
                     "'u' || (g %% 10000) FROM generate_series(1, %s) g", (ledger_rows,))
        conn.execute("INSERT INTO credit_ledger (user_id, amount, source_key, reason, payment_id, created_at) "
                     "SELECT 'u' || (g %% 10000), 10, 'payment:pay_' || g, 'payment', 'pay_' || g, "
                     "now() - interval '90 days' FROM generate_series(1, %s) g", (ledger_rows,))
        conn.execute("UPDATE users SET credits = l.total FROM (SELECT user_id, sum(amount) AS total "
                     "FROM credit_ledger GROUP BY user_id) l WHERE l.user_id = users.id")
        conn.execute("ANALYZE")


def hot_lookups(url: str, runs: int = 300) -> dict:
    out = {}
    with psycopg.connect(_libpq(url)) as conn:
        for name, statements in HOT.items():
            samples = []
            for i in range(runs):
                params = {"user": f"u{i % 10000}", "payment": f"pay_{i * 7 + 1}", "invoice": f"inv_{i * 7 + 1}"}
                started = time.perf_counter()
                for sql in statements:
                    conn.execute(sql, params).fetchall()
                conn.commit()
                samples.append(time.perf_counter() - started)
            ordered = sorted(samples)
            out[name] = {"median_ms": round(median(samples) * 1000, 3),
                         "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))] * 1000, 3), "goal_ms": 1.0}
            out[name]["met"] = out[name]["median_ms"] < 1.0
    return out


def reconcile_peak_mib(url: str, wd) -> dict:
    billingctl = shutil.which("billingctl") or os.path.join(os.path.dirname(sys.executable), "billingctl")
    env = {"PATH": os.environ["PATH"], "BILLING_DATABASE_URL": url, "BILLING_SANDBOX_DB": str(wd / "sandbox.db")}
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", MAXRSS, billingctl, "--json", "reconcile"], env=env,
                         capture_output=True, text=True, timeout=1800).stdout.split()
    return {"exit_code": int(out[0]), "peak_mib": round(int(out[1]) / 1024, 1),
            "seconds": round(time.perf_counter() - started, 1)}


def run(url: str, small: int = 10_000, large: int = 1_000_000) -> dict:
    wd = workdir()
    result = {"ledger_rows": {"small": small, "large": large}}
    seed(url, small)
    result["reconcile_small"] = reconcile_peak_mib(url, wd)
    seed(url, large)
    result["reconcile_large"] = reconcile_peak_mib(url, wd)
    result["reconcile_memory_ratio"] = round(result["reconcile_large"]["peak_mib"]
                                             / result["reconcile_small"]["peak_mib"], 2)
    result["reconcile_goal_ratio"] = 1.2
    result["hot_lookups_at_large"] = hot_lookups(url)
    _truncate_postgres(url)
    return result


if __name__ == "__main__":
    from bench.common import standalone

    standalone(lambda url, _redis: run(url, large=int(os.environ.get("BENCH_SCALE_ROWS", "1000000"))))
