"""External faults through the sandbox, all at once: 429 storms, 5xx, timeouts, connection resets,
malformed JSON, slow answers, a cancel that errors after taking effect. Nothing is lost, cursors never
skip, the breaker opens and recovers."""

import pytest

from billingctl.bootstrap import Container
from billingctl.domain.clock import ManualClock
from billingctl.domain.errors import BillingError
from billingctl.services import events, orphans
from billingctl.services.checkout import create_checkout
from billingctl.services.payments import retry_pending
from billingctl.services.sync import cancel_subscription
from tests.integration.conftest import World

pytestmark = pytest.mark.reliability


def test_a_storm_of_faults_loses_nothing(make_settings, db_url):
    # The provider's budget is measured in bench/budget.py; here the in-process limiter (real time) is lifted.
    c = Container(make_settings(database_url=db_url, breaker_min_calls=6, breaker_cooldown_seconds=30,
                                http_max_attempts=3, provider_rate_limit=10_000), clock=ManualClock())
    sleeps = []
    c.provider.http.sleep = c.orchestrator.http.sleep = sleeps.append
    world = World(c)
    orders = [create_checkout(c, f"storm_{i}", "credits-pro-USD-monthly") for i in range(6)]
    payments = [world.settle(co["order_id"]) for co in orders]  # every webhook lost: only the pollers remain
    store = world.sandbox.store
    store.add_fault("provider", "429", count=4, retry_after=0.5)
    store.add_fault("provider", "503", path="/events", count=2)
    store.add_fault("provider", "timeout", count=2)
    store.add_fault("provider", "reset", count=2)
    store.add_fault("provider", "malformed", path="/invoices/", count=2)
    store.add_fault("provider", "slow", count=2, delay=0.05)
    store.add_fault("orchestrator", "503", count=3)
    store.add_fault("orchestrator", "reset", count=2)
    breaker_opened = False
    for _ in range(40):  # bounded: the run stops by itself
        c.clock.advance(31)
        store.advance_clock(31)
        for step in (events.poll, orphans.run_orphans, retry_pending):
            try:
                step(c)
            except BillingError:
                pass  # visible (exit 4 in the CLI); the next run resumes
        breaker_opened |= any(b.state() != "closed" for b in c.breakers.values())
        done = all(world.purchases(p["id"]) == 1 for p in payments) and all(
            world.sandbox.subscription(co["subscription_id"])["status"] == "active" for co in orders)
        if done:
            break
    for p in payments:
        assert world.purchases(p["id"]) == 1
    assert sum(world.credits(f"storm_{i}") for i in range(6)) == 6 * 2000
    assert all(world.sandbox.subscription(co["subscription_id"])["status"] == "active" for co in orders)
    assert any(w >= 0.5 for w in sleeps)  # Retry-After was honoured (plus the jitter on top of it)
    assert c.metrics.sample("billing_provider_rate_limit_errors_total") >= 1
    # The cursor never skipped: after one more poll every provider event is in the inbox, processed once.
    store.clear_faults()
    events.poll(c)
    with c.uow() as uow:
        from sqlalchemy import select

        from billingctl.adapters.db.tables import event_inbox

        rows = uow.execute(select(event_inbox.c.event_id, event_inbox.c.status).where(
            event_inbox.c.source == "provider")).all()
    provider_events = {e["id"] for e in store.all("event")}
    assert {r.event_id for r in rows} == provider_events
    assert {r.status for r in rows} == {"processed"}
    # The breaker opens under a full outage and recovers after it.
    store.add_fault("provider", "500", count=-1)
    for _ in range(8):
        try:
            c.provider.get_item_price("credits-pro-USD-monthly")
        except BillingError:
            pass
    assert breaker_opened or c.breakers["subscription_provider"].state() == "open"
    store.clear_faults()
    c.clock.advance(31)
    assert c.provider.get_item_price("credits-pro-USD-monthly")["price"] == 1999
    assert c.breakers["subscription_provider"].state() == "closed"
    # A cancel that errors after taking effect still ends cancelled, locally too.
    store.add_fault("provider", "error_after_effect", path="cancel_for_items", count=-1)
    assert cancel_subscription(c, orders[0]["subscription_id"], "storm", "test")["status"] == "cancelled"
    c.close()
