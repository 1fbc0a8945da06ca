"""Client-side rate limiter shared by every process using one API key: a moving window of at most
N requests per window, in Redis when configured (the `limits` library), in-process otherwise.
When the budget is spent the caller waits, within a bound; past the bound it gets RateLimited."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable

from limits import RateLimitItemPerSecond
from limits.storage import MemoryStorage, storage_from_string
from limits.strategies import MovingWindowRateLimiter

from billingctl.domain.errors import RateLimited

log = logging.getLogger("billingctl.ratelimit")


def key_for(api_key: str | None, dependency: str) -> str:
    """The budget belongs to the API key; the key itself is never stored."""
    digest = hashlib.sha256((api_key or "sandbox").encode()).hexdigest()[:16]
    return f"billing:{dependency}:{digest}"


class RateLimiter:
    def __init__(self, limit: int, window_seconds: int, key: str, redis_url: str | None = None,
                 max_wait: float = 30.0, sleep: Callable[[float], None] = time.sleep, on_error=None):
        self.on_error = on_error or (lambda component: None)
        self.item = RateLimitItemPerSecond(limit, window_seconds)
        self.key = key
        self.max_wait = max_wait
        self.sleep = sleep
        self._memory = MovingWindowRateLimiter(MemoryStorage())
        self._limiter = self._memory
        if redis_url:
            self._limiter = MovingWindowRateLimiter(storage_from_string(redis_url, socket_timeout=2))

    def _hit(self) -> bool:
        try:
            return self._limiter.hit(self.item, self.key)
        except Exception as exc:
            if self._limiter is self._memory:
                raise
            log.warning("shared rate limiter unavailable, limiting in-process: %s", type(exc).__name__)
            self.on_error("limiter")
            return self._memory.hit(self.item, self.key)

    def _reset_in(self) -> float:
        try:
            stats = self._limiter.get_window_stats(self.item, self.key)
        except Exception:
            stats = self._memory.get_window_stats(self.item, self.key)
        return max(0.01, stats.reset_time - time.time())

    def acquire(self, max_wait: float | None = None) -> None:
        budget = self.max_wait if max_wait is None else max_wait
        deadline = time.monotonic() + budget
        while not self._hit():
            wait = self._reset_in()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RateLimited("Please try after some time", client_side=True)
            self.sleep(min(wait, remaining))
