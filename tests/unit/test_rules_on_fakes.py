"""Rules exercised on in-memory repositories (tests/fakes.py): the NSFW authorization quota as the
service applies it (spec section 3) and the processor lock's first write (spec section 2). The same
rules run against SQLite and PostgreSQL in tests/integration."""

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from billingctl.adapters.metrics import Metrics
from billingctl.adapters.payloads import Payment
from billingctl.domain.quota import CUSTOMER, MERCHANT
from billingctl.services import fraud_quota
from billingctl.services.processor_lock import lock_after_settle
from billingctl.settings import Settings
from tests.fakes import FakeUnitOfWork

pytestmark = pytest.mark.unit
T0 = datetime(2026, 11, 1, tzinfo=UTC)
PRODUCTION = SimpleNamespace(is_production=True)


def hours(n):
    return timedelta(hours=n)


def test_the_quota_reserves_four_customer_attempts_a_day_then_refuses_without_reserving():
    uow = FakeUnitOfWork()
    decisions = [fraud_quota.reserve(uow, PRODUCTION, "u1", "nsfw", T0 + hours(i), CUSTOMER, f"checkout:{i}", 999)
                 for i in range(5)]
    assert [d.allowed for d in decisions] == [True, True, True, True, False]
    assert decisions[-1].blocking == "daily"
    assert [r["dedupe_key"] for r in uow.fraud.rows] == [f"checkout:{i}" for i in range(4)]
    assert all(r["metadata"] == {"merchant_context": "full", "amount": 999, "initiator": CUSTOMER}
               for r in uow.fraud.rows)


def test_a_merchant_initiated_attempt_takes_the_reserved_fifth_slot():
    uow = FakeUnitOfWork()
    for i in range(4):
        fraud_quota.reserve(uow, PRODUCTION, "u1", "nsfw", T0 + hours(i), CUSTOMER, f"checkout:{i}", 1)
    assert fraud_quota.reserve(uow, PRODUCTION, "u1", "nsfw", T0 + hours(5), MERCHANT, "renewal:1", 1).allowed
    assert not fraud_quota.reserve(uow, PRODUCTION, "u1", "nsfw", T0 + hours(6), MERCHANT, "renewal:2", 1).allowed


def test_only_full_merchant_context_attempts_count_and_only_within_the_window():
    uow = FakeUnitOfWork()
    uow.fraud.add("u1", "authorization_attempt", T0, {"merchant_context": "partial"})
    uow.fraud.add("u1", "authorization_attempt", T0 - hours(24 * 31), {"merchant_context": "full"})
    uow.fraud.add("u1", "velocity_triggered", T0, {"merchant_context": "full"})
    uow.fraud.add("u2", "authorization_attempt", T0, {"merchant_context": "full"})
    assert fraud_quota.attempt_times(uow, "u1", T0 + hours(1)) == []
    uow.fraud.add("u1", "authorization_attempt", T0, {"merchant_context": "full"})
    assert fraud_quota.attempt_times(uow, "u1", T0 + hours(1)) == [T0]


def test_the_sfw_lane_and_non_production_reserve_nothing():
    uow = FakeUnitOfWork()
    assert fraud_quota.reserve(uow, PRODUCTION, "u1", "sfw", T0, CUSTOMER, "checkout:a", 1) is None
    staging = SimpleNamespace(is_production=False)
    assert fraud_quota.reserve(uow, staging, "u1", "nsfw", T0, CUSTOMER, "checkout:b", 1) is None
    assert [r["dedupe_key"] for r in uow.fraud.rows] == ["checkout:b"]  # counted, never refused


def test_an_authorization_takes_its_orders_reservation_and_counts_once_per_payment():
    uow = FakeUnitOfWork()
    fraud_quota.reserve(uow, PRODUCTION, "u1", "nsfw", T0, CUSTOMER, "order:o1", 1)
    payment = {"id": "p1", "status": "AUTHORIZED", "orderId": "o1", "amount": 1}
    assert fraud_quota.count_authorization(uow, T0, Payment.read(payment), "nsfw", "u1")
    assert not fraud_quota.count_authorization(uow, T0, Payment.read({**payment, "status": "SETTLED"}), "nsfw", "u1")
    assert [r["dedupe_key"] for r in uow.fraud.rows] == ["payment:p1"]
    second = {"id": "p2", "status": "DECLINED", "orderId": "o1", "amount": 1, "metadata": {"merchant_initiated": True}}
    assert fraud_quota.count_authorization(uow, T0, Payment.read(second), "nsfw", "u1")
    assert uow.fraud.rows[-1]["metadata"]["initiator"] == MERCHANT
    assert not fraud_quota.count_authorization(uow, T0, Payment.read({"id": "p3", "status": "PENDING"}), "nsfw", "u1")
    assert not fraud_quota.count_authorization(uow, T0, Payment.read({"id": "p4", "status": "SETTLED"}), "sfw", "u1")


def _container():
    settings = Settings(environment="development", database_url="sqlite://")
    return SimpleNamespace(metrics=Metrics().preset(settings.processor_lanes), settings=settings,
                           clock=SimpleNamespace(now=lambda: T0))


def test_the_first_settle_locks_its_lane_and_a_later_processor_does_not_replace_it():
    uow, container = FakeUnitOfWork(), _container()
    first = lock_after_settle(uow, container, user_id="u1", payment_lane="nsfw", processor="NSFW_SEGPAY",
                              merchant_id="m1")
    later = lock_after_settle(uow, container, user_id="u1", payment_lane="nsfw", processor="NSFW_CCBILL",
                              merchant_id="m2")
    assert (first.outcome, later.outcome, later.locked_processor) == ("locked", "already_locked", "NSFW_SEGPAY")
    assert uow.locks.read("u1")["nsfw_processor"] == "NSFW_SEGPAY"
    assert uow.locks.read("u1")["nsfw_processor_mid"] == "m1"


def test_an_sfw_lock_writes_no_merchant_account():
    uow, container = FakeUnitOfWork(), _container()
    result = lock_after_settle(uow, container, user_id="u1", payment_lane="sfw", processor="SFW_STRIPE",
                               merchant_id="acct_1")
    assert result.outcome == "locked"
    row = uow.locks.read("u1")
    assert (row["sfw_processor"], row["nsfw_processor"], row["nsfw_processor_mid"]) == ("SFW_STRIPE", None, None)


def test_a_processor_of_the_other_lane_locks_nothing():
    uow, container = FakeUnitOfWork(), _container()
    result = lock_after_settle(uow, container, user_id="u1", payment_lane="sfw", processor="NSFW_SEGPAY",
                               merchant_id="m1")
    assert result.outcome == "cross_lane"
    row = uow.locks.read("u1")
    assert (row["sfw_processor"], row["nsfw_processor"]) == (None, None)


def test_a_refused_checkout_records_one_velocity_event_with_its_window_and_source():
    uow = FakeUnitOfWork()
    fraud_quota.record_velocity(uow, "u1", T0, 999, "daily", "checkout")
    assert uow.fraud.rows == [{"user_id": "u1", "event_type": "velocity_triggered", "created_at": T0,
                               "dedupe_key": None, "metadata": {"merchant_context": "full", "amount": 999,
                                                                "window": "daily", "source": "checkout"}}]


def test_the_window_is_judged_at_the_time_read_under_the_lock_not_before_it():
    """Issue 34 defect 7: request A read the clock, B took the user's lock and committed the last
    attempt, then A got the lock with its earlier time and was let in on a count without B's attempt."""
    from billingctl.domain.clock import ManualClock

    uow = FakeUnitOfWork()
    for i in range(3):
        assert fraud_quota.reserve(uow, PRODUCTION, "u1", "nsfw", T0 - hours(3 - i), CUSTOMER, f"checkout:{i}", 1)
    a_read_at = T0  # A's time, read before the lock
    assert fraud_quota.reserve(uow, PRODUCTION, "u1", "nsfw", T0 + timedelta(seconds=1), CUSTOMER, "checkout:b",
                               1).allowed
    clock = ManualClock(T0 + timedelta(seconds=2))  # the time once A holds the lock
    assert not fraud_quota.reserve(uow, PRODUCTION, "u1", "nsfw", a_read_at, CUSTOMER, "checkout:a", 1,
                                   clock=clock).allowed
    assert "checkout:a" not in [r["dedupe_key"] for r in uow.fraud.rows]
