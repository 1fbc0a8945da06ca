"""The event poller, the one inbox, refunds, sync, cache invalidation, cancellation, the watchdog."""

import threading
import time

import pytest
from sqlalchemy import func, select, update

from billingctl.adapters.db.tables import (
    alert_outbox,
    audit_log,
    credit_ledger,
    event_inbox,
    event_poller_state,
    subscription,
)
from billingctl.domain import errors as e
from billingctl.services import events, provider_events
from billingctl.services.subscriptions import get_for_user, invalidate_customer
from billingctl.services.sync import cancel_subscription, sync_all, sync_subscription

pytestmark = pytest.mark.integration


def inbox_rows(world, **where):
    with world.c.uow() as uow:
        query = select(event_inbox)
        for k, v in where.items():
            query = query.where(event_inbox.c[k] == v)
        return uow.execute(query).mappings().all()


def no_sleep(world):
    world.c.provider.http.sleep = lambda s: None
    world.c.orchestrator.http.sleep = lambda s: None


# ---- webhook and poller, in every order -------------------------------------------------------------

def test_webhook_first_then_poller(world):
    co = world.checkout()
    world.sandbox.pay(co["order_id"])
    result = events.poll(world.c)
    assert result["events_failed"] == 0 and result["events_seen"] >= 3
    assert world.purchases() == 1 and world.credits() == 2000
    assert world.c.metrics.sample("events_polled_total") == result["events_seen"]


def test_poller_first_then_webhook(world):
    co, invoice, payment = world.renewal_charged_unseen()  # the orchestrator webhook is dropped
    assert world.purchases(payment["id"]) == 0 and world.credits() == 2000
    events.poll(world.c)
    assert world.purchases(payment["id"]) == 1 and world.credits() == 4000
    world.sandbox.send_webhook("PAYMENT.STATUS", payment)  # arrives late
    assert world.purchases() == 2 and world.credits() == 4000


def test_a_lost_checkout_webhook_is_caught_by_the_settled_payments_poller(world):
    """A future subscription has no invoice, so the orchestrator's workflow cannot report a checkout's
    payment to the provider: the settled-payments poller is that payment's fallback."""
    from billingctl.services import orphans

    co = world.checkout()
    payment = world.settle(co["order_id"])
    assert events.poll(world.c)["events_processed"] >= 0 and world.purchases() == 0
    summary = world.c.orchestrator.list_payments("SETTLED")
    assert orphans.handle_payment(world.c, next(summary)) == "recorded"
    assert world.purchases(payment["id"]) == 1 and world.credits() == 2000
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "active"
    assert [i["status"] for i in world.sandbox.store.all("invoice")] == ["paid"]


def test_webhook_and_poller_concurrently(world):
    co = world.checkout()
    payment = world.settle(co["order_id"])
    barrier = threading.Barrier(2)

    def webhook():
        barrier.wait()
        world.sandbox.send_webhook("PAYMENT.STATUS", payment)

    def poller():
        barrier.wait()
        events.poll(world.c)

    threads = [threading.Thread(target=webhook), threading.Thread(target=poller)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert world.purchases() == 1 and world.credits() == 2000
    assert world.provider_record_calls() <= 1


def test_provider_webhook_and_poller_share_one_inbox(world):
    from webhooks_app import create_public_app

    world.renewal_charged_unseen()
    event = [ev for ev in world.sandbox.store.all("event") if ev["event_type"] == "payment_succeeded"][-1]
    s = world.c.settings
    client = create_public_app(container=world.c).test_client()
    auth = (s.secret("provider_webhook_username"), s.secret("provider_webhook_password"))
    response = client.post("/webhooks/subscription-provider", json=event, auth=auth)
    assert response.status_code == 200 and response.get_json()["status"] == "processed"
    events.poll(world.c)
    again = client.post("/webhooks/subscription-provider", json={"event": event}, auth=auth)
    assert again.get_json()["status"] == "processed"
    rows = inbox_rows(world, source="provider", event_id=event["id"])
    assert [(r["status"], r["attempts"]) for r in rows] == [("processed", 1)]
    assert world.purchases() == 2 and world.credits() == 4000


@pytest.mark.parametrize("auth", [None, ("wrong", "x"), ("right-user", "wrong-password")])
def test_provider_webhook_requires_basic_auth(world, auth):
    from webhooks_app import create_public_app

    s = world.c.settings
    if auth and auth[0] == "right-user":
        auth = (s.secret("provider_webhook_username"), "wrong-password")
    client = create_public_app(container=world.c).test_client()
    response = client.post("/webhooks/subscription-provider", json={"id": "ev_1", "event_type": "x"}, auth=auth)
    assert response.status_code == 401
    assert inbox_rows(world) == []


def test_provider_webhook_malformed_body_after_auth_is_400(world):
    from webhooks_app import create_public_app

    s = world.c.settings
    client = create_public_app(container=world.c).test_client()
    auth = (s.secret("provider_webhook_username"), s.secret("provider_webhook_password"))
    assert client.post("/webhooks/subscription-provider", data=b"{no", auth=auth).status_code == 400
    assert client.post("/webhooks/subscription-provider", json={"id": "e"}, auth=auth).status_code == 400


# ---- budget, faults, poison ----------------------------------------------------------------------------

def _bulk_events(world, n):
    now = int(world.sandbox.store.now())
    world.sandbox.store.put_many("event", [
        {"id": f"ev_bulk_{i:05d}", "occurred_at": now - n + i, "source": "api", "api_version": "v2",
         "event_type": "customer_changed", "content": {"customer": {"id": f"c{i}"}}} for i in range(n)])


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_ten_thousand_events_within_101_provider_requests(make_settings, db_url):
    from billingctl.bootstrap import Container
    from tests.integration.conftest import World

    # 100 pages exceed the 60-a-minute budget: the real poller would catch up over two runs.
    world = World(Container(make_settings(database_url=db_url, provider_rate_limit=1000)))
    _bulk_events(world, 10_000)
    before = world.sandbox.store.count_requests("provider")
    result = events.poll(world.c)
    assert result["events_processed"] == 10_000 and result["events_failed"] == 0
    assert world.sandbox.store.count_requests("provider") - before <= 101
    idle_before = world.sandbox.store.count_requests("provider")
    events.poll(world.c)  # an idle poll re-reads only the overlap window
    assert world.sandbox.store.count_requests("provider") - idle_before <= 1


def test_a_5xx_mid_sequence_resumes_without_skipping_or_repeating(world):
    no_sleep(world)
    _bulk_events(world, 250)
    world.sandbox.store.add_fault("provider", "503", path="/events", skip=1, count=-1)
    with pytest.raises(e.ExternalError, match="poll incomplete"):
        events.poll(world.c)
    assert len(inbox_rows(world, status="processed")) == 100
    world.sandbox.store.clear_faults()
    world.sandbox.store.add_fault("provider", "429", path="/events", count=1, retry_after=0)
    result = events.poll(world.c)
    assert result["error"] is None
    rows = inbox_rows(world)
    assert len(rows) == 250 and {(r["status"], r["attempts"]) for r in rows} == {("processed", 1)}
    with world.c.uow() as uow:
        runs = uow.execute(select(event_poller_state.c.error).order_by(event_poller_state.c.id)).scalars().all()
    assert len(runs) == 2 and runs[0] and runs[1] is None


def test_a_poison_event_is_parked_and_alerted_once_and_stops_blocking(world):
    no_sleep(world)
    now = int(world.sandbox.store.now())
    world.sandbox.store.put_many("event", [{
        "id": "ev_poison", "occurred_at": now - 10, "event_type": "payment_succeeded",
        "content": {"transaction": {"reference_number": "pay_ghost", "customer_id": "u", "amount": 5},
                    "invoice": {"id": "inv_ghost", "subscription_id": "sub_ghost",
                                "line_items": [{"entity_id": "no-such-plan"}]}}}])
    cursor_values = []
    for _ in range(provider_events.MAX_EVENT_ATTEMPTS):
        events.poll(world.c)
        cursor_values.append(events._read_cursor(world.c))
    assert cursor_values[0] is None  # the cursor stayed behind the failing event
    assert inbox_rows(world, event_id="ev_poison")[0]["status"] == "parked"
    assert cursor_values[-1] is not None  # once parked, it no longer blocks
    events.poll(world.c)
    with world.c.uow() as uow:
        alerts = uow.execute(select(alert_outbox.c.dedupe_key).where(alert_outbox.c.sink == "chat")).scalars().all()
    assert alerts == ["parked:provider:ev_poison"]
    assert events.poller_freshness(world.c)["parked_events"] == 1


# ---- refunds ------------------------------------------------------------------------------------------

def test_a_refund_reverses_credits_once_by_webhook_and_poller(world):
    co = world.checkout()
    payment = world.sandbox.pay(co["order_id"])
    assert world.credits() == 2000
    world.sandbox.refund(payment["id"])  # PAYMENT.REFUND webhook + provider refund events
    assert world.credits() == 0
    events.poll(world.c)
    events.poll(world.c)
    assert world.credits() == 0
    with world.c.uow() as uow:
        refunds = uow.execute(select(func.count()).select_from(credit_ledger).where(
            credit_ledger.c.reason == "refund")).scalar_one()
    assert refunds == 1


def test_partial_refunds_reverse_their_share_once(world):
    co = world.checkout()
    payment = world.settle(co["order_id"])
    events.poll(world.c)
    world.sandbox.hold_webhooks()
    world.sandbox.refund(payment["id"], 999)
    world.sandbox.refund(payment["id"], 1000)
    events.poll(world.c)  # the poller sees both refunds first
    assert world.credits() == 0
    world.sandbox.release_webhooks("reverse")  # then both webhooks, out of order
    assert world.credits() == 0


# ---- analytics --------------------------------------------------------------------------------------

def test_analytics_one_per_payment_refund_and_subscription_change(world):
    co = world.checkout()
    payment = world.sandbox.pay(co["order_id"])
    events.poll(world.c)
    world.sandbox.refund(payment["id"])
    events.poll(world.c)
    with world.c.uow() as uow:
        rows = uow.execute(select(alert_outbox.c.payload).where(alert_outbox.c.sink == "analytics")).scalars().all()
    kinds = sorted(r["event"] for r in rows)
    assert kinds.count("payment_recorded") == 1 and kinds.count("payment_refunded") == 1
    assert "subscription_started" in kinds  # the provider's event when a future subscription starts


# ---- sync, invalidate, breaker, cancel -----------------------------------------------------------------

def test_sync_overwrites_a_drifted_local_copy(world):
    co = world.checkout()
    world.sandbox.pay(co["order_id"])
    with world.c.uow() as uow:
        uow.execute(update(subscription).values(status="cancelled"))
        uow.commit()
    dry = sync_subscription(world.c, co["subscription_id"], dry_run=True)
    assert dry["differences"]["status"] == {"local": "cancelled", "provider": "active"}
    with world.c.uow() as uow:
        assert uow.execute(select(subscription.c.status)).scalar_one() == "cancelled"
    sync_subscription(world.c, co["subscription_id"])
    with world.c.uow() as uow:
        assert uow.execute(select(subscription.c.status)).scalar_one() == "active"


def test_sync_all_catches_a_cancellation_and_a_deletion(world):
    first, second = world.checkout("u1"), world.checkout("u2")
    world.sandbox.pay(first["order_id"])
    world.sandbox.pay(second["order_id"])
    since = world.c.clock.now()
    world.sandbox.cancel(first["subscription_id"])  # the local copy never heard of it
    world.sandbox.delete_subscription(second["subscription_id"])  # support deletes the second there
    with world.c.uow() as uow:
        uow.execute(update(subscription).values(provider_updated_at=since))
        uow.commit()
    result = sync_all(world.c, since)
    assert result["failed"] == []
    with world.c.uow() as uow:
        statuses = dict(uow.execute(select(subscription.c.id, subscription.c.status)).all())
    assert statuses == {first["subscription_id"]: "cancelled", second["subscription_id"]: "cancelled"}


def test_an_operators_sync_of_a_subscription_deleted_at_the_provider_cancels_our_copy(world):
    """Decision 215: `billingctl sync ID` of a subscription the provider no longer finds (deleted there, its
    event not yet read) failed with not found and left our copy active; it now cancels it, as the event
    does, and says so (a dry run only says so). An id we never held is still not found."""
    co = world.checkout("u3")
    world.sandbox.pay(co["order_id"])
    world.sandbox.delete_subscription(co["subscription_id"])
    dry = sync_subscription(world.c, co["subscription_id"], dry_run=True)
    assert dry["differences"] == {"status": {"local": "active", "provider": "cancelled"}}
    with world.c.uow() as uow:
        assert uow.subscriptions.status(co["subscription_id"]) == "active"
    done = sync_subscription(world.c, co["subscription_id"])
    assert (done["changed"], done["deleted_at_provider"]) == (True, True)
    with world.c.uow() as uow:
        assert uow.subscriptions.status(co["subscription_id"]) == "cancelled"
    assert sync_subscription(world.c, co["subscription_id"])["changed"] is False  # safe to re-run
    with pytest.raises(e.NotFound):
        sync_subscription(world.c, "sub_never_held")


def test_sync_all_pages_through_the_provider(world):
    for i in range(130):
        world.sandbox.create_customer(f"bulk_{i}", auto_collection="off")
        world.sandbox.create_subscription_for_items(f"bulk_{i}", "credits-basic-USD-monthly", None)
    before = world.sandbox.store.count_requests("provider")
    result = sync_all(world.c, None)
    assert result["listed"] == 130 and result["reread"] == 0
    assert world.sandbox.store.count_requests("provider") - before == 2  # ceil(130 / 100)


def test_invalidate_forces_a_provider_read(world):
    co = world.checkout()
    world.sandbox.pay(co["order_id"])
    assert get_for_user(world.c, "user_a", co["subscription_id"])["status"] == "active"
    world.sandbox.cancel(co["subscription_id"])
    before = world.sandbox.store.count_requests("provider", "GET")
    assert get_for_user(world.c, "user_a", co["subscription_id"])["status"] == "active"  # cached
    assert world.sandbox.store.count_requests("provider", "GET") == before
    invalidate_customer(world.c, "user_a")
    assert get_for_user(world.c, "user_a", co["subscription_id"])["status"] == "cancelled"


def test_stale_cache_is_served_while_the_breaker_is_open(world):
    no_sleep(world)
    co = world.checkout()
    other = world.checkout(item_price_id="credits-basic-USD-monthly")
    world.sandbox.pay(co["order_id"])
    assert get_for_user(world.c, "user_a", co["subscription_id"])["status"] == "active"
    world.sandbox.store.add_fault("provider", "500", count=-1)
    for _ in range(world.c.settings.breaker_min_calls):
        try:
            world.c.provider.get_item_price("x")
        except e.ExternalError:
            pass
    assert world.c.breakers["subscription_provider"].state() == "open"
    cached = get_for_user(world.c, "user_a", co["subscription_id"])
    assert cached["status"] == "active" and cached["stale"] is True
    with pytest.raises(e.CircuitOpen, match="Circuit breaker is open"):
        get_for_user(world.c, "user_a", other["subscription_id"])


def test_a_cancel_that_errors_but_took_effect_ends_cancelled(world):
    no_sleep(world)
    co = world.checkout()
    world.sandbox.pay(co["order_id"])
    world.sandbox.store.add_fault("provider", "error_after_effect", path="cancel_for_items", count=-1)
    result = cancel_subscription(world.c, co["subscription_id"], "customer asked", "ops")
    assert result["status"] == "cancelled"
    with world.c.uow() as uow:
        assert uow.execute(select(subscription.c.status)).scalar_one() == "cancelled"
        assert uow.execute(select(audit_log.c.action, audit_log.c.reason)).one() == ("subscription.cancel",
                                                                                      "customer asked")


# ---- watchdog ---------------------------------------------------------------------------------------

def test_watchdog_flags_a_stale_poller_once(world):
    from billingctl.domain.clock import ManualClock

    world.c.clock = ManualClock()
    assert events.poller_freshness(world.c)["stale"] is True  # never ran
    events.poll(world.c)
    assert events.watchdog(world.c)["stale"] is False
    world.c.clock.advance(301)
    assert events.watchdog(world.c)["stale"] is True
    events.watchdog(world.c)
    with world.c.uow() as uow:
        keys = uow.execute(select(alert_outbox.c.dedupe_key).where(alert_outbox.c.sink == "chat")).scalars().all()
    assert len(keys) == 1 and keys[0].startswith("poller-stale:")


def test_internal_endpoints(world):
    from webhooks_app import create_internal_app

    client = create_internal_app(container=world.c).test_client()
    auth = {"Authorization": "Bearer test-internal-token"}
    co = world.checkout()
    world.sandbox.pay(co["order_id"])
    polled = client.post("/internal/billing/poll", json={"all_invoices": True}, headers=auth)
    assert polled.status_code == 200 and polled.get_json()["invoice_scan"]["invoices_checked"] == 1
    assert world.credits() == 2000
    assert client.post("/internal/billing/poll", json={"all_invoices": "yes"}, headers=auth).status_code == 400
    assert client.post("/internal/billing/poll", json={"since": "yesterday"}, headers=auth).status_code == 400
    synced = client.post("/internal/billing/sync", json={"subscription_id": co["subscription_id"]}, headers=auth)
    assert synced.status_code == 200 and synced.get_json()["subscription_id"] == co["subscription_id"]
    assert client.post("/internal/billing/sync", json={"subscription_id": "sub_nope"}, headers=auth).status_code == 404
    assert client.post("/internal/billing/sync-all", json={}, headers=auth).status_code == 400
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 3600))
    assert client.post("/internal/billing/sync-all", json={"since": since}, headers=auth).status_code == 200
    assert client.post("/internal/cache/invalidate", json={"customer_id": "user_a"},
                       headers=auth).get_json()["invalidated"] is True


def test_all_invoices_scan_recovers_unapplied_credits(world):
    world.renewal_charged_unseen()
    # The payment_succeeded events are lost, and the webhook was dropped: only the invoice scan can tell.
    with world.sandbox.store.tx() as db:
        db.execute("DELETE FROM objects WHERE kind='event' AND data LIKE '%payment_succeeded%'")
    assert events.poll(world.c)["events_failed"] == 0
    assert world.purchases() == 1
    result = events.poll(world.c, all_invoices=True)
    # The invoices link transactions by id (no gateway id): the scan reads each transaction's reference.
    assert result["invoice_scan"]["recovered"] == 1 and result["invoice_scan"]["invoices_checked"] == 2
    assert world.purchases() == 2 and world.credits() == 4000


def test_without_all_invoices_the_recent_invoices_since_the_given_time_are_considered(world):
    """Issue "Hardening" 17 (spec 4, poll): with all_invoices false only recent invoices since the given
    time are considered; before, none were."""
    from datetime import timedelta

    world.renewal_charged_unseen()
    with world.sandbox.store.tx() as db:
        db.execute("DELETE FROM objects WHERE kind='event' AND data LIKE '%payment_succeeded%'")
    events.poll(world.c)
    assert world.purchases() == 1
    later = world.c.clock.now() + timedelta(hours=1)
    assert events.poll(world.c, since=later)["invoice_scan"]["invoices_checked"] == 0  # nothing that recent
    result = events.poll(world.c, since=world.c.clock.now() - timedelta(hours=1))
    assert result["invoice_scan"]["recovered"] == 1
    assert world.purchases() == 2 and world.credits() == 4000
    assert "invoice_scan" not in events.poll(world.c)  # the scheduled poll (no time given) lists no invoices


def test_a_catch_up_stops_when_its_budget_share_is_spent_and_the_next_run_resumes(make_settings, db_url):
    """Issue "Performance" 1: a catch-up under the real limit never exits 4 for the budget; it takes its
    share, stops, and the next run resumes where it stopped."""
    from billingctl.bootstrap import Container
    from billingctl.domain.clock import ManualClock

    def build():
        c = Container(make_settings(database_url=db_url, provider_rate_limit=4, provider_rate_max_wait_seconds=0),
                      clock=ManualClock())
        c.provider.http.sleep = lambda s: None
        return c

    first = build()
    base = first.sandbox.now() - 10_000
    for n in range(250):  # a backlog: two and a half pages of events nobody has polled
        first.sandbox.emit("customer_changed", {"customer": {"id": f"cus_{n}"}}, occurred_at=base + n * 30)
    result = events.poll(first)  # the batch share of 4 a minute is 2 pages
    assert result["budget_spent"] is True and result["error"] is None and result["events_processed"] == 200
    first.close()
    second = build()  # the next run, with a fresh budget
    resumed = events.poll(second)
    assert resumed["budget_spent"] is False and resumed["events_processed"] >= 50
    with second.uow() as uow:
        assert uow.execute(select(func.count()).select_from(event_inbox).where(
            event_inbox.c.event_type == "customer_changed")).scalar_one() == 250
    second.close()
