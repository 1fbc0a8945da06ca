"""Composition root: builds the engine, Redis, clients, clock and metrics from Settings.

Nothing here connects at import time or on construction: every resource is built on first use.
"""

from __future__ import annotations

import logging
from functools import cached_property
from typing import TYPE_CHECKING

from billingctl.domain.clock import OffsetClock, SystemClock
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
        skew = settings.clock_skew_seconds
        self.clock = clock or (OffsetClock(lambda: self.sandbox.store.offset() + skew) if settings.clock == "sandbox"
                               else SystemClock())
        self._metrics = metrics
        # A sync web worker's connection for the duplicate read, kept between requests (adapters/db/sql.py
        # HeldConnection): set by the web app built for gunicorn, None everywhere else.
        self.held_read = None

    @cached_property
    def engine(self) -> Engine:
        from billingctl.adapters.db.engine import make_engine

        engine = make_engine(self.settings.database_url)
        if self.settings.is_sqlite:
            from billingctl.adapters.db.migrate import ensure_current

            ensure_current(engine)
        from billingctl import startup

        startup.end()  # the command has loaded what it runs on: its own work is collected as usual
        return engine

    def uow(self, autocommit: bool = False) -> UnitOfWork:
        """One transaction; or, with autocommit, statements that each stand alone (one round trip each:
        for reads, and for work that is a single statement)."""
        from billingctl.adapters.db.uow import UnitOfWork

        return UnitOfWork(self.autocommit_engine if autocommit else self.engine, autocommit=autocommit)

    @cached_property
    def autocommit_engine(self) -> Engine:
        from billingctl.adapters.db.engine import autocommit_engine

        return autocommit_engine(self.engine)

    @cached_property
    def metrics(self) -> Metrics:
        from billingctl.adapters.metrics import Metrics, ensure_multiprocess_dir

        if self._metrics is not None:
            return self._metrics
        ensure_multiprocess_dir()
        return Metrics().preset(self.settings.processor_lanes)

    @cached_property
    def redis(self):
        """A Redis client, or None when BILLING_REDIS_URL is unset (in-process fallbacks apply)."""
        if not self.settings.redis_url:
            return None
        from billingctl.adapters.syncredis import redis_module

        return redis_module().Redis.from_url(
            self.settings.redis_url, socket_timeout=2, socket_connect_timeout=2, health_check_interval=30
        )

    def _redis_error(self, component: str) -> None:
        self.metrics.redis_errors.labels(component=component).inc()

    @cached_property
    def locks(self):
        from billingctl.adapters.locks import LockManager

        return LockManager(self.redis, on_error=self._redis_error)

    @cached_property
    def cache(self):
        from billingctl.adapters.cache import Cache

        return Cache(self.redis, on_error=self._redis_error)

    # ---- external systems ------------------------------------------------------------------
    @cached_property
    def sandbox(self):
        """The in-process simulators (only when a provider or orchestrator URL is unset)."""
        from billingctl.sandbox.delivery import WebhookDelivery
        from billingctl.sandbox.model import Sandbox
        from billingctl.sandbox.store import SandboxStore

        return Sandbox(SandboxStore(self.settings.sandbox_db),
                       webhook_secret=self.settings.secret("orchestrator_webhook_secret") or "",
                       disputes_secret=self.settings.secret("orchestrator_disputes_secret") or "",
                       deliver=WebhookDelivery(self))

    @cached_property
    def breakers(self) -> dict:
        from billingctl.adapters.breaker import BreakerConfig, CircuitBreaker, MemoryBreakerStore, RedisBreakerStore

        s = self.settings
        config = BreakerConfig(threshold=s.breaker_error_threshold, min_calls=s.breaker_min_calls,
                               window=s.breaker_window_seconds, cooldown=s.breaker_cooldown_seconds)
        result = {}
        for dependency in ("subscription_provider", "orchestrator"):
            store = RedisBreakerStore(self.redis, dependency) if self.redis is not None else MemoryBreakerStore()
            result[dependency] = CircuitBreaker(dependency, config, self.clock, store,
                                                gauge=self.metrics.circuit_breaker_state, on_error=self._redis_error)
        return result

    @cached_property
    def user_limiter(self):
        """Requests per signed-in user on the user API (the `limits` library; Redis when configured)."""
        from billingctl.adapters.ratelimit import RateLimiter

        s = self.settings
        return RateLimiter(s.user_api_rate_limit, 60, "billing:user-api", redis_url=s.redis_url, max_wait=0,
                           on_error=self._redis_error, shares={})

    @cached_property
    def checkout_limiter(self):
        """New checkouts per user and minute (they spend the provider's interactive share; decision 126)."""
        from billingctl.adapters.ratelimit import RateLimiter

        s = self.settings
        return RateLimiter(s.checkout_starts_per_user_per_minute, 60, "billing:checkout-starts", redis_url=s.redis_url,
                           max_wait=0, on_error=self._redis_error, shares={})

    @cached_property
    def provider_limiter(self):
        from billingctl.adapters.ratelimit import RateLimiter, key_for

        s = self.settings
        return RateLimiter(s.provider_rate_limit, s.provider_rate_window_seconds,
                           key_for(s.secret("provider_api_key"), "subscription_provider"),
                           redis_url=s.redis_url, max_wait=s.provider_rate_max_wait_seconds,
                           on_error=self._redis_error)

    def _http(self, dependency: str, base_url: str | None, headers: dict, sandbox_app: str, idempotency_header: str,
              limiter=None):
        import httpx

        from billingctl.adapters import tls
        from billingctl.adapters.http import HttpPolicy, ResilientClient
        from billingctl.domain.errors import RateLimited

        s = self.settings
        if base_url:
            client = httpx.Client(base_url=base_url, headers=headers, timeout=s.http_timeout_seconds,
                                  verify=tls.context())
        else:  # the in-process sandbox (Flask) is imported only when it answers: never in production
            from billingctl.sandbox import apps
            from billingctl.sandbox.transport import SandboxTransport

            client = httpx.Client(base_url="http://sandbox.local", headers=headers,
                                  transport=SandboxTransport(app=getattr(apps, sandbox_app)(self.sandbox)))
        metrics = self.metrics

        def on_error(exc):
            if dependency == "subscription_provider" and isinstance(exc, RateLimited) \
                    and exc.details.get("status") == 429:
                metrics.provider_rate_limit_errors.inc()
            metrics.external_errors.labels(dependency=dependency, error=exc.code).inc()

        policy = HttpPolicy(timeout=s.http_timeout_seconds, max_attempts=s.http_max_attempts,
                            backoff_max=s.http_backoff_max_seconds,
                            rate_block_seconds=s.provider_rate_block_seconds
                            if dependency == "subscription_provider" else None)
        return ResilientClient(dependency, client, policy=policy, breaker=self.breakers[dependency],
                               limiter=limiter, on_error=on_error, idempotency_header=idempotency_header,
                               clock=lambda: self.clock.now())  # the container's clock, even when replaced

    @cached_property
    def provider(self):
        from billingctl.adapters.subscription_provider import SubscriptionProviderClient

        s = self.settings
        key = s.secret("provider_api_key") or "sandbox-provider-key"
        if s.provider_auth == "basic":
            import base64

            authorization = "Basic " + base64.b64encode(f"{key}:".encode()).decode()
        else:
            authorization = f"Bearer {key}"
        http = self._http("subscription_provider", s.provider_url, {"Authorization": authorization},
                          "create_provider_app", s.provider_idempotency_header, limiter=self.provider_limiter)
        return SubscriptionProviderClient(http)

    @cached_property
    def orchestrator(self):
        from billingctl.adapters.orchestrator import API_VERSION, OrchestratorClient

        key = self.settings.secret("orchestrator_api_key") or "sandbox-orchestrator-key"
        http = self._http("orchestrator", self.settings.orchestrator_url,
                          {"X-API-KEY": key, "X-API-VERSION": API_VERSION}, "create_orchestrator_app",
                          "X-Idempotency-Key")
        return OrchestratorClient(http, charge_timeout=self.settings.orchestrator_charge_timeout_seconds)

    def hold_read_connection(self) -> None:
        """For a sync web worker (one request thread a process): the duplicate read keeps its connection
        between requests (decision 165)."""
        from billingctl.adapters.db.sql import HeldConnection

        self.held_read = HeldConnection(self.autocommit_engine)

    def close(self) -> None:
        if self.held_read is not None:
            self.held_read.close()
        if "autocommit_engine" in self.__dict__:
            self.autocommit_engine.dispose()
        if "engine" in self.__dict__:
            self.engine.dispose()
        if "redis" in self.__dict__ and self.redis is not None:
            self.redis.close()
        for name in ("provider", "orchestrator"):
            if name in self.__dict__:
                self.__dict__[name].http.close()
        if "sandbox" in self.__dict__ and hasattr(self.sandbox.deliver, "close"):
            self.sandbox.deliver.close()


def bootstrap(settings: Settings | None = None, **kw) -> Container:
    return Container(settings or load_settings(), **kw)
