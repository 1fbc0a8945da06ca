"""A small JSON cache with TTLs: Redis when configured, in-process otherwise. A cache failure is a miss."""

from __future__ import annotations

import json
import logging
import threading
import time

from billingctl.adapters.logs import warn_now_and_then

log = logging.getLogger("billingctl.cache")


class Cache:
    def __init__(self, redis=None, prefix: str = "billing:cache:", on_error=None):
        self.redis = redis
        self.on_error = on_error or (lambda component: None)
        self.prefix = prefix
        self._local: dict[str, tuple[float, str]] = {}
        self._lock = threading.Lock()

    def get(self, key: str):
        try:
            if self.redis is not None:
                raw = self.redis.get(self.prefix + key)
            else:
                with self._lock:
                    expires, raw = self._local.get(key, (0.0, None))
                    if raw is not None and expires < time.monotonic():
                        self._local.pop(key, None)
                        raw = None
        except Exception as exc:
            warn_now_and_then(log, "cache", "cache read failed: %s", type(exc).__name__)
            self.on_error("cache")
            return None
        return json.loads(raw) if raw is not None else None

    def set(self, key: str, value, ttl: float) -> None:
        raw = json.dumps(value)
        try:
            if self.redis is not None:
                self.redis.set(self.prefix + key, raw, px=int(ttl * 1000))
            else:
                with self._lock:
                    self._local[key] = (time.monotonic() + ttl, raw)
        except Exception as exc:
            warn_now_and_then(log, "cache", "cache write failed: %s", type(exc).__name__)
            self.on_error("cache")

    def delete(self, *keys: str) -> None:
        try:
            if self.redis is not None:
                self.redis.delete(*[self.prefix + k for k in keys])
            else:
                with self._lock:
                    for k in keys:
                        self._local.pop(k, None)
        except Exception as exc:
            warn_now_and_then(log, "cache", "cache delete failed: %s", type(exc).__name__)
            self.on_error("cache")
