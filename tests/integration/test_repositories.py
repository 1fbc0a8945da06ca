"""The repositories' contracts on SQLite and PostgreSQL, where a service's tests cannot tell a wrong
filter from a right one (the in-memory fakes of tests/fakes.py keep the same contracts)."""

from datetime import UTC, datetime, timedelta

import pytest

from billingctl.domain.quota import LONGEST

pytestmark = pytest.mark.integration

NOW = datetime(2026, 11, 1, 12, tzinfo=UTC)


def test_fraud_events_since_filters_on_user_type_and_strictly_after(container):
    now = container.clock.now()
    after = now - LONGEST
    with container.uow() as uow:
        for user, kind, at in (("u1", "authorization_attempt", after), ("u1", "authorization_attempt", now),
                               ("u1", "velocity_triggered", now), ("u2", "authorization_attempt", now),
                               ("u1", "authorization_attempt", after + timedelta(seconds=1))):
            uow.users.ensure(user, now)
            uow.fraud.add(user, kind, at, {"merchant_context": "full", "at": at.isoformat()})
        uow.commit()
        found = uow.fraud.since("u1", "authorization_attempt", after)
    assert sorted(created for created, _ in found) == [after + timedelta(seconds=1), now]


def test_fraud_event_keys_rename_and_remove_one_event(container):
    now = container.clock.now()
    with container.uow() as uow:
        uow.users.ensure("u1", now)
        assert uow.fraud.add("u1", "authorization_attempt", now, {})  # no key: always a new event
        assert uow.fraud.add("u1", "authorization_attempt", now, {}, "order:1")
        assert not uow.fraud.add("u1", "authorization_attempt", now, {}, "order:1")
        assert uow.fraud.add("u1", "authorization_attempt", now, {}, "order:2")
        assert uow.fraud.rename("order:1", "payment:1") and not uow.fraud.rename("order:9", "payment:9")
        uow.fraud.remove("order:2")
        assert [uow.fraud.exists(k) for k in ("order:1", "payment:1", "order:2")] == [False, True, False]
        uow.commit()


def test_orphan_status_is_the_rows_own(container):
    now = container.clock.now()
    with container.uow() as uow:
        for pid, status in (("pay_a", "retrying"), ("pay_b", "exhausted")):
            uow.orphans.open({"payment_id": pid, "user_id": "u", "status": status, "attempts": 0,
                              "settled_at": now, "created_at": now, "updated_at": now})
        uow.commit()
        assert [uow.orphans.status(p) for p in ("pay_a", "pay_b", "pay_c")] == ["retrying", "exhausted", None]


def _purchase(uow, payment_id, user="u1", subscription="sub_1", invoice=None, at=NOW):
    uow.purchases.add({"transaction_id": payment_id, "subscription_id": subscription, "user_id": user,
                       "invoice_id": invoice, "amount": 500, "credits": 100, "created_at": at})


@pytest.fixture
def uow(container):
    with container.uow() as uow:
        for user in ("u1", "u2"):
            uow.users.ensure(user, NOW)
        yield uow


def test_successful_transactions_on_a_processor_are_the_users_own(uow):
    now = NOW
    for tid, status, user, processor in (("t1", "captured", "u1", "NMI"), ("t2", "settled", "u1", "NMI"),
                                         ("t3", "failed", "u1", "NMI"), ("t4", "captured", "u2", "NMI"),
                                         ("t5", "captured", "u1", "SEGPAY")):
        uow.transactions.insert(tid, status, now, customer_id=user, processor=processor, amount=500)
    assert sorted(r[0] for r in uow.transactions.successes_on("u1", "NMI")) == ["t1", "t2"]


def test_a_transactions_status_moves_on_keeps_its_first_amount_and_learns_the_later_facts(uow):
    """A status move writes its time and the facts it brings (processor, merchant id), never a new amount
    (a status payload without one must not zero it) and never takes a captured payment back."""
    from billingctl.adapters.db.tables import transaction
    from billingctl.domain.lifecycle import PAYMENT

    later = NOW + timedelta(minutes=5)
    assert uow.transactions.insert("t0", "authorized", NOW, customer_id="u2", amount=300)  # another payment
    assert uow.transactions.insert("t1", "authorized", NOW, customer_id="u1", amount=500)
    assert not uow.transactions.insert("t1", "pending", NOW, customer_id="u1", amount=500)  # exists: not written
    assert uow.transactions.move("t1", "declined", PAYMENT.sources("declined"), later, amount=0, processor="NMI",
                                 processor_merchant_id="mid_1")
    assert uow.transactions.insert("t2", "captured", NOW, customer_id="u1", amount=700)
    assert not uow.transactions.move("t2", "declined", PAYMENT.sources("declined"), later, amount=700)
    rows = {r["transaction_id"]: r for r in uow.execute(transaction.select()).mappings()}
    t1, t2 = rows["t1"], rows["t2"]
    assert (t1["status"], t1["amount"], t1["processor"], t1["processor_merchant_id"]) == (
        "declined", 500, "NMI", "mid_1")
    assert (t1["created_at"].timestamp(), t1["updated_at"].timestamp()) == (NOW.timestamp(), later.timestamp())
    assert (t2["status"], t2["amount"], t2["updated_at"]) == ("captured", 700, None)
    assert (rows["t0"]["status"], rows["t0"]["processor"], rows["t0"]["updated_at"]) == ("authorized", None, None)

def test_the_first_merchant_id_is_the_earliest_success_on_that_processor_that_names_one(uow):
    now = NOW
    for minutes, tid, status, user, processor, mid in (
            (0, "t1", "captured", "u1", "SEGPAY", "mid_other_processor"),
            (1, "t2", "failed", "u1", "NMI", "mid_failed"),
            (2, "t3", "captured", "u1", "NMI", ""),
            (3, "t4", "captured", "u1", "NMI", None),
            (4, "t5", "captured", "u2", "NMI", "mid_other_user"),
            (5, "t6", "settled", "u1", "NMI", "mid_first"),
            (6, "t7", "captured", "u1", "NMI", "mid_second")):
        uow.transactions.insert(tid, status, now + timedelta(minutes=minutes), customer_id=user, processor=processor,
                              processor_merchant_id=mid, amount=500)
    assert uow.transactions.first_merchant_id("u1", "NMI") == "mid_first"
    assert uow.transactions.first_merchant_id("u2", "SEGPAY") is None


def test_a_users_recent_purchases_are_the_newest_first_up_to_the_limit(uow):
    for pid, user in (("p1", "u1"), ("p2", "u2"), ("p3", "u1"), ("p4", "u1")):
        _purchase(uow, pid, user=user)
    assert [p["transaction_id"] for p in uow.purchases.recent_of_user("u1", 2)] == ["p4", "p3"]
    assert [p["transaction_id"] for p in uow.purchases.recent_of_user("u1", 10)] == ["p4", "p3", "p1"]
    assert uow.purchases.count_of_user("u1") == 3


def test_purchases_without_an_invoice_and_moving_them_leave_invoiced_ones_alone(uow):
    now = NOW
    for pid, invoice in (("p1", None), ("p2", "inv_1"), ("p3", None)):
        _purchase(uow, pid, invoice=invoice)
        uow.transactions.insert(pid, "captured", now, customer_id="u1", subscription_id="sub_1", invoice_id=invoice,
                              amount=500)
    _purchase(uow, "p4", subscription="sub_other")
    assert sorted(p["transaction_id"] for p in uow.purchases.without_invoice("sub_1")) == ["p1", "p3"]
    uow.purchases.move_to("p1", "sub_2")
    uow.purchases.move_to("p2", "sub_2")  # on an invoice: stays
    assert [uow.purchases.by_payment_id(p)["subscription_id"] for p in ("p1", "p2", "p3")] == \
        ["sub_2", "sub_1", "sub_1"]
    from billingctl.adapters.db.tables import transaction

    found = dict(uow.execute(transaction.select().with_only_columns(transaction.c.transaction_id,
                                                                    transaction.c.subscription_id)).all())
    assert found == {"p1": "sub_2", "p2": "sub_1", "p3": "sub_1"}


def test_the_ledger_sums_per_user_and_counts_only_a_payments_refunds_as_reversed(uow):
    now = NOW
    for user in ("u1", "u2"):
        uow.users.ensure(user, now)
    for user, amount, key, reason, payment in (("u1", 100, "k1", "purchase", "p1"), ("u1", -30, "k2", "refund", "p1"),
                                               ("u1", -20, "k3", "refund", "p2"), ("u1", -5, "k4", "adjustment", "p1"),
                                               ("u2", 70, "k5", "purchase", "p3")):
        assert uow.ledger.apply(user, amount, key, reason, payment, now)
    assert not uow.ledger.apply("u1", 100, "k1", "purchase", "p1", now)  # the same source key: nothing
    assert (uow.ledger.sum_of_user("u1"), uow.ledger.sum_of_user("u2"), uow.ledger.sum_of_user("u3")) == (45, 70, 0)
    assert (uow.ledger.reversed_for("p1"), uow.ledger.reversed_for("p2"), uow.ledger.reversed_for("p9")) == (30, 20, 0)
    # the balance moves with each new entry only: the repeated source key added nothing to it
    assert (uow.users.get("u1")["credits"], uow.users.get("u2")["credits"]) == (45, 70)


def test_subscriptions_with_followups_leave_out_a_checkout_payment_handed_to_orphan_recovery(uow):
    for pid, subscription, invoice, orphaned, reported in (
            ("p_invoiced", "sub_a", "inv_a", False, False), ("p_plain", "sub_b", None, False, False),
            ("p_orphan", "sub_c", None, True, False), ("p_orphan_invoiced", "sub_d", "inv_d", True, False),
            ("p_reported", "sub_e", "inv_e", False, True)):
        _purchase(uow, pid, subscription=subscription, invoice=invoice)
        if orphaned:
            uow.orphans.open({"payment_id": pid, "user_id": "u1", "status": "retrying", "attempts": 0,
                              "settled_at": NOW, "created_at": NOW, "updated_at": NOW})
        if reported:
            uow.purchases.mark_reported(uow.purchases.by_payment_id(pid)["id"], NOW)
    found = uow.execute(uow.purchases.with_followups_subquery(NOW)).scalars().all()
    assert sorted(found) == ["sub_a", "sub_b", "sub_d"]
    # A renewal's payment waiting for the provider's own confirmation is not follow-up work yet (issue 39).
    from datetime import timedelta

    from sqlalchemy import update

    from billingctl.adapters.db.tables import purchase
    uow.execute(update(purchase).where(purchase.c.transaction_id == "p_invoiced")
                .values(confirm_after=NOW + timedelta(minutes=15)))
    assert sorted(uow.execute(uow.purchases.with_followups_subquery(NOW)).scalars().all()) == ["sub_b", "sub_d"]
    later = NOW + timedelta(minutes=15)
    assert sorted(uow.execute(uow.purchases.with_followups_subquery(later)).scalars().all()) == [
        "sub_a", "sub_b", "sub_d"]


def test_a_database_error_never_carries_its_statements_parameters(container):
    """Issue 37: errors logged with their traceback printed the SQL parameters (emails, payloads)."""
    from sqlalchemy import insert
    from sqlalchemy.exc import IntegrityError

    from billingctl.adapters.db.tables import users

    row = {"id": "u_pii", "email": "someone.private@example.com", "created_at": NOW}
    with container.uow() as uow:
        uow.execute(insert(users).values(**row))
        uow.commit()
    with pytest.raises(IntegrityError) as failed:
        with container.uow() as uow:
            uow.execute(insert(users).values(**row))
    assert "someone.private@example.com" not in str(failed.value)


def test_the_duplicate_read_on_the_drivers_cursor_reads_the_row_as_the_unit_of_work_does(container):
    """Issue 39 item 4: the duplicate's one read runs on the driver's cursor, compiled once. Whether a path
    delivered the event is an element of seen_by, decided by the database on both dialects, never a
    substring of its text, and a driver error is SQLAlchemy's, its parameters hidden."""
    from sqlalchemy import Column, MetaData, String, Table, bindparam, select
    from sqlalchemy.exc import DBAPIError

    from billingctl.adapters.db.inbox import seen
    from billingctl.adapters.db.sql import DriverStatement

    with container.uow() as uow:
        uow.inbox.accept("orchestrator", "evt_1", "PAYMENT.STATUS", {"a": 1}, None, NOW, "webhook")
        uow.inbox.accept("orchestrator", "evt_1", "PAYMENT.STATUS", {"a": 1}, None, NOW, "poller")
        uow.commit()
    engine = container.autocommit_engine
    assert seen(engine, "orchestrator", "evt_1", "poller") == {"status": "pending", "by_via": True}
    assert seen(engine, "orchestrator", "evt_1", "replay") == {"status": "pending", "by_via": False}
    # an element of the list, not a substring of its text
    assert seen(engine, "orchestrator", "evt_1", "web") == {"status": "pending", "by_via": False}
    assert seen(engine, "orchestrator", "evt_2", "webhook") is None
    assert seen(engine, "identity", "evt_1", "webhook") is None
    missing = Table("no_such_table", MetaData(), Column("secret", String))
    with pytest.raises(DBAPIError) as failed:
        read = DriverStatement(select(missing.c.secret).where(missing.c.secret == bindparam("s")))
        read.first(engine, {"s": "pii@x.io"})
    assert "pii@x.io" not in str(failed.value)
    # the pool lent a sound connection again
    assert seen(engine, "orchestrator", "evt_1", "webhook")["status"] == "pending"


def test_the_recordings_duplicate_read_on_the_drivers_cursor_is_the_statements_own_answer(uow, container):
    """The duplicate recording's one read (issue 39 item 4), on the driver's cursor: every column as the same
    statement answers through SQLAlchemy (times aware on SQLite, ints, NULLs), for a payment with a
    purchase and a checkout, and for one with neither."""
    from billingctl.adapters.db.purchases import _finished_statement, finished

    uow.users.ensure("u1", NOW)
    uow.checkouts.add(user_id="u1", subscription_id="sub_1", invoice_id=None, order_id="sub_1",
                      item_price_id="credits-pro-USD-monthly", lane="sfw", amount=2000, currency_code="USD",
                      client_token="tok", expires_at=NOW + timedelta(minutes=30), status="paid", created_at=NOW)
    _purchase(uow, "pay_1")
    uow.commit()
    for payment_id, order_id in (("pay_1", "sub_1"), ("pay_none", None), ("pay_none", "sub_1")):
        params = {"payment_id": payment_id, "order_id": order_id or ""}
        expected = dict(uow.execute(_finished_statement(), params).mappings().one())
        assert finished(container.autocommit_engine, payment_id, order_id) == expected
    row = finished(container.autocommit_engine, "pay_1", "sub_1")
    assert row["bought_subscription_id"] == "sub_1" and row["checkout_created_at"] == NOW
    assert row["checkout_amount"] == 2000


def test_a_hot_statement_in_the_unit_of_work_is_part_of_its_transaction_and_fails_as_sqlalchemy_does(container):
    """Decision 161: the new payment's hot statements run on the driver's cursor inside the unit of work.
    Uncommitted, they are gone with the transaction; a constraint is SQLAlchemy's IntegrityError, with its
    parameters hidden; a pooled connection found dead on the transaction's first statement is replaced."""
    from sqlalchemy import text
    from sqlalchemy.exc import IntegrityError

    from billingctl.adapters.db.locks import _lock_statement
    from billingctl.adapters.db.sql import on_driver

    lock = on_driver(_lock_statement(container.engine.dialect.name, "sfw_processor", ("sfw_processor",)))
    with container.uow() as uow:
        uow.users.ensure("u1", NOW)
        uow.commit()
    with container.uow() as uow:
        assert uow.first(lock, {"user_id": "u1", "created_at": NOW, "sfw_processor": "SFW_STRIPE"}) is not None
        assert uow.locks.read("u1")["sfw_processor"] == "SFW_STRIPE"  # the transaction's own write
    with container.uow() as uow:  # never committed
        assert uow.locks.read("u1") is None
    with pytest.raises(IntegrityError) as refused, container.uow() as uow:
        uow.first(lock, {"user_id": "nobody", "created_at": NOW, "sfw_processor": "SFW_PRIVATE"})
    assert "SFW_PRIVATE" not in str(refused.value)  # the parameters hidden (the key named by PostgreSQL's detail)
    if container.engine.dialect.name != "postgresql":
        return
    container.engine.pool.dispose()
    with container.uow() as uow:  # the pool's one connection
        pid = uow.execute(text("SELECT pg_backend_pid()")).scalar()
    with container.autocommit_engine.connect() as admin:
        admin.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    with container.uow() as uow:
        assert uow.first(lock, {"user_id": "u1", "created_at": NOW, "sfw_processor": "SFW_STRIPE"}) is not None
        uow.commit()
    with container.uow() as uow:
        assert uow.locks.read("u1")["sfw_processor"] == "SFW_STRIPE"
