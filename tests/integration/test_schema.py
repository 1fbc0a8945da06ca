"""Migrations match the models, apply on both dialects, and the constraints carry the invariants."""

from datetime import UTC, datetime

import pytest
from sqlalchemy import insert, inspect, select
from sqlalchemy.exc import IntegrityError

from billingctl.adapters.db import tables as t
from billingctl.adapters.db.engine import make_engine
from billingctl.adapters.db.migrate import head_revision, upgrade
from tests.conftest import create_database

pytestmark = pytest.mark.integration

NOW = datetime(2026, 11, 21, tzinfo=UTC)

SPEC_FIELDS = {
    "purchase": {"invoice_id", "transaction_id", "subscription_id", "user_id", "created_at"},
    "subscription": {"id", "status", "start_date", "current_term_end", "customer_id", "created_at",
                     "coupon_ids"},
    "invoice": {"id", "total_amount", "paid_at", "status"},
    "transaction": {"transaction_id", "amount", "status", "created_at", "customer_id"},
    "users": {"id", "email", "created_at", "credits"},
    "user_credits": {"user_id", "sfw_processor", "nsfw_processor", "nsfw_processor_mid", "deleted_at"},
    "fraud_event": {"user_id", "event_type", "created_at", "metadata"},
    "dunning_attempt": {"invoice_id", "created_at", "status", "decline_code"},
    "event_poller_state": {"created_at"},
    "login_attempt": {"user_id", "ip_address"},
}
OWN_TABLES = {"credit_ledger", "event_inbox", "checkout_session", "orphan_recovery", "alert_outbox",
              "job_lease", "audit_log", "poller_cursor"}


def test_migrations_at_head_match_the_models_on_postgresql(pg_server_url):
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(create_database(pg_server_url, "billing_migration_check"))
    before, after = upgrade(engine)
    assert (before, after) == (None, head_revision())
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), t.metadata)
    engine.dispose()
    assert diff == []


def test_migrations_apply_on_sqlite_and_are_rerunnable(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'fresh.db'}")
    upgrade(engine)
    assert upgrade(engine) == (head_revision(), head_revision())
    names = set(inspect(engine).get_table_names())
    engine.dispose()
    assert set(SPEC_FIELDS) | OWN_TABLES <= names


def test_spec_field_names_exist(container):
    inspector = inspect(container.engine)
    for table, fields in SPEC_FIELDS.items():
        columns = {c["name"] for c in inspector.get_columns(table)}
        assert fields <= columns, (table, fields - columns)


def _user(uow, user_id="u1"):
    uow.execute(insert(t.users).values(id=user_id, email=f"{user_id}@x.test", created_at=NOW))


def test_unit_of_work_rolls_back_unless_committed(container):
    with container.uow() as uow:
        _user(uow, "gone")
    with container.uow() as uow:
        _user(uow, "kept")
        uow.commit()
    with container.uow() as uow:
        ids = set(uow.execute(select(t.users.c.id)).scalars())
    assert ids == {"kept"}


def test_timestamps_come_back_timezone_aware_utc(container):
    with container.uow() as uow:
        _user(uow)
        uow.commit()
    with container.uow() as uow:
        created = uow.execute(select(t.users.c.created_at)).scalar_one()
    assert created == NOW and created.tzinfo is not None


@pytest.mark.parametrize(
    ("table", "row"),
    [
        (t.purchase, {"transaction_id": "pay_1", "subscription_id": "s", "user_id": "u1", "created_at": NOW}),
        (t.credit_ledger, {"user_id": "u1", "amount": 10, "source_key": "payment:pay_1", "reason": "payment",
                           "created_at": NOW}),
        (t.event_inbox, {"source": "provider", "event_id": "ev_1", "event_type": "x", "payload": {},
                         "received_at": NOW}),
        (t.alert_outbox, {"sink": "chat", "dedupe_key": "k", "payload": {}, "created_at": NOW}),
        (t.user_credits, {"user_id": "u1", "created_at": NOW}),
    ],
)
def test_unique_keys_refuse_a_second_row(container, table, row):
    with container.uow() as uow:
        _user(uow)
        uow.execute(insert(table).values(**row))
        uow.commit()
    with pytest.raises(IntegrityError), container.uow() as uow:
        uow.execute(insert(table).values(**row))
    with container.uow() as uow:
        assert len(uow.execute(select(table)).all()) == 1


def test_soft_deleted_lane_rows_do_not_block_a_live_one(container):
    with container.uow() as uow:
        _user(uow)
        uow.execute(insert(t.user_credits).values(user_id="u1", created_at=NOW, deleted_at=NOW))
        uow.execute(insert(t.user_credits).values(user_id="u1", created_at=NOW))
        uow.commit()
    with container.uow() as uow:
        assert len(uow.execute(select(t.user_credits)).all()) == 2


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_the_hot_lookups_use_their_indexes_at_scale(container):
    """Issue "Performance" 6: the refund reversal's sum, the purchase of an invoice and the velocity watch
    scanned their tables (83 / 29 / 28 ms at production size). Seeded with generate_series, EXPLAIN shows
    each reads its index."""
    from sqlalchemy import text

    with container.engine.begin() as conn:
        conn.execute(text("INSERT INTO users (id, created_at, credits) VALUES ('u_scale', now(), 0)"))
        conn.execute(text(
            "INSERT INTO credit_ledger (user_id, amount, source_key, reason, payment_id, created_at) "
            "SELECT 'u_scale', 10, 'k' || g, 'payment', 'pay_' || g, now() FROM generate_series(1, 200000) g"))
        conn.execute(text(
            "INSERT INTO purchase (invoice_id, transaction_id, subscription_id, user_id, credits, created_at) "
            "SELECT 'inv_' || g, 'pay_' || g, 'sub_' || g, 'u_scale', 10, now() FROM generate_series(1, 100000) g"))
        conn.execute(text(
            "INSERT INTO transaction (transaction_id, amount, status, created_at, customer_id) "
            "SELECT 'pay_' || g, 100, 'captured', now() - (g || ' seconds')::interval, 'u_scale' "
            "FROM generate_series(1, 100000) g"))
        conn.execute(text("ANALYZE credit_ledger; ANALYZE purchase; ANALYZE transaction"))
        plans = {
            "refund": "SELECT coalesce(sum(amount), 0) FROM credit_ledger WHERE payment_id = 'pay_777' "
                      "AND reason = 'refund'",
            "invoice": "SELECT id FROM purchase WHERE invoice_id = 'inv_777'",
            "velocity": "SELECT customer_id, count(*) FROM transaction WHERE status = 'captured' "
                        "AND created_at > now() - interval '1 minute' GROUP BY customer_id",
        }
        for name, sql in plans.items():
            plan = "\n".join(r[0] for r in conn.execute(text("EXPLAIN " + sql)))
            assert "Index" in plan and "Seq Scan" not in plan, (name, plan)


def test_prune_removes_what_grows_for_ever_and_keeps_every_key(container):
    """Issue "Performance" 7: event_poller_state grew by 4 rows a minute for ever, and so did payloads,
    delivered outbox rows and the audit log."""
    from datetime import timedelta

    from sqlalchemy import func, insert, select

    from billingctl.adapters.db.tables import alert_outbox, audit_log, event_inbox, event_poller_state
    from billingctl.services.inbox import process_once
    from billingctl.services.retention import prune

    now = container.clock.now()
    old, recent = now - timedelta(days=500), now - timedelta(hours=1)
    with container.uow() as uow:
        for when in (old, recent):
            uow.execute(insert(event_poller_state).values(created_at=when))
            uow.execute(insert(alert_outbox).values(sink="chat", dedupe_key=f"k:{when}", payload={"text": "x"},
                                                    status="delivered", created_at=when, delivered_at=when))
            uow.execute(insert(audit_log).values(actor="ops", action="a", target="t", details={}, created_at=when))
            uow.execute(insert(event_inbox).values(source="orchestrator", event_id=f"ev:{when}", event_type="X",
                                                   payload={"big": "x" * 100}, status="processed", received_at=when,
                                                   processed_at=when, seen_by=[]))
        uow.commit()
    plan = prune(container, dry_run=True)
    assert plan["would_prune"] == {"poller_runs": 1, "inbox_payloads": 1, "delivered_outbox": 1, "audit_log": 1}
    assert prune(container)["pruned"] == plan["would_prune"]
    assert prune(container)["pruned"] == {"poller_runs": 0, "inbox_payloads": 0, "delivered_outbox": 0,
                                          "audit_log": 0}  # re-runnable
    with container.uow() as uow:
        for table in (event_poller_state, alert_outbox, audit_log):
            assert uow.execute(select(func.count()).select_from(table)).scalar_one() == 1
        kept = uow.execute(select(event_inbox.c.payload).where(event_inbox.c.event_id == f"ev:{old}")).scalar_one()
    assert kept == {}  # the row and its key stay: the event is still a duplicate
    again = process_once(container, "orchestrator", f"ev:{old}", "X", {"big": "x"}, lambda: {"outcome": "ran"})
    assert again["outcome"] == "duplicate"


def test_prune_works_in_short_batches_and_leaves_the_recent_rows(container, monkeypatch):
    """Issue 39 item 5: `db prune` deleted in one transaction (16.6 s at 1M rows, every writer of the table
    waiting). It now prunes in batches of PRUNE_BATCH rows, each its own transaction, until none is left."""
    from datetime import timedelta

    from sqlalchemy import func, insert, select

    from billingctl.adapters.db.tables import audit_log
    from billingctl.services import retention

    monkeypatch.setattr(retention, "PRUNE_BATCH", 7)
    now = container.clock.now()
    with container.uow() as uow:
        uow.execute(insert(audit_log), [{"actor": "ops", "action": "a", "target": f"t{i}", "details": {},
                                         "created_at": now - timedelta(days=900 if i < 40 else 1)}
                                        for i in range(45)])
        uow.commit()
    statements = []

    def count_deletes(conn, cursor, statement, *_):
        if statement.lstrip().upper().startswith("DELETE FROM AUDIT_LOG"):
            statements.append(statement)

    from sqlalchemy import event

    event.listen(container.engine, "before_cursor_execute", count_deletes)
    try:
        assert retention.prune(container)["pruned"]["audit_log"] == 40
    finally:
        event.remove(container.engine, "before_cursor_execute", count_deletes)
    assert len(statements) == 6  # 7+7+7+7+7+5: six short transactions, not one
    with container.uow() as uow:
        assert uow.execute(select(func.count()).select_from(audit_log)).scalar_one() == 5


def test_each_prune_batch_starts_after_the_rows_the_one_before_it_pruned(container, monkeypatch):
    """Issue 39 item 5, measured by `bench/prune.py`: each batch looked for its rows from the table's first
    id, so it read again every row the batches before it had pruned (an inbox event whose payload was
    emptied stays a row), and at 1M rows the prune took 138 s against 19 s in one transaction, its last
    batches past a second. A batch now starts after the highest id the one before it pruned."""
    from datetime import timedelta

    from sqlalchemy import insert, select

    from billingctl.adapters.db.books import Books
    from billingctl.adapters.db.tables import event_inbox
    from billingctl.services import retention

    now = container.clock.now()
    with container.uow() as uow:
        uow.execute(insert(event_inbox), [
            {"source": "provider", "event_id": f"ev_{i}", "event_type": "payment_succeeded", "payload": {"n": i},
             "status": "processed", "seen_by": [], "received_at": now - timedelta(days=90 if i < 40 else 1),
             "processed_at": now - timedelta(days=90 if i < 40 else 1)} for i in range(45)])
        uow.commit()
        ids = uow.execute(select(event_inbox.c.id).order_by(event_inbox.c.id)).scalars().all()
    cutoffs = {"poller_runs": now, "inbox_payloads": now - timedelta(days=30), "delivered_outbox": now,
               "audit_log": now}
    # A batch bounded below leaves the prunable rows at or under its bound for a later batch, or none.
    with container.uow() as uow:
        assert uow.books.prune_batch("inbox_payloads", cutoffs, 5, after=ids[9]) == (5, ids[14])
        uow.commit()
    with container.uow() as uow:
        rows = uow.execute(select(event_inbox.c.id, event_inbox.c.payload).order_by(event_inbox.c.id)).all()
    assert [row.id for row in rows if row.payload == {}] == ids[10:15]
    # The job's loop: each batch starts after the highest id the one before it pruned.
    calls = []
    real = Books.prune_batch

    def spy(self, name, cutoffs, batch, after=0):
        done = real(self, name, cutoffs, batch, after)
        calls.append((name, after, done))
        return done

    monkeypatch.setattr(Books, "prune_batch", spy)
    monkeypatch.setattr(retention, "PRUNE_BATCH", 7)
    assert retention.prune(container)["pruned"]["inbox_payloads"] == 35
    inbox = [(after, done) for name, after, done in calls if name == "inbox_payloads"]
    assert [after for after, _ in inbox] == [0] + [last for _, (_, last) in inbox[:-1]]
    # 7 × 5, and as the fifth was full a sixth that finds none
    assert [count for _, (count, _) in inbox] == [7, 7, 7, 7, 7, 0]
    with container.uow() as uow:
        payloads = uow.execute(select(event_inbox.c.payload).order_by(event_inbox.c.id)).scalars().all()
    assert payloads[:40] == [{}] * 40 and payloads[40:] == [{"n": i} for i in range(40, 45)]


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_revision_0018_names_the_subscription_of_a_checkout_row_opened_in_flight(dialect, tmp_path, request):
    """Decision 209: an in-flight report of a checkout's payment wrote its order id, the subscription id,
    as the row's invoice. The revision clears it and names the subscription (the purchase's, once moved
    by orphan recovery); a renewal's row, whose order id is its invoice, is kept."""
    from sqlalchemy import text

    url = (f"sqlite:///{tmp_path / 'old.db'}" if dialect == "sqlite" else
           create_database(request.getfixturevalue("pg_server_url"), "billing_revision_0018"))
    engine = make_engine(url)
    upgrade(engine, "0017")
    with engine.begin() as conn:
        conn.execute(insert(t.users).values(id="u", created_at=NOW))
        for sub in ("sub_old", "sub_new", "sub_renewed"):
            conn.execute(insert(t.subscription).values(id=sub, status="active", customer_id="u", created_at=NOW))
        conn.execute(insert(t.purchase).values(transaction_id="pay_moved", subscription_id="sub_new", user_id="u",
                                               created_at=NOW, amount=1, currency_code="USD"))
        for payment, invoice, sub in (("pay_flight", "sub_old", None), ("pay_moved", "sub_old", "sub_old"),
                                      ("pay_renewal", "inv_7", "sub_renewed")):
            conn.execute(insert(t.transaction).values(transaction_id=payment, amount=1, status="authorized",
                                                      created_at=NOW, invoice_id=invoice, subscription_id=sub))
    upgrade(engine)
    with engine.connect() as conn:
        rows = set(conn.execute(text('SELECT transaction_id, invoice_id, subscription_id FROM "transaction"')))
    engine.dispose()
    assert rows == {("pay_flight", None, "sub_old"), ("pay_moved", None, "sub_new"),
                    ("pay_renewal", "inv_7", "sub_renewed")}
