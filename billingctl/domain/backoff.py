"""Backoff schedules (pure)."""

from __future__ import annotations

from datetime import timedelta

ORPHAN_MAX_ATTEMPTS = 10


def orphan_retry_delay(failed_attempts: int) -> timedelta:
    """Spec section 3 orphan rule 2: 1 minute, doubling, capped at 30 minutes.
    After the n-th failure: 1, 2, 4, 8, 16, 30, 30, 30, 30 minutes."""
    if failed_attempts < 1:
        return timedelta(0)
    return timedelta(minutes=min(30, 2 ** (failed_attempts - 1)))
