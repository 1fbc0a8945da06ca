"""Client-side rate limiter shared by every process using one API key: a moving window of at most
N requests per window, in Redis when configured (the `limits` library), in-process otherwise.
When the budget is spent the caller waits, within a bound; past the bound it gets RateLimited.

The budget is shared by classes of calls (docs/decisions.md): `money` (recording payments and
activating subscriptions) is bounded only by the whole budget; `interactive` (web requests) and
`batch` (jobs, operator commands) are each capped at a share of it, so together they always leave a
part for money. Interactive calls also have a floor (issue 39 item 2): the others never take its unused
part while interactive calls are being made, and borrow only half of it while they are idle, so the
first checkouts after a quiet window are never refused for a backlog's sake. Inside a web request
nothing waits for the limiter: the request gets RateLimited at once (a 429 with Retry-After) and the
jobs finish what it could not."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from limits import RateLimitItemPerSecond
from limits.storage import MemoryStorage, storage_from_string
from limits.strategies import MovingWindowRateLimiter

from billingctl.adapters.logs import warn_now_and_then
from billingctl.domain.errors import RateLimited

log = logging.getLogger("billingctl.ratelimit")


MONEY, INTERACTIVE, BATCH = "money", "interactive", "batch"
SHARES = {INTERACTIVE: 0.3, BATCH: 0.5}  # of the whole budget; money has no cap of its own
INTERACTIVE_FLOOR = 0.2  # of the whole budget: kept for interactive calls (12 a minute of the provider's 60)
# The budget class of the calls made here, and whether they may wait for it: one context variable, so a web
# request sets and resets both in one step (issue 39 item 4).
_BUDGET: ContextVar[tuple[str, bool]] = ContextVar("budget", default=(BATCH, False))


@contextmanager
def budget(kind: str, no_wait: bool | None = None) -> Iterator[None]:
    """Provider calls made inside are charged to `kind`; with no_wait, a spent budget raises at once."""
    token = _BUDGET.set((kind, _BUDGET.get()[1] if no_wait is None else no_wait))
    try:
        yield
    finally:
        _BUDGET.reset(token)


def waiting_allowed() -> bool:
    return not _BUDGET.get()[1]


def set_request_budget(kind: str):
    """For a web request, until `reset_request_budget` with what this returns (at teardown: a worker
    thread serves the next request, or a test goes on, in the same context): its calls never wait."""
    return _BUDGET.set((kind, True))


reset_request_budget = _BUDGET.reset


def key_for(api_key: str | None, dependency: str) -> str:
    """The budget belongs to the API key; the key itself is never stored."""
    digest = hashlib.sha256((api_key or "sandbox").encode()).hexdigest()[:16]
    return f"billing:{dependency}:{digest}"


class RateLimiter:
    def __init__(self, limit: int, window_seconds: int, key: str, redis_url: str | None = None,
                 max_wait: float = 30.0, sleep: Callable[[float], None] = time.sleep, on_error=None,
                 shares: dict[str, float] | None = None):
        self.on_error = on_error or (lambda component: None)
        self.item = RateLimitItemPerSecond(limit, window_seconds)
        self.class_items = {kind: RateLimitItemPerSecond(max(1, int(limit * share)), window_seconds)
                            for kind, share in (SHARES if shares is None else shares).items()}
        # The floor needs interactive calls counted (its cap's window does it).
        self.floor = int(limit * INTERACTIVE_FLOOR) if INTERACTIVE in self.class_items else 0
        self.key = key
        self.max_wait = max_wait
        self.sleep = sleep
        self._memory = MovingWindowRateLimiter(MemoryStorage())
        self._memory_lock = threading.Lock()
        self._limiter = self._memory
        if redis_url:
            from billingctl.adapters.syncredis import redis_module

            redis_module()  # before `limits` imports it: without its asyncio client (decision 267)
            self._limiter = MovingWindowRateLimiter(storage_from_string(redis_url, socket_timeout=2))

    def _call(self, op: str, *args, **kwargs):
        if self._limiter is self._memory:
            return self._in_process(op, *args, **kwargs)
        try:
            return getattr(self._limiter, op)(*args, **kwargs)
        except Exception as exc:
            warn_now_and_then(log, "limiter", "shared rate limiter unavailable, limiting in-process: %s",
                              type(exc).__name__)
            self.on_error("limiter")
            return self._in_process(op, *args, **kwargs)

    def _in_process(self, op: str, *args, **kwargs):
        """`limits`' MemoryStorage (5.8) schedules its expiry timer outside any lock: two threads hitting it at
        once may start one timer twice (alisaifee/limits#352, fixed after the last release), and a call or the
        timer's thread dies. The limiter's in-process calls are serialized; each takes microseconds."""
        with self._memory_lock:
            return getattr(self._memory, op)(*args, **kwargs)

    def _hit(self, kind: str) -> tuple[bool, RateLimitItemPerSecond, str]:
        """One slot of the class's share (when capped) and of the whole budget; the one refusing is named."""
        capped = self.class_items.get(kind)
        if capped is not None and not self._call("test", capped, f"{self.key}:{kind}"):
            return False, capped, f"{self.key}:{kind}"
        # The floor costs one more request only when the window is nearly spent: room for the whole floor
        # and this call needs no look at how much of it interactive calls use.
        if kind != INTERACTIVE and self.floor and not self._call("test", self.item, self.key, cost=self.floor + 1):
            kept = self._floor_kept()
            if kept and not self._call("test", self.item, self.key, cost=kept + 1):
                return False, self.item, self.key  # what is left is the interactive floor
        if not self._call("hit", self.item, self.key):
            return False, self.item, self.key
        if capped is not None:
            self._call("hit", capped, f"{self.key}:{kind}")
        return True, self.item, self.key

    def _floor_kept(self) -> int:
        """Slots of the window the other classes must leave: the floor's unused part while interactive calls
        are being made (any in the window), half the floor while they are idle (what others may borrow)."""
        if not self.floor:
            return 0
        item = self.class_items[INTERACTIVE]
        used = item.amount - self._call("get_window_stats", item, f"{self.key}:{INTERACTIVE}").remaining
        return self.floor - min(self.floor, used) if used else self.floor - self.floor // 2

    def _reset_in(self, item, key) -> float:
        stats = self._call("get_window_stats", item, key)
        return max(0.01, stats.reset_time - time.time())

    def acquire(self, max_wait: float | None = None) -> None:
        kind, no_wait = _BUDGET.get()
        allowed = 0.0 if no_wait else (self.max_wait if max_wait is None else max_wait)
        deadline = time.monotonic() + allowed
        while True:
            ok, item, key = self._hit(kind)
            if ok:
                return
            wait = self._reset_in(item, key)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RateLimited("Please try after some time", client_side=True, budget=kind,
                                  retry_after=round(wait, 1))
            self.sleep(min(wait, remaining))


    def block(self) -> None:
        """The dependency refused this key (a 429): fill the shared window, so that every process waits
        for it to slide instead of sending more requests into the dependency's block."""
        try:
            remaining = self._call("get_window_stats", self.item, self.key).remaining
            if remaining > 0:
                self._call("hit", self.item, self.key, cost=remaining)
        except Exception as exc:  # the wait in the retry still applies
            log.warning("could not close the shared budget after a 429: %s", type(exc).__name__)

    def admit(self, subject: str) -> None:
        """One request of `subject` (a user); TooManyRequests with the seconds to wait when over the limit."""
        from billingctl.domain.errors import TooManyRequests

        key = f"{self.key}:{hashlib.sha256(subject.encode()).hexdigest()[:16]}"
        if not self._call("hit", self.item, key):
            raise TooManyRequests(retry_after=round(self._reset_in(self.item, key), 1))
