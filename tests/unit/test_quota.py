"""The authorization quota's boundaries (spec section 3 table and rules 1-3)."""

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from billingctl.domain.quota import CUSTOMER, MERCHANT, Attempt, authorization_quota, starts_over_limit

pytestmark = pytest.mark.unit
T0 = datetime(2026, 11, 1, tzinfo=UTC)


def hours(n):
    return timedelta(hours=n)


def test_the_fourth_customer_attempt_in_24h_passes_and_the_fifth_is_blocked():
    attempts = [T0 + hours(i) for i in range(3)]
    assert authorization_quota(attempts, T0 + hours(4)).allowed  # this would be the 4th
    attempts.append(T0 + hours(4))
    decision = authorization_quota(attempts, T0 + hours(5))
    assert not decision.allowed and decision.blocking == "daily"
    daily = decision.windows[0]
    assert (daily.used, daily.limit, daily.customer_limit) == (4, 5, 4)


def test_a_merchant_attempt_may_take_the_reserved_fifth_slot_and_no_more():
    attempts = [T0 + hours(i) for i in range(4)]
    assert authorization_quota(attempts, T0 + hours(5), MERCHANT).allowed
    attempts.append(T0 + hours(5))
    assert not authorization_quota(attempts, T0 + hours(6), MERCHANT).allowed


def test_the_slot_frees_exactly_24h_after_the_oldest_attempt():
    attempts = [T0 + hours(i) for i in range(4)]
    just_before = T0 + hours(24) - timedelta(microseconds=1)
    assert not authorization_quota(attempts, just_before).allowed
    decision = authorization_quota(attempts, T0 + hours(24))
    assert decision.allowed
    assert authorization_quota(attempts, just_before).windows[0].next_slot_frees_at == T0 + hours(24)


@pytest.mark.parametrize(("window", "days", "limit"), [("weekly", 7, 20), ("monthly", 30, 30)])
def test_weekly_and_monthly_windows(window, days, limit):
    span = timedelta(days=days)
    step = (span - timedelta(days=1)) / (limit - 1)  # spread so the daily window is never the limit
    attempts = [T0 + step * i for i in range(limit - 1)]
    now = attempts[-1] + timedelta(days=1, seconds=1)
    decision = authorization_quota(attempts, now)
    assert not decision.allowed and decision.blocking == window
    assert authorization_quota(attempts, now, MERCHANT).allowed
    assert authorization_quota(attempts, T0 + span).allowed  # the oldest left the window


@given(st.lists(st.integers(min_value=0, max_value=60 * 24 * 40), max_size=40), st.integers(0, 60 * 24 * 40))
def test_customer_never_exceeds_limit_minus_one_in_any_window(offsets, now_offset):
    attempts = [T0 + timedelta(minutes=m) for m in offsets]
    now = T0 + timedelta(minutes=now_offset)
    decision = authorization_quota(attempts, now, CUSTOMER)
    if decision.allowed:
        assert all(w.used < w.customer_limit for w in decision.windows)
    else:
        assert any(w.used >= w.customer_limit for w in decision.windows)


def test_only_a_start_the_gate_would_refuse_is_over_the_limit():
    """Reconcile's reading of the quota: further tries in one payment form count toward the next start
    but are never violations themselves; a customer start needs a free customer slot (4 of 5 a day), a
    merchant start a free slot (5 of 5)."""
    hour = timedelta(hours=1)
    form = [Attempt(T0 + i * timedelta(minutes=1), CUSTOMER, i == 0) for i in range(6)]
    assert starts_over_limit(form) == []  # six attempts in a day, one start: nothing the quota could stop
    merchant = Attempt(T0 + hour, MERCHANT, True)
    [(attempt, window)] = starts_over_limit([*form, merchant])
    assert (attempt, window.window, window.used, window.limit) == (merchant, "daily", 6, 5)
    three = [Attempt(T0 + i * hour, CUSTOMER, i == 0) for i in range(3)]
    assert starts_over_limit([*three, Attempt(T0 + 3 * hour, MERCHANT, True)]) == []
    assert starts_over_limit([*three, Attempt(T0 + 3 * hour, CUSTOMER, True)]) == []  # 3 before: the 4th slot
    four = [*three, Attempt(T0 + 3 * hour, CUSTOMER, False)]
    assert [a for a, _ in starts_over_limit([*four, Attempt(T0 + 4 * hour, CUSTOMER, True)])] == [
        Attempt(T0 + 4 * hour, CUSTOMER, True)]
    assert starts_over_limit([*four, Attempt(T0 + 4 * hour, MERCHANT, True)]) == []  # the slot kept for renewals
    assert starts_over_limit([*four, Attempt(T0 + 3 * hour + timedelta(days=1), CUSTOMER, True)]) == []  # slid
