"""Circuit breaker per dependency: opens when the error rate over a sliding window exceeds the
threshold (with a minimum number of calls), fails fast with "Circuit breaker is open", lets one
half-open probe through after the cool-down. State lives in Redis when configured, so every
process sees one breaker per dependency; otherwise in-process. Redis failing falls back in-process."""

from __future__ import annotations

import logging
import threading
import uuid
from collections import deque
from dataclasses import dataclass

from billingctl.adapters.logs import warn_now_and_then
from billingctl.domain.errors import CircuitOpen

log = logging.getLogger("billingctl.breaker")

STATE_VALUE = {"closed": 0, "half_open": 1, "open": 2}


@dataclass
class BreakerConfig:
    threshold: float = 0.5
    min_calls: int = 10
    window: float = 60.0
    cooldown: float = 30.0


class MemoryBreakerStore:
    def __init__(self):
        self._calls: deque[tuple[float, bool]] = deque()
        self._opened_at: float | None = None
        self._probe_until = 0.0
        self._lock = threading.Lock()

    def add(self, now: float, ok: bool, window: float) -> tuple[float | None, int, int]:
        with self._lock:
            self._calls.append((now, ok))
            return (self._opened_at, *self._counts(now, window))

    def counts(self, now: float, window: float) -> tuple[int, int]:
        with self._lock:
            return self._counts(now, window)

    def _counts(self, now: float, window: float) -> tuple[int, int]:
        while self._calls and self._calls[0][0] < now - window:
            self._calls.popleft()
        failures = sum(1 for _, ok in self._calls if not ok)
        return len(self._calls), failures

    def opened_at(self) -> float | None:
        return self._opened_at

    def open(self, now: float) -> None:
        with self._lock:
            self._opened_at = now
            self._probe_until = 0.0

    def close(self) -> None:
        with self._lock:
            self._opened_at = None
            self._calls.clear()

    def try_probe(self, now: float, ttl: float) -> bool:
        with self._lock:
            if now < self._probe_until:
                return False
            self._probe_until = now + ttl
            return True


class RedisBreakerStore:
    def __init__(self, redis, dependency: str):
        self.r = redis
        self.prefix = f"billing:breaker:{dependency}"

    def add(self, now: float, ok: bool, window: float) -> tuple[float | None, int, int]:
        """Record one call and read the state back: (opened_at, calls, failures), one round trip."""
        member = f"{now:.6f}:{uuid.uuid4().hex[:8]}"
        pipe = self.r.pipeline()
        pipe.get(f"{self.prefix}:opened_at")
        pipe.zadd(f"{self.prefix}:calls", {member: now})
        if not ok:
            pipe.zadd(f"{self.prefix}:failures", {member: now})
        pipe.expire(f"{self.prefix}:calls", int(window) + 60)
        pipe.expire(f"{self.prefix}:failures", int(window) + 60)
        self._count_into(pipe, now, window)
        answers = pipe.execute()
        opened = answers[0]
        return (float(opened) if opened is not None else None), int(answers[-3]), int(answers[-1])

    def _count_into(self, pipe, now: float, window: float) -> None:
        for key in ("calls", "failures"):
            pipe.zremrangebyscore(f"{self.prefix}:{key}", "-inf", now - window)
            pipe.zcard(f"{self.prefix}:{key}")

    def counts(self, now: float, window: float) -> tuple[int, int]:
        pipe = self.r.pipeline()
        self._count_into(pipe, now, window)
        _, total, _, failures = pipe.execute()
        return int(total), int(failures)

    def opened_at(self) -> float | None:
        value = self.r.get(f"{self.prefix}:opened_at")
        return float(value) if value is not None else None

    def open(self, now: float) -> None:
        pipe = self.r.pipeline()
        pipe.set(f"{self.prefix}:opened_at", repr(now))
        pipe.delete(f"{self.prefix}:probe")
        pipe.execute()

    def close(self) -> None:
        self.r.delete(f"{self.prefix}:opened_at", f"{self.prefix}:calls", f"{self.prefix}:failures",
                      f"{self.prefix}:probe")

    def try_probe(self, now: float, ttl: float) -> bool:
        return bool(self.r.set(f"{self.prefix}:probe", "1", nx=True, px=max(1, int(ttl * 1000))))


@dataclass(frozen=True)
class Ticket:
    probe: bool


class CircuitBreaker:
    def __init__(self, dependency: str, config: BreakerConfig, clock, store, fallback=None, gauge=None,
                 on_error=None):
        self.on_error = on_error or (lambda component: None)
        self.dependency = dependency
        self.config = config
        self.clock = clock
        self._store = store
        self._fallback = fallback or MemoryBreakerStore()
        self._gauge = gauge

    def _now(self) -> float:
        return self.clock.now().timestamp()

    def _call(self, op: str, *args):
        try:
            return getattr(self._store, op)(*args)
        except Exception as exc:
            if self._store is self._fallback:
                raise
            warn_now_and_then(log, f"breaker:{self.dependency}", "breaker state store failed, using in-process "
                              "state: %s", type(exc).__name__, extra={"dependency": self.dependency})
            self.on_error("breaker")
            return getattr(self._fallback, op)(*args)

    def state(self) -> str:
        opened = self._call("opened_at")
        if opened is None:
            return "closed"
        return "half_open" if self._now() - opened >= self.config.cooldown else "open"

    def before_call(self) -> Ticket:
        """May this call go out? Its ticket says whether it is the half-open probe."""
        opened = self._call("opened_at")
        if opened is None:
            return Ticket(probe=False)
        now = self._now()
        if now - opened >= self.config.cooldown and self._call("try_probe", now, self.config.cooldown):
            return Ticket(probe=True)  # this call is the half-open probe
        self._publish("open")
        raise CircuitOpen(dependency=self.dependency)

    def record(self, ok: bool, ticket: Ticket | None = None) -> None:
        now = self._now()
        if ticket is not None and ticket.probe:
            # The probe's answer decides: close on success, re-open for another cool-down on failure.
            if ok:
                self._call("close")
                log.info("circuit breaker closed", extra={"dependency": self.dependency})
            else:
                self._call("open", now)
            self._publish(self.state())
            return
        # One round trip: the call is added to the window and the state read back with the counts.
        opened, total, failures = self._call("add", now, ok, self.config.window)
        if opened is not None:
            # A call that started before the breaker opened (or beside the probe) decides nothing: only the
            # probe may close it, and only after the cool-down (closing clears the window it was added to).
            return
        if total >= self.config.min_calls and failures / total > self.config.threshold:
            self._call("open", now)
            log.error("circuit breaker opened", extra={"dependency": self.dependency,
                                                      "error_rate": round(failures / total, 3)})
            self._publish("open")
            return
        self._publish("closed")

    def snapshot(self) -> dict:
        total, failures = self._call("counts", self._now(), self.config.window)
        state = self.state()
        self._publish(state)
        return {"state": state, "error_rate": round(failures / total, 4) if total else 0.0,
                "calls": total, "failures": failures}

    def _publish(self, state: str) -> None:
        if self._gauge is not None:
            self._gauge.labels(dependency=self.dependency).set(STATE_VALUE[state])
