"""Renewals and dunning: lock-routed MIT charges, card substitution, lock-read aborts, the MIT quota,
the retry schedule and its exhaustion, freezing, the velocity watch."""

import logging
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import insert, select

from billingctl.adapters.db.tables import alert_outbox, audit_log, dunning_attempt, fraud_event, transaction
from billingctl.bootstrap import Container
from billingctl.domain.clock import ManualClock
from billingctl.services.renewals import list_attempts, run_renewals
from billingctl.services.users import freeze, velocity_watch
from tests.helpers import table_away
from tests.integration.conftest import World

pytestmark = pytest.mark.integration
PRO, NSFW = "credits-pro-USD-monthly", "credits-pro-nsfw-USD-monthly"
MONTH = 31 * 86400


@pytest.fixture
def world(make_settings, db_url):
    c = Container(make_settings(database_url=db_url), clock=ManualClock())
    c.provider.http.sleep = c.orchestrator.http.sleep = lambda s: None
    yield World(c)
    c.close()


def subscribed(world, user="user_a", plan=PRO, method="PAYMENT_CARD", processor=None):
    co = world.checkout(user, plan)
    world.sandbox.pay(co["order_id"], method=method, processor=processor)
    return co


def month_passes(world):
    world.sandbox.store.advance_clock(MONTH)
    world.c.clock.advance(MONTH)


def charges(world):
    return world.sandbox.store.count_requests("orchestrator", "POST", "/payments")


def attempts(world, user="user_a"):
    return [(a["status"], a["decline_code"]) for a in reversed(list_attempts(world.c, user_id=user))]


def test_an_sfw_renewal_charges_the_locked_processor_and_credits_once(world):
    subscribed(world, processor="SFW_ADYEN")
    month_passes(world)
    result = run_renewals(world.c)
    assert result["outcomes"] == {"succeeded": 1}
    payment = world.sandbox.payments("SETTLED")[-1]
    assert payment["metadata"]["psp"] == "SFW_ADYEN" and payment["processor"]["name"] == "SFW_ADYEN"
    assert payment["paymentMethod"]["paymentType"] == "SUBSCRIPTION"
    assert world.credits() == 4000  # the settle webhook also arrived: still once
    assert attempts(world) == [("succeeded", None)]
    assert run_renewals(world.c)["outcomes"] == {}  # the invoice is paid: nothing due


def test_nsfw_wallet_only_customer_sends_the_wallet_and_stays_in_dunning(world, caplog):
    subscribed(world, plan=NSFW, method="PAYPAL")
    month_passes(world)
    with caplog.at_level(logging.INFO, logger="billingctl.renewals"):
        assert run_renewals(world.c)["outcomes"] == {"declined": 1}
    assert "nsfw_renewal_no_card_found" in [r.getMessage() for r in caplog.records]
    assert attempts(world) == [("declined", "PAYMENT_METHOD_NOT_SUPPORTED")]
    assert world.sandbox.store.all("subscription")[0]["status"] == "active"  # in dunning, not cancelled


@pytest.mark.parametrize(("card", "substituted"), [("valid", True), ("expired", False), ("deleted", False)])
def test_nsfw_card_substitution(world, caplog, card, substituted):
    subscribed(world, plan=NSFW, method="PAYPAL")
    world.sandbox.add_instrument("user_a", "PAYMENT_CARD", expired=card == "expired", deleted=card == "deleted")
    month_passes(world)
    with caplog.at_level(logging.INFO, logger="billingctl.renewals"):
        run_renewals(world.c)
    messages = [r.getMessage() for r in caplog.records]
    if substituted:
        assert "nsfw_renewal_card_substitution" in messages
        assert attempts(world) == [("succeeded", None)]
        assert world.sandbox.payments("SETTLED")[-1]["paymentMethod"]["paymentMethodType"] == "PAYMENT_CARD"
    else:
        assert "nsfw_renewal_no_card_found" in messages
        assert attempts(world)[0][0] == "declined"


def test_a_stored_card_is_used_as_is_and_sfw_never_substitutes(world, caplog):
    subscribed(world, "nsfw_user", plan=NSFW)
    subscribed(world, "sfw_user", plan=PRO, method="PAYPAL")
    world.sandbox.add_instrument("sfw_user", "PAYMENT_CARD")
    month_passes(world)
    with caplog.at_level(logging.INFO, logger="billingctl.renewals"):
        assert run_renewals(world.c)["outcomes"] == {"succeeded": 2}
    assert not any("substitution" in r.getMessage() for r in caplog.records)
    sfw_payment = next(p for p in world.sandbox.payments("SETTLED") if p["customerId"] == "sfw_user"
                       and p["paymentMethod"]["paymentType"] == "SUBSCRIPTION")
    assert sfw_payment["paymentMethod"]["paymentMethodType"] == "PAYPAL"


@pytest.mark.parametrize("plan", [PRO, NSFW])
def test_a_lock_read_failure_aborts_without_charging_then_the_next_tick_charges(world, plan):
    subscribed(world, plan=plan)
    month_passes(world)
    before = charges(world)
    with table_away(world.c.engine, "user_credits"):
        assert run_renewals(world.c)["outcomes"] == {"aborted": 1}
    assert charges(world) == before
    assert attempts(world) == [("aborted", "lock_read_failed")]
    assert run_renewals(world.c)["outcomes"] == {"succeeded": 1}


def test_the_mit_quota_blocks_in_production(make_settings, db_url, tmp_path, caplog, redis_url):
    from tests.helpers import ProductionStack

    with ProductionStack(make_settings, db_url, tmp_path, clock=ManualClock(), redis_url=redis_url) as stack:
        world = World(stack.container)
        world.sandbox = stack.sandbox
        subscribed(world, plan=NSFW)
        month_passes(world)
        now = world.c.clock.now()
        with world.c.uow() as uow:
            for i in range(5):
                uow.execute(insert(fraud_event).values(user_id="user_a", event_type="authorization_attempt",
                                                       created_at=now - timedelta(hours=i + 1),
                                                       metadata={"merchant_context": "full", "amount": 2999}))
            uow.commit()
        before = charges(world)
        with caplog.at_level(logging.WARNING, logger="billingctl.renewals"):
            assert run_renewals(world.c)["outcomes"] == {"quota_blocked": 1}
        [blocked] = [r for r in caplog.records if r.getMessage() == "MIT blocked: authorization count quota exhausted"]
        invoice = [i for i in world.sandbox.store.all("invoice") if i["status"] == "payment_due"][0]
        assert (blocked.invoice_id, blocked.user_id, blocked.window) == (invoice["id"], "user_a", "daily")
        assert charges(world) == before
        row = list_attempts(world.c, user_id="user_a")[0]
        with world.c.uow() as uow:
            processor = uow.locks.read("user_a")["nsfw_processor"]
        assert (row["status"], row["decline_code"], row["attempt_no"], row["lane"], row["processor"], row["amount"]) \
            == ("quota_blocked", "authorization_quota", 1, "nsfw", processor, invoice["amount_due"])
        assert processor
        assert row["next_attempt_at"] == now - timedelta(hours=5) + timedelta(days=1)  # the oldest leaves
        assert run_renewals(world.c)["outcomes"] == {"not_due": 1}


def test_the_retry_schedule_is_followed_then_exhausted(world):
    co = subscribed(world)
    world.sandbox.decline_customer("user_a")
    month_passes(world)
    schedule = world.c.settings.renewal_retry_hours
    for hours in schedule:
        assert run_renewals(world.c)["outcomes"] == {"declined": 1}
        assert run_renewals(world.c)["outcomes"] == {"not_due": 1}
        world.c.clock.advance(hours * 3600 - 1)
        assert run_renewals(world.c)["outcomes"] == {"not_due": 1}
        world.c.clock.advance(1)
    assert run_renewals(world.c)["outcomes"] == {"exhausted": 1}
    statuses = [s for s, _ in attempts(world)]
    assert statuses == ["declined"] * (len(schedule) + 1) + ["exhausted"]
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "cancelled"
    with world.c.uow() as uow:
        notes = uow.execute(select(alert_outbox.c.dedupe_key).where(alert_outbox.c.sink == "notify")).scalars().all()
    assert notes == [f"dunning-exhausted:{co['subscription_id']}"]
    assert run_renewals(world.c)["outcomes"] == {"closed": 1}  # nothing more for this invoice


def test_freeze_is_idempotent_and_blocks_payments(world):
    from billingctl.domain.errors import AccountFrozen
    from billingctl.services.checkout import create_checkout

    subscribed(world)
    month_passes(world)
    assert list(world.c.provider.list_invoices(status="payment_due"))  # the renewal invoice is due
    first = freeze(world.c, "user_a", "chargeback", "ops", void_invoices=True, notify=True)
    assert first["changed"] is True and len(first["voided"]) == 1
    second = freeze(world.c, "user_a", "chargeback", "ops", void_invoices=True, notify=True)
    assert second == {"user_id": "user_a", "frozen": True, "changed": False, "voided": [], "void_failed": []}
    with world.c.uow() as uow:
        assert uow.execute(select(audit_log.c.action)).scalars().all() == ["user.freeze"]
        assert uow.execute(select(alert_outbox.c.dedupe_key).where(
            alert_outbox.c.sink == "notify")).scalars().all() == ["freeze:user_a"]
    with pytest.raises(AccountFrozen):
        create_checkout(world.c, "user_a", PRO)
    before = charges(world)
    assert run_renewals(world.c)["outcomes"].get("succeeded") is None
    assert charges(world) == before


def test_a_frozen_user_with_a_due_renewal_is_skipped(world):
    subscribed(world)
    month_passes(world)
    freeze(world.c, "user_a", "fraud review", "ops")
    before = charges(world)
    assert run_renewals(world.c)["outcomes"] == {"skipped_frozen": 1}
    assert charges(world) == before


def test_velocity_watch_alerts_once_per_window(world):
    now = world.c.clock.now()
    with world.c.uow() as uow:
        for i in range(11):
            uow.execute(insert(transaction).values(transaction_id=f"pay_v{i}", amount=100, status="captured",
                                                   created_at=now - timedelta(seconds=i), customer_id="speedy"))
        uow.execute(insert(transaction).values(transaction_id="pay_big", amount=150_000, status="captured",
                                               created_at=now, customer_id="whale"))
        uow.commit()
    result = velocity_watch(world.c)
    assert {o["user_id"] for o in result["offenders"]} == {"speedy", "whale"}
    velocity_watch(world.c)
    with world.c.uow() as uow:
        keys = uow.execute(select(alert_outbox.c.dedupe_key).where(alert_outbox.c.sink == "chat")).scalars().all()
    bucket = now.strftime("%Y%m%d%H%M")
    assert sorted(keys) == sorted([f"velocity:speedy:{bucket}", f"velocity:whale:{bucket}", f"velocity:all:{bucket}"])
    world.c.clock.advance(120)
    assert velocity_watch(world.c)["offenders"] == []


def test_freeze_endpoint(world):
    from webhooks_app import create_internal_app

    client = create_internal_app(container=world.c).test_client()
    auth = {"Authorization": "Bearer test-internal-token"}
    # Issue "Money paths" defect 10: an unknown user is refused, not created frozen.
    unknown = client.post("/internal/users/user_z/freeze", headers=auth)
    assert unknown.status_code == 404
    assert unknown.get_json() == {"error": "not_found", "message": "user user_z not found"}
    subscribed(world, user="user_z")
    response = client.post("/internal/users/user_z/freeze", headers=auth)
    assert response.status_code == 200 and response.get_json()["changed"] is True
    assert client.post("/internal/users/user_z/freeze", headers=auth).get_json()["changed"] is False
    assert client.post("/internal/users/user_z/freeze").status_code == 401


def test_dunning_rows_carry_the_spec_fields(world):
    subscribed(world)
    world.sandbox.decline_customer("user_a")
    month_passes(world)
    run_renewals(world.c)
    with world.c.uow() as uow:
        row = uow.execute(select(dunning_attempt)).mappings().one()
    assert row["invoice_id"] and row["created_at"] and row["status"] == "declined"
    assert row["decline_code"] == "DO_NOT_HONOR" and row["processor"] == "SFW_STRIPE"
    assert isinstance(row["created_at"], datetime) and row["created_at"].tzinfo == UTC


# ---- issue "Money paths" defect 4: errors are not authorizations; permanent ones do not loop --------

def quota_rows(world, user="user_a"):
    with world.c.uow() as uow:
        return uow.execute(select(fraud_event.c.dedupe_key).where(
            fraud_event.c.user_id == user, fraud_event.c.event_type == "authorization_attempt")).scalars().all()


@pytest.mark.parametrize("kind", ["503", "401", "reset"])
def test_charges_that_never_reached_a_processor_are_not_authorization_attempts(world, kind):
    subscribed(world, plan=NSFW)
    before = quota_rows(world)
    assert len(before) == 1  # the checkout's authorization
    month_passes(world)
    world.sandbox.store.add_fault("orchestrator", kind, method="POST", path="/payments", count=-1)
    waits = []
    for _ in range(5):
        assert run_renewals(world.c)["outcomes"] == {"error": 1}
        last = list_attempts(world.c, user_id="user_a")[0]
        waits.append((last["next_attempt_at"] - world.c.clock.now()).total_seconds() / 60)
        world.c.clock.advance(last["next_attempt_at"].timestamp() - world.c.clock.now().timestamp())
    assert quota_rows(world) == before  # five ticks of outage blocked nobody's checkout
    assert waits == [10, 20, 40, 80, 160]  # backing off, not every tick for ever
    pages = [p["text"] for p in chat_payloads(world)]
    assert len([t for t in pages if t.startswith("Renewals cannot charge")]) == (1 if kind == "401" else 0)
    world.sandbox.store.clear_faults()
    assert run_renewals(world.c)["outcomes"] == {"succeeded": 1}
    assert len(quota_rows(world)) == 2  # the one real authorization counts


def test_a_renewal_retry_after_a_charge_that_never_authorized_counts_when_it_is_made(world):
    """Found by the exploration (production, 2026-12-04, decision 254): a renewal charge left PENDING was
    cancelled at its age limit; the invoice's quota reservation, never taken by an authorization, stayed
    with the first attempt's time, and the next attempt days later took it over with that old time. The
    retry's authorization fell outside the daily window it was made in, so a further charge started with
    the window full. Each attempt's reservation counts from when that attempt is made."""
    subscribed(world, plan=NSFW)
    month_passes(world)
    world.sandbox.async_charges("PENDING")
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    world.c.clock.advance(world.c.settings.renewal_in_flight_max_hours * 3600 + 1)
    assert run_renewals(world.c)["outcomes"] == {"declined": 1}  # cancelled: no authorization happened
    world.sandbox.async_charges(None)
    [due] = [a["next_attempt_at"] for a in list_attempts(world.c, user_id="user_a")[:1]]
    wait = max((due - world.c.clock.now()).total_seconds(), 0) + 1
    world.c.clock.advance(wait)
    world.sandbox.store.advance_clock(wait)
    made = world.c.clock.now()
    assert run_renewals(world.c)["outcomes"] == {"succeeded": 1}
    retry = list_attempts(world.c, user_id="user_a")[0]["payment_id"]
    with world.c.uow() as uow:
        counted = uow.execute(select(fraud_event.c.created_at).where(
            fraud_event.c.dedupe_key == f"payment:{retry}")).scalar_one()
    assert abs((counted - made).total_seconds()) < 60, (counted, made)
    assert len(quota_rows(world)) == 2  # the checkout's and the retry's: the cancelled charge authorized nothing


def test_refused_credentials_page_once_in_any_24_hours_even_across_midnight(world):
    """The page for refused credentials was keyed on the calendar day: an outage that began at 23:00 paged at
    23:00 and again after midnight (CI caught it when it ran late in the day). Once in any 24 hours."""
    subscribed(world, plan=NSFW)
    month_passes(world)
    now = world.c.clock.now()
    to_late_evening = (now.replace(hour=23, minute=0, second=0, microsecond=0) - now) % timedelta(days=1)
    world.sandbox.store.advance_clock(to_late_evening.total_seconds())
    world.c.clock.advance(to_late_evening.total_seconds())
    world.sandbox.store.add_fault("orchestrator", "401", method="POST", path="/payments", count=-1)

    def pages():
        return [p["text"] for p in chat_payloads(world) if p["text"].startswith("Renewals cannot charge")]

    started = world.c.clock.now()
    seen = []  # (hours since the first page, pages so far) at each tick: 10, 20, 40 ... minutes, then 12 hours
    while not seen or seen[-1][0] < 24:
        assert run_renewals(world.c)["outcomes"] == {"error": 1}
        seen.append(((world.c.clock.now() - started) / timedelta(hours=1), len(pages())))
        due = list_attempts(world.c, user_id="user_a")[0]["next_attempt_at"]
        world.c.clock.advance((due - world.c.clock.now()).total_seconds())
    assert {n for hours, n in seen[:-1]} == {1}  # across midnight: still the one page
    assert seen[-1][1] == 2  # a day on, the outage still on: paged again


def chat_payloads(world):
    with world.c.uow() as uow:
        return uow.execute(select(alert_outbox.c.payload).where(alert_outbox.c.sink == "chat")).scalars().all()


def test_a_refused_charge_counts_toward_the_retry_schedule_and_exhausts(world):
    co = subscribed(world)
    month_passes(world)
    world.sandbox.store.add_fault("orchestrator", "400", method="POST", path="/payments", count=-1)
    schedule = world.c.settings.renewal_retry_hours
    for hours in schedule:
        assert run_renewals(world.c)["outcomes"] == {"failed": 1}
        world.c.clock.advance(hours * 3600)
    assert run_renewals(world.c)["outcomes"] == {"exhausted": 1}
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "cancelled"
    assert charges(world) == len(schedule) + 1  # one refused request per attempt, none after exhaustion


def test_a_lost_answer_is_resolved_by_the_same_request_before_any_new_charge(world):
    subscribed(world, plan=NSFW)
    month_passes(world)
    world.sandbox.store.add_fault("orchestrator", "error_after_effect", method="POST", path="/payments",
                                  count=world.c.settings.http_max_attempts)
    assert run_renewals(world.c)["outcomes"] == {"error": 1}  # charged, but every answer was lost
    world.c.clock.advance(600)
    # Its settle reached the provider and our books meanwhile: the invoice is paid, nothing is charged again.
    assert run_renewals(world.c)["outcomes"] == {}
    renewals = [p for p in world.sandbox.store.all("payment") if p["paymentMethod"]["paymentType"] == "SUBSCRIPTION"]
    assert len(renewals) == 1  # the orchestrator's books: charged once
    assert len(quota_rows(world)) == 2 and world.credits() == 6000


def test_nsfw_substitution_prefers_the_card_vaulted_at_the_latest_nsfw_checkout(world, caplog):
    """Issue "Money paths" 13: the oldest usable card was chosen. Spec 3 rule 3: when making the new
    card primary failed at checkout, the next renewal retries the substitution, with that card."""
    world.sandbox.add_instrument("user_a", "PAYPAL", default=True)  # the primary: a wallet
    old_card = world.sandbox.add_instrument("user_a", "PAYMENT_CARD")
    world.sandbox.store.add_fault("orchestrator", "500", method="POST", path="/default", count=-1)
    co = world.checkout("user_a", NSFW)
    paid = world.sandbox.pay(co["order_id"])  # a new card; making it primary fails
    world.sandbox.store.clear_faults()
    new_token = paid["paymentMethod"]["paymentMethodToken"]
    assert new_token != old_card["token"]
    month_passes(world)
    with caplog.at_level(logging.INFO, logger="billingctl.renewals"):
        assert run_renewals(world.c)["outcomes"] == {"succeeded": 1}
    assert "nsfw_renewal_card_substitution" in [r.getMessage() for r in caplog.records]
    renewal = [p for p in world.sandbox.store.all("payment") if p["paymentMethod"]["paymentType"] == "SUBSCRIPTION"]
    assert [p["paymentMethod"]["paymentMethodToken"] for p in renewal] == [new_token]


def test_a_long_backlog_spreads_over_ticks_without_overrunning_the_lease(make_settings, db_url):
    """Issue "Performance" 1: a tick with many due invoices stops at its time budget; the rest stays
    payment_due and the next tick takes it up. Nothing is charged twice."""
    c = Container(make_settings(database_url=db_url, renewals_tick_max_seconds=0), clock=ManualClock())
    c.provider.http.sleep = c.orchestrator.http.sleep = lambda s: None
    world = World(c)
    subscribed(world, "user_1")
    subscribed(world, "user_2")
    month_passes(world)
    first = run_renewals(c)
    assert first["outcomes"] == {"succeeded": 1, "deferred": 1}
    assert (first.outcome.done, first.outcome.failed, first.outcome.skipped) == (1, 0, 1)
    second = run_renewals(c)
    assert second["outcomes"] == {"succeeded": 1}
    assert (second.outcome.done, second.outcome.failed, second.outcome.skipped) == (1, 0, 0)
    assert run_renewals(c)["outcomes"] == {}
    assert charges(world) == 2
    c.close()
