"""Shared set-up for the benchmarks: a throwaway PostgreSQL, containers, seeded sandbox data."""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
from pathlib import Path

import webhooks_app  # noqa: F401 - the receiver of the in-process sandbox's webhooks
from billingctl.adapters.db.engine import make_engine
from billingctl.adapters.db.migrate import upgrade
from billingctl.bootstrap import Container
from billingctl.settings import load_settings


@contextlib.contextmanager
def postgres(durable: bool = False):
    """A migrated database on a throwaway server (or BILLING_TEST_DATABASE_URL's server); `durable`: a
    server of its own with fsync on (production's setting), for the figure that must say so."""
    from tests.conftest import create_database
    from tests.servers import PostgresServer

    given = None if durable else os.environ.get("BILLING_TEST_DATABASE_URL")
    server = None
    if given:
        server_url = given
    else:
        server = PostgresServer(durable=durable)
        server_url = server.start()
    try:
        url = create_database(server_url, "billing_bench")
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        yield url
    finally:
        if server:
            server.stop()


def container(database_url: str, workdir: Path, **overrides) -> Container:
    for key in [k for k in os.environ if k.startswith("BILLING_") and not k.startswith("BILLING_TEST_")]:
        del os.environ[key]
    # The provider limit is lifted unless a benchmark asks for the real one (a shape it then says).
    overrides = {"provider_rate_limit": 1_000_000, **overrides}
    settings = load_settings(database_url=database_url, sandbox_db=str(workdir / "sandbox.db"), **overrides)
    return Container(settings)


def workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="billing-bench-"))


def percentile(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[index]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def seed_payments(c: Container, n: int, prefix: str = "bench") -> list[dict]:
    """n pending (future) subscriptions at the provider and their settled checkout payments (order id =
    the subscription: a future subscription has no invoice until activation starts it), each of its own
    customer: a customer holds one live subscription of a plan (decision 110), and a second checkout of it
    is refused once the first is active."""
    now = int(c.sandbox.store.now())
    subs, payments = [], []
    for i in range(n):
        user, sub, pay = f"{prefix}_u{i}", f"sub_{prefix}_{i}", f"pay_{prefix}_{i}"
        subs.append({"id": sub, "customer_id": user, "status": "future", "start_date": now + 400 * 86400,
                     "created_at": now, "updated_at": now, "currency_code": "USD", "coupons": [], "deleted": False,
                     "auto_collection": "off",
                     "subscription_items": [{"item_price_id": "credits-basic-USD-monthly", "unit_price": 999}]})
        payments.append({"id": pay, "status": "SETTLED", "orderId": sub, "customerId": user, "amount": 999,
                         "currencyCode": "USD", "date": now,
                         "processor": {"name": "SFW_STRIPE", "processorMerchantId": "acct_1"},
                         "metadata": {"user_id": user, "subscription_id": sub,
                                      "item_price_id": "credits-basic-USD-monthly", "lane": "sfw"}})
    # The provider holds each customer before its subscriptions (it refuses a subscription for a customer
    # it does not know), as a checkout creates them: collected off the provider (the orchestrator takes the
    # payments; with auto collection on and no card the provider refuses to start the subscription).
    customers = {s["customer_id"] for s in subs}
    c.sandbox.store.put_many("customer", [{"id": cid, "auto_collection": "off", "deleted": False, "created_at": now,
                                           "updated_at": now, "object": "customer", "card_status": "no_card",
                                           "preferred_currency_code": "USD"} for cid in sorted(customers)])
    c.sandbox.store.put_many("subscription", subs)
    c.sandbox.store.put_many("payment", payments)
    return payments


def standalone(run) -> None:
    """`python -m bench.NAME`: one benchmark alone, on a throwaway PostgreSQL and Redis; prints its JSON."""
    import json

    from tests.servers import RedisServer

    redis_server = RedisServer()
    redis_url = redis_server.start()
    try:
        with postgres() as url:
            print(json.dumps(run(url, redis_url), indent=1, default=str))
    finally:
        redis_server.stop()
