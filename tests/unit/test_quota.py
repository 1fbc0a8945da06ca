"""The authorization quota's boundaries (spec section 3 table and rules 1-3)."""

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from billingctl.domain.quota import CUSTOMER, MERCHANT, authorization_quota

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
