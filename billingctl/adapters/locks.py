"""Short-lived named locks that save duplicate work (never the guard of correctness: the database
constraints are). Redis when configured; in-process otherwise; Redis failing means "no lock"."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from contextlib import contextmanager

from billingctl.adapters.logs import warn_now_and_then

log = logging.getLogger("billingctl.locks")

_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"
_local_locks: dict[str, threading.Lock] = {}
_local_guard = threading.Lock()


class LockManager:
    def __init__(self, redis=None, on_error=None):
        self.redis = redis
        self.on_error = on_error or (lambda component: None)

    @contextmanager
    def hold(self, name: str, ttl: float = 30.0, wait: float = 15.0):
        """Yields True when the lock is held, False when it could not be had (the caller proceeds,
        relying on the database)."""
        if self.redis is None:
            with _local_guard:
                lock = _local_locks.setdefault(name, threading.Lock())
            got = lock.acquire(timeout=wait)
            try:
                yield got
            finally:
                if got:
                    lock.release()
            return
        token = uuid.uuid4().hex
        key = f"billing:lock:{name}"
        got = False
        try:
            deadline = time.monotonic() + wait
            while not (got := bool(self.redis.set(key, token, nx=True, px=int(ttl * 1000)))):
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.02)
        except Exception as exc:
            warn_now_and_then(log, "lock", "redis lock unavailable, relying on the database: %s",
                              type(exc).__name__, extra={"lock": name})
            self.on_error("lock")
            got = False
        try:
            yield got
        finally:
            if got:
                try:
                    self.redis.eval(_RELEASE, 1, key, token)
                except Exception as exc:  # the lock expires on its own
                    log.debug("redis lock release failed: %s", type(exc).__name__)
