"""The NSFW authorization-attempt quota (spec section 3): sliding windows of 24 h, 7 d and 30 d with
limits 5, 20 and 30. A customer-initiated attempt may use at most limit - 1 (one slot per window is
kept for a merchant-initiated renewal). A slot frees exactly when the oldest attempt leaves its window.
Pure: the caller supplies the attempt times and 'now'."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

WINDOWS = (("daily", timedelta(days=1), 5), ("weekly", timedelta(days=7), 20), ("monthly", timedelta(days=30), 30))
LONGEST = max(w for _, w, _ in WINDOWS)
CUSTOMER, MERCHANT = "customer", "merchant"


@dataclass(frozen=True)
class WindowState:
    window: str
    used: int
    limit: int
    customer_limit: int
    next_slot_frees_at: datetime | None  # when the oldest attempt in the window leaves it


@dataclass(frozen=True)
class QuotaDecision:
    allowed: bool
    initiator: str
    windows: tuple[WindowState, ...]
    blocking: str | None = None


def authorization_quota(attempts: list[datetime], now: datetime, initiator: str = CUSTOMER) -> QuotaDecision:
    if initiator not in (CUSTOMER, MERCHANT):
        raise ValueError(f"initiator must be {CUSTOMER} or {MERCHANT}")
    states, blocking = [], None
    for name, length, limit in WINDOWS:
        # No upper bound: an attempt stamped after `now` (another worker's clock a little ahead, or a time
        # read before that worker committed) is inside every window, never outside the count.
        inside = sorted(t for t in attempts if now - length < t)
        state = WindowState(name, len(inside), limit, limit - 1, inside[0] + length if inside else None)
        states.append(state)
        allowed_here = len(inside) < (limit - 1 if initiator == CUSTOMER else limit)
        if not allowed_here and blocking is None:
            blocking = name
    return QuotaDecision(blocking is None, initiator, tuple(states), blocking)


@dataclass(frozen=True)
class Attempt:
    at: datetime
    initiator: str
    start: bool  # a checkout's or a renewal's reservation, which the quota admitted; not a further try in a form


def starts_over_limit(attempts: list[Attempt]) -> list[tuple[Attempt, WindowState]]:
    """The starts the quota should have refused, judged as the gate judges (`authorization_quota` over the
    attempts before each start): `attempts` are one user's, in the order they were written. A further try
    in the same payment form counts toward the next start but is no start itself: the quota cannot stop
    it, so a window that holds more than its limit because of such tries is no violation."""
    found = []
    for index, attempt in enumerate(attempts):
        if attempt.start:
            decision = authorization_quota([a.at for a in attempts[:index]], attempt.at, attempt.initiator)
            if not decision.allowed:
                found.append((attempt, next(w for w in decision.windows if w.window == decision.blocking)))
    return found
