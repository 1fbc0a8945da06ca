"""`db prune` at 1,000,000 rows of each large target (issue 39 item 5: "no transaction longer than a second at
1M rows"): the audit log's old rows and the old processed inbox events' payloads (a million each), with a
day of recent rows it must keep, and the poller's runs and the delivered alerts (100,000 each). The prune
runs as the daily job runs it (its own container, bounded batches, each its own transaction); every
transaction's time is read from the engine's begin and commit. The baseline, in the same run on the same
rows seeded again: what the prune did before decision 142, one statement per target in one transaction."""

from __future__ import annotations

import time

import psycopg

from bench.common import container, median, workdir
from tests.conftest import _truncate_postgres

ROWS = 1_000_000
SMALL = 100_000
RECENT = 10_000  # a day of rows each target keeps


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def seed(url: str, rows: int = ROWS, small: int = SMALL) -> None:
    """Old rows (500 days: past every retention) and recent ones (an hour) in the four targets."""
    _truncate_postgres(url)
    payload = '{"event_type": "payment_succeeded", "content": {"invoice": {"id": "inv_x", "amount_paid": 999}}}'
    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        for count, age in ((rows, "500 days"), (RECENT, "1 hour")):
            conn.execute("INSERT INTO audit_log (actor, action, target, reason, details, created_at) "
                         "SELECT 'ops', 'lock clear', 'u' || g, 'bench', '{}', now() - %s::interval "
                         "FROM generate_series(1, %s) g", (age, count))
            conn.execute("INSERT INTO event_inbox (source, event_id, event_type, payload, status, seen_by, "
                         "received_at, processed_at) SELECT 'provider', %s || g, 'payment_succeeded', "
                         "%s::json, 'processed', '[\"poll\"]', now() - %s::interval, now() - %s::interval "
                         "FROM generate_series(1, %s) g", (f"ev_{age}_", payload, age, age, count))
        for count, age in ((small, "500 days"), (RECENT, "1 hour")):
            conn.execute("INSERT INTO event_poller_state (created_at, events_seen, events_processed, "
                         "events_failed) SELECT now() - %s::interval, 0, 0, 0 FROM generate_series(1, %s) g",
                         (age, count))
            conn.execute("INSERT INTO alert_outbox (sink, dedupe_key, payload, status, attempts, created_at, "
                         "delivered_at) SELECT 'chat', %s || g, '{}', 'delivered', 1, now() - %s::interval, "
                         "now() - %s::interval FROM generate_series(1, %s) g", (f"k_{age}_", age, age, count))
        conn.execute("VACUUM ANALYZE")


def _timed_prune(url: str) -> dict:
    """The prune as the job runs it; every transaction's seconds from its BEGIN to its COMMIT."""
    from sqlalchemy import event

    from billingctl.services.retention import PRUNE_BATCH, prune

    c = container(url, workdir())
    spans, opened = [], []
    event.listen(c.engine, "begin", lambda conn: opened.append(time.perf_counter()))
    for end in ("commit", "rollback"):  # a transaction that only read ends in a rollback
        event.listen(c.engine, end, lambda conn: spans.append(time.perf_counter() - opened.pop()) if opened else None)
    started = time.perf_counter()
    result = prune(c)
    seconds = time.perf_counter() - started
    c.close()
    return {"seconds": round(seconds, 2), "pruned": result["pruned"], "transactions": len(spans),
            "batch_rows": PRUNE_BATCH, "longest_transaction_s": round(max(spans), 3),
            "median_transaction_s": round(median(spans), 3)}


def _one_transaction(url: str) -> dict:
    """Before decision 142: each target in one statement, all in one transaction."""
    with psycopg.connect(_libpq(url)) as conn:
        started = time.perf_counter()
        conn.execute("DELETE FROM event_poller_state WHERE created_at < now() - interval '7 days'")
        conn.execute("UPDATE event_inbox SET payload = '{}' WHERE status = 'processed' "
                     "AND processed_at < now() - interval '30 days' AND length(payload::text) > 2")
        conn.execute("DELETE FROM alert_outbox WHERE status = 'delivered' AND delivered_at < now() - interval "
                     "'90 days'")
        conn.execute("DELETE FROM audit_log WHERE created_at < now() - interval '400 days'")
        conn.commit()
        return {"longest_transaction_s": round(time.perf_counter() - started, 3)}


def _left(url: str) -> dict:
    with psycopg.connect(_libpq(url)) as conn:
        return {"audit_log": conn.execute("SELECT count(*) FROM audit_log").fetchone()[0],
                "inbox_with_payload": conn.execute("SELECT count(*) FROM event_inbox WHERE "
                                                   "length(payload::text) > 2").fetchone()[0]}


def run(url: str, rows: int = ROWS) -> dict:
    seed(url, rows)
    batched = _timed_prune(url)
    batched["left"] = _left(url)
    seed(url, rows)
    before = _one_transaction(url)
    return {"rows": rows, "batched": batched, "one_transaction_before": before,
            "longest_vs_one_transaction": round(batched["longest_transaction_s"] / before["longest_transaction_s"], 3),
            "goal_longest_transaction_s": 1.0}


if __name__ == "__main__":
    import json

    from bench.common import postgres

    with postgres() as database_url:
        print(json.dumps(run(database_url), indent=2))
