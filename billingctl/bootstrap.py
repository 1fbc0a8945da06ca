"""Composition root: builds the engine, Redis, clients, clock and metrics from Settings.

Nothing here connects at import time or on construction: every resource is built on first use.
"""

from __future__ import annotations

import logging
from functools import cached_property
from typing import TYPE_CHECKING

from billingctl.domain.clock import SystemClock
from billingctl.settings import Settings, load_settings

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from billingctl.adapters.db.uow import UnitOfWork
    from billingctl.adapters.metrics import Metrics

log = logging.getLogger("billingctl")


class Container:
    """Everything a service needs, built lazily from one Settings object."""

    def __init__(self, settings: Settings, clock=None, metrics: Metrics | None = None):
        self.settings = settings
        self.clock = clock or SystemClock()
        self._metrics = metrics
        self._migrated = False

    @cached_property
    def engine(self) -> Engine:
        from billingctl.adapters.db.engine import make_engine

        engine = make_engine(self.settings.database_url)
        if self.settings.is_sqlite:
            from billingctl.adapters.db.migrate import ensure_current

            ensure_current(engine)
        return engine

    def uow(self) -> UnitOfWork:
        from billingctl.adapters.db.uow import UnitOfWork

        return UnitOfWork(self.engine)

    @cached_property
    def metrics(self) -> Metrics:
        from billingctl.adapters.metrics import Metrics

        return self._metrics or Metrics()

    @cached_property
    def redis(self):
        """A Redis client, or None when BILLING_REDIS_URL is unset (in-process fallbacks apply)."""
        if not self.settings.redis_url:
            return None
        import redis

        return redis.Redis.from_url(
            self.settings.redis_url, socket_timeout=2, socket_connect_timeout=2, health_check_interval=30
        )

    def close(self) -> None:
        if "engine" in self.__dict__:
            self.engine.dispose()
        if "redis" in self.__dict__ and self.redis is not None:
            self.redis.close()


def bootstrap(settings: Settings | None = None, **kw) -> Container:
    return Container(settings or load_settings(), **kw)
