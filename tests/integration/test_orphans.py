"""Orphaned-payment recovery: the schedule, the cursor, restarts, same-plan duplicates, manual review."""

import threading

import pytest
from sqlalchemy import select

from billingctl.adapters.db.tables import alert_outbox, audit_log, orphan_recovery
from billingctl.bootstrap import Container
from billingctl.domain import errors as e
from billingctl.domain.clock import ManualClock
from billingctl.services import orphans
from billingctl.services.checkout import cleanup_expired
from billingctl.services.users import freeze
from tests.integration.conftest import World

pytestmark = pytest.mark.integration
PRO = "credits-pro-USD-monthly"


def build(make_settings, db_url, clock=None, **overrides):
    c = Container(make_settings(database_url=db_url, http_max_attempts=1, **overrides), clock=clock or ManualClock())
    c.provider.http.sleep = c.orchestrator.http.sleep = lambda s: None
    return World(c)


@pytest.fixture
def world(make_settings, db_url):
    w = build(make_settings, db_url)
    yield w
    w.c.close()


def advance(world, seconds):
    world.advance(seconds)


def orphan(world, user="user_a", plan=PRO):
    """A checkout-retry orphan: the checkout expires and is cleaned up, then the old session is paid. When
    the user already holds the plan, the checkout is one made before that rule (decision 110)."""
    from tests.helpers import legacy_checkout

    with world.c.uow() as uow:
        held = uow.subscriptions.holding_plan(user, plan, None)
    co = legacy_checkout(world.c, user, plan) if held else world.checkout(user, plan)
    advance(world, 2 * 86400)
    assert co["subscription_id"] in cleanup_expired(world.c)["cancelled"]
    payment = world.sandbox.pay(co["order_id"])  # its webhook arrives: left to orphan recovery
    assert world.purchases(payment["id"]) == 0
    advance(world, 16)  # older than the 15 s a fresh payment is given
    return co, payment


def row(world, payment_id):
    with world.c.uow() as uow:
        return uow.execute(select(orphan_recovery).where(orphan_recovery.c.payment_id == payment_id)).mappings().one()


def chat_alerts(world):
    with world.c.uow() as uow:
        return uow.execute(select(alert_outbox.c.dedupe_key, alert_outbox.c.payload).where(
            alert_outbox.c.sink == "chat")).all()


def test_a_typical_orphan_clears_on_the_first_attempt(world):
    co, payment = orphan(world)
    result = orphans.run_orphans(world.c)
    assert result["outcomes"] == {"recovered": 1}
    state = row(world, payment["id"])
    assert (state["status"], state["attempts"], state["resolution"]) == ("recovered", 0, "resubscribed")
    new_sub = state["subscription_id"]
    assert new_sub != co["subscription_id"]
    assert world.sandbox.subscription(new_sub)["status"] == "active"
    assert world.purchases(payment["id"]) == 1 and world.credits() == 2000
    assert orphans.run_orphans(world.c)["outcomes"] == {"recovered": 1}  # its row answers, nothing is redone
    assert world.credits() == 2000


def test_a_payment_older_than_the_grace_is_recovered_however_long_the_steps_took(world):
    """The harness's clocks: the sandbox's runs on with real time, so a model that moved our manual clock by
    the same seconds as the sandbox's fell behind on a slow machine, and a payment 16 s old looked too recent
    (the interleavings test failed on it in CI). Our clock must land on the sandbox's instant."""
    import time

    co, payment = orphan(world)
    time.sleep(1.5)  # a slow step: real time passes between the payment and the next tick
    advance(world, 0)
    skew = world.sandbox.store.now() - world.c.clock.now().timestamp()
    assert 0 <= skew < 0.5, skew
    assert orphans.run_orphans(world.c)["outcomes"] == {"recovered": 1}


def test_the_exact_schedule_and_exhaustion(world):
    _, payment = orphan(world)
    world.sandbox.store.add_fault("provider", "500", path="subscription_for_items", count=-1)
    gaps = []
    for n in range(1, 11):
        outcome = orphans.run_orphans(world.c)["outcomes"]
        state = row(world, payment["id"])
        if n < 10:
            assert outcome == {"retrying": 1} and state["attempts"] == n
            gap = state["next_attempt_at"] - world.c.clock.now()
            gaps.append(int(gap.total_seconds() // 60))
            world.c.clock.advance(gap.total_seconds() - 1)
            waiting = orphans.run_orphans(world.c)
            assert waiting["outcomes"] == {"waiting": 1}  # not a second early
            assert (waiting.outcome.done, waiting.outcome.failed, waiting.outcome.skipped) == (0, 0, 1)
            world.c.clock.advance(1)
        else:
            assert outcome == {"exhausted": 1}
    assert gaps == [1, 2, 4, 8, 16, 30, 30, 30, 30]
    state = row(world, payment["id"])
    assert (state["status"], state["attempts"]) == ("exhausted", 10)
    texts = [p["text"] for _, p in chat_alerts(world)]
    assert texts == ["ORPHANED PAYMENT RECOVERY EXHAUSTED - manual review required"]
    orphans.run_orphans(world.c)
    assert len(chat_alerts(world)) == 1


def test_a_new_process_continues_the_count_and_alerts_once(world, make_settings, db_url):
    _, payment = orphan(world)
    world.sandbox.store.add_fault("provider", "500", path="subscription_for_items", count=-1)
    for _ in range(5):
        orphans.run_orphans(world.c)
        world.c.clock.advance(31 * 60)
    assert row(world, payment["id"])["attempts"] == 5
    # A deploy: a fresh process with nothing in memory, and a second runner beside it.
    fresh = build(make_settings, db_url, clock=ManualClock(world.c.clock.now()))
    for _ in range(5):
        orphans.run_orphans(fresh.c)
        orphans.run_orphans(world.c)
        fresh.c.clock.advance(31 * 60)
        world.c.clock.advance(31 * 60)
    assert (row(world, payment["id"])["status"], row(world, payment["id"])["attempts"]) == ("exhausted", 10)
    assert len(chat_alerts(world)) == 1
    fresh.c.close()


def test_the_cursor_holds_behind_a_payment_under_retry(world):
    _, stuck = orphan(world)
    later = world.checkout("user_b")
    world.sandbox.store.add_fault("provider", "500", path="subscription_for_items", count=-1)
    orphans.run_orphans(world.c)
    advance(world, 60)
    world.sandbox.pay(later["order_id"])
    world.c.clock.advance(16)
    orphans.run_orphans(world.c)
    cursor = orphans._read_cursor(world.c)
    assert cursor <= row(world, stuck["id"])["settled_at"]
    for _ in range(12):
        world.c.clock.advance(31 * 60)
        orphans.run_orphans(world.c)
    assert row(world, stuck["id"])["status"] == "exhausted"
    assert orphans._read_cursor(world.c) > row(world, stuck["id"])["settled_at"]  # moved on


def test_same_plan_duplicate_refunds_once_even_with_two_runners(world, make_settings, db_url):
    world.sandbox.pay(world.checkout()["order_id"])  # the user already holds the plan
    _, payment = orphan(world)
    other = build(make_settings, db_url, clock=ManualClock(world.c.clock.now()))
    barrier = threading.Barrier(2)
    results = []

    def runner(w):
        barrier.wait()
        results.append(orphans.run_orphans(w.c)["outcomes"])

    threads = [threading.Thread(target=runner, args=(w,)) for w in (world, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    state = row(world, payment["id"])
    assert (state["status"], state["resolution"]) == ("duplicate_refunded", "refunded")
    refunded = world.sandbox.store.get("payment", payment["id"])
    assert refunded["processor"]["amountRefunded"] == payment["amount"] and len(refunded["refunds"]) == 1
    assert [p["text"] for _, p in chat_alerts(world)] == ["same-plan duplicate charge during orphan recovery"]
    assert world.credits() == 2000  # the orphan's credits were never applied
    orphans.run_orphans(world.c)
    assert len(world.sandbox.store.get("payment", payment["id"])["refunds"]) == 1
    other.c.close()


def test_a_frozen_user_gets_no_automatic_resubscription(world):
    _, payment = orphan(world)
    freeze(world.c, "user_a", "fraud review", "ops")
    assert orphans.run_orphans(world.c)["outcomes"] == {"needs_review": 1}
    assert world.purchases() == 0 and len(world.sandbox.store.all("subscription")) == 1
    assert row(world, payment["id"])["last_error"] == "user is frozen"


def test_manual_resolve_paths(world):
    _, first = orphan(world, "user_r")
    world.sandbox.store.add_fault("provider", "500", path="subscription_for_items", count=-1)
    orphans.run_orphans(world.c)
    with pytest.raises(e.InvalidInput):
        orphans.resolve(world.c, first["id"], "refund", " ", "ops")
    plan = orphans.resolve(world.c, first["id"], "refund", "customer asked", "ops", dry_run=True)
    assert plan["dry_run"] is True
    assert world.sandbox.store.get("payment", first["id"])["processor"]["amountRefunded"] == 0
    orphans.resolve(world.c, first["id"], "refund", "customer asked", "ops")
    assert row(world, first["id"])["status"] == "resolved"
    with pytest.raises(e.Refused, match="already resolved"):
        orphans.resolve(world.c, first["id"], "refund", "again", "ops")

    world.sandbox.store.clear_faults()
    _, second = orphan(world, "user_s")
    world.sandbox.store.add_fault("provider", "500", path="subscription_for_items", count=1)
    orphans.run_orphans(world.c)
    world.sandbox.refund(second["id"])  # refunded by someone at the orchestrator's console
    with pytest.raises(e.Refused, match="already refunded"):
        orphans.resolve(world.c, second["id"], "refund", "double", "ops")
    with pytest.raises(e.Refused, match="was refunded"):
        orphans.resolve(world.c, second["id"], "create-subscription", "x", "ops")
    orphans.resolve(world.c, second["id"], "mark-handled", "refunded by finance", "ops")

    _, third = orphan(world, "user_t")
    world.sandbox.store.add_fault("provider", "500", path="subscription_for_items", count=1)
    orphans.run_orphans(world.c)
    orphans.resolve(world.c, third["id"], "create-subscription", "user has nothing", "ops")
    assert world.purchases(third["id"]) == 1 and world.credits("user_t") == 2000
    with world.c.uow() as uow:
        actions = uow.execute(select(audit_log.c.action).order_by(audit_log.c.id)).scalars().all()
    assert actions == ["orphans.resolve.refund", "orphans.resolve.mark-handled", "orphans.resolve.create-subscription"]
    assert orphans.show(world.c, third["id"])["orphan"]["resolution"] == "resubscribed"


def test_retry_runs_one_attempt_now(world):
    _, payment = orphan(world)
    world.sandbox.store.add_fault("provider", "500", path="subscription_for_items", count=1)
    orphans.run_orphans(world.c)
    assert row(world, payment["id"])["status"] == "retrying"
    assert orphans.retry(world.c, payment["id"], "ops")["outcome"] == "recovered"
    with pytest.raises(e.Refused):
        orphans.retry(world.c, payment["id"], "ops")
    assert world.credits() == 2000


def test_an_orphan_refunded_before_recovery_is_not_resubscribed(world):
    """Found by the interleavings test: recovery used to re-subscribe and credit refunded money."""
    _, payment = orphan(world)
    world.sandbox.refund(payment["id"])
    assert orphans.run_orphans(world.c)["outcomes"] == {"refunded_elsewhere": 1}
    assert world.purchases() == 0 and len(world.sandbox.store.all("subscription")) == 1
    state = row(world, payment["id"])
    assert (state["status"], state["resolution"], state["next_attempt_at"]) == ("resolved", "refunded_elsewhere", None)


def test_a_duplicate_report_follows_up_on_the_purchases_own_subscription(world):
    """Found by the interleavings test: a late settled-poller report of a recovered orphan used to try
    to activate the cancelled subscription and fail with PaymentNotRecorded."""
    from billingctl.services.payments import record_payment

    _, payment = orphan(world)
    orphans.run_orphans(world.c)
    result = record_payment(world.c, world.sandbox.store.get("payment", payment["id"]), "settled_poller")
    assert result["outcome"] == "duplicate"
    assert result["subscription_id"] == row(world, payment["id"])["subscription_id"]
    assert result["activation"] == "already_active"


@pytest.mark.parametrize("path", ["automatic", "resolve --create-subscription"])
def test_a_recovered_orphan_leaves_nothing_for_the_renewals_job_to_charge(world, path):
    """Issue "Money paths" defect 1: re-subscription used to leave the new subscription's first invoice
    payment_due, and the next dunning tick charged the vaulted card for the same period again. Now the
    payment pays the invoice that starting the new subscription generates."""
    from billingctl.services.renewals import run_renewals

    _, payment = orphan(world, "user_o")
    if path == "automatic":
        assert orphans.run_orphans(world.c)["outcomes"] == {"recovered": 1}
    else:
        world.sandbox.store.add_fault("provider", "500", path="subscription_for_items", count=1)
        orphans.run_orphans(world.c)
        orphans.resolve(world.c, payment["id"], "create-subscription", "user has nothing", "ops")
    new_sub = row(world, payment["id"])["subscription_id"]
    invoices = [i for i in world.sandbox.store.all("invoice") if i["subscription_id"] == new_sub]
    assert [i["status"] for i in invoices] == ["paid"]  # the provider's books: the period is paid
    assert run_renewals(world.c)["outcomes"] == {}
    charges = [p for p in world.sandbox.store.all("payment") if p["customerId"] == "user_o"]
    assert [p["id"] for p in charges] == [payment["id"]]  # the orchestrator's books: charged once
    assert world.purchases(payment["id"]) == 1 and world.credits("user_o") == 2000


def test_an_outage_during_a_run_holds_the_cursor_at_the_oldest_failed_payment(world):
    """Issue "Money paths" defect 2: the cursor used to hold at now minus 16 s after a failed check, so a
    run during an orchestrator outage skipped every missed payment but the newest, for good."""
    missed = []
    for user in ("user_1", "user_2", "user_3"):
        co = world.checkout(user)
        missed.append(world.settle(co["order_id"]))  # settled; webhook lost
        advance(world, 120)
    world.sandbox.store.add_fault("orchestrator", "503", method="GET", path="/payments/pay", count=-1)
    outcomes = orphans.run_orphans(world.c)["outcomes"]
    assert outcomes == {"error": 3}
    assert world.purchases() == 0
    cursor = orphans._read_cursor(world.c)
    assert cursor <= min(world.c.clock.now().fromtimestamp(p["date"], cursor.tzinfo) for p in missed)
    world.sandbox.store.clear_faults()
    advance(world, 60)
    assert orphans.run_orphans(world.c)["outcomes"] == {"recorded": 3}
    assert all(world.purchases(p["id"]) == 1 for p in missed)
    assert [world.credits(u) for u in ("user_1", "user_2", "user_3")] == [2000, 2000, 2000]


def test_an_orphan_whose_activation_failed_once_is_recovered_on_the_next_attempt(world):
    """Issue "Money paths" defect 7: the purchase written by the failed attempt made later runs answer
    `recorded` before looking at the orphan row, which stayed `retrying` for ever and pinned the cursor."""
    _, payment = orphan(world)
    world.sandbox.store.add_fault("provider", "500", path="update_for_items", count=-1)
    assert orphans.run_orphans(world.c)["outcomes"] == {"retrying": 1}
    world.sandbox.store.clear_faults()
    advance(world, 61)
    assert orphans.run_orphans(world.c)["outcomes"] == {"recovered": 1}
    state = row(world, payment["id"])
    assert (state["status"], state["resolution"]) == ("recovered", "resubscribed")
    assert world.sandbox.subscription(state["subscription_id"])["status"] == "active"
    assert world.purchases(payment["id"]) == 1 and world.credits() == 2000
    later = world.settle(world.checkout("user_b")["order_id"])
    advance(world, 61)
    assert orphans.run_orphans(world.c)["outcomes"] == {"recovered": 1, "recorded": 1}
    assert orphans._read_cursor(world.c).timestamp() == later["date"]  # no longer pinned


def test_the_schedule_is_timed_from_when_each_attempt_was_due_not_from_the_late_tick(world):
    """Issue "Money paths" 13: with a job every minute, the gaps grew to 2, 3, 5, 9, 17, 31 minutes."""
    _, payment = orphan(world)
    world.sandbox.store.add_fault("provider", "500", path="subscription_for_items", count=-1)
    orphans.run_orphans(world.c)
    first_due = row(world, payment["id"])["next_attempt_at"] - orphans.orphan_retry_delay(1)
    dues = []
    for _ in range(5):
        due = row(world, payment["id"])["next_attempt_at"]
        dues.append(int((due - first_due).total_seconds() // 60))
        world.c.clock.advance((due - world.c.clock.now()).total_seconds() + 40)  # the tick comes 40 s late
        orphans.run_orphans(world.c)
    assert dues == [1, 3, 7, 15, 31]  # cumulative 1, 2, 4, 8, 16 minutes from the first attempt


def test_an_order_paid_again_after_its_first_charge_was_recovered_elsewhere_is_refunded(world):
    """Found by the exploration at e77de16 (decision 221): one checkout form paid twice with recovery
    between. The first charge was recovered onto a new subscription (its purchase names that one), an
    operator cancelled it, and the second charge of the same order was recovered into a third subscription
    and credited too: the paid-twice check looked only at purchases on the order's own subscription."""
    from billingctl.services.sync import cancel_subscription

    co, first = orphan(world, "user_t")
    assert orphans.run_orphans(world.c)["outcomes"] == {"recovered": 1}
    recovered_on = row(world, first["id"])["subscription_id"]
    assert recovered_on != co["subscription_id"] and world.credits("user_t") == 2000
    cancel_subscription(world.c, recovered_on, "customer asked", "ops")
    second = world.sandbox.pay(co["order_id"])  # the same payment form, paid again
    assert world.purchases(second["id"]) == 0
    advance(world, 16)
    orphans.run_orphans(world.c)
    state = row(world, second["id"])
    assert (state["status"], state["resolution"]) == ("duplicate_refunded", "refunded")
    refunded = world.sandbox.store.get("payment", second["id"])  # the orchestrator's books: given back once
    assert refunded["processor"]["amountRefunded"] == second["amount"] and len(refunded["refunds"]) == 1
    live = [s["id"] for s in world.sandbox.store.all("subscription")
            if s["customer_id"] == "user_t" and s["status"] != "cancelled"]
    assert live == []  # no third subscription for a charge of an order paid already
    assert world.purchases(second["id"]) == 0 and world.credits("user_t") == 2000  # one term credited
    assert orphans.run_orphans(world.c)["outcomes"] == {"duplicate_refunded": 1}  # re-run: its row answers
    assert len(world.sandbox.store.get("payment", second["id"])["refunds"]) == 1 and world.credits("user_t") == 2000


def test_an_order_paid_again_after_a_person_kept_its_first_charge_is_refunded(world):
    """Found by the exploration at add2263 (decision 252): a checkout left pending in a second tab was paid
    after support cancelled its subscription; its recovery went to a person, who marked it handled (the
    charge stands by their decision). The customer then paid the same order again from the other tab, and
    recovery gave that second charge a new subscription: charged twice for one checkout, and reconcile,
    whose window no longer held the first, was clean."""
    from billingctl.services.users import unfreeze

    co, first = orphan(world, "user_t")
    freeze(world.c, "user_t", "chargeback risk", "ops")
    assert orphans.run_orphans(world.c)["outcomes"] == {"needs_review": 1}  # frozen: a person decides
    orphans.resolve(world.c, first["id"], "mark-handled", "settled with the customer by phone", "ops")
    unfreeze(world.c, "user_t", "cleared", "ops")
    second = world.sandbox.pay(co["order_id"])  # the other tab pays the same order
    advance(world, 16)
    assert orphans.run_orphans(world.c)["outcomes"] == {"resolved": 1, "duplicate_refunded": 1}  # first: as kept
    state = row(world, second["id"])
    assert (state["status"], state["resolution"]) == ("duplicate_refunded", "refunded")
    refunded = world.sandbox.store.get("payment", second["id"])
    assert refunded["processor"]["amountRefunded"] == second["amount"] and len(refunded["refunds"]) == 1
    assert [s["id"] for s in world.sandbox.store.all("subscription")
            if s["customer_id"] == "user_t" and s["status"] != "cancelled"] == []  # nothing made for it
    assert world.purchases(second["id"]) == 0 and world.credits("user_t") == 0
    [(_, alert)] = [(k, p) for k, p in chat_alerts(world) if k == f"orphan-duplicate:{second['id']}"]
    assert {"title": "paid_by", "value": first["id"], "short": True} in alert["attachments"][0]["fields"]
    assert orphans.run_orphans(world.c)["outcomes"] == {"duplicate_refunded": 1}  # re-run: its row answers
    assert len(world.sandbox.store.get("payment", second["id"])["refunds"]) == 1


def test_an_order_paid_again_after_a_person_kept_a_first_charge_since_refunded_is_recovered(world):
    """The other side of decision 252: a first charge marked handled and then refunded in full at the
    orchestrator no longer pays the order, so the second charge is the customer's only one: recovered."""
    from billingctl.services.users import unfreeze

    co, first = orphan(world, "user_t")
    freeze(world.c, "user_t", "chargeback risk", "ops")
    orphans.run_orphans(world.c)
    orphans.resolve(world.c, first["id"], "mark-handled", "refunded by support", "ops")
    world.sandbox.refund(first["id"])  # support refunds it at the orchestrator's dashboard
    unfreeze(world.c, "user_t", "cleared", "ops")
    second = world.sandbox.pay(co["order_id"])
    advance(world, 16)
    assert orphans.run_orphans(world.c)["outcomes"] == {"resolved": 1, "recovered": 1}
    assert world.purchases(second["id"]) == 1 and world.credits("user_t") == 2000


def test_a_second_charge_of_an_order_older_than_reconciles_window_is_named_charged_twice(world):
    """Decision 252: the daily reconcile paired the charges of one order only within its window, so an order
    paid again a day after its first charge (the first waiting for a person, the second recovered into a
    subscription) was reported clean. A charge of a checkout begun before the window is paired with the
    order's earlier charges at the orchestrator, until the person refunds one."""
    from billingctl.services.reconcile import reconcile
    from billingctl.services.users import unfreeze

    co, first = orphan(world, "user_t")
    freeze(world.c, "user_t", "chargeback risk", "ops")
    assert orphans.run_orphans(world.c)["outcomes"] == {"needs_review": 1}
    clean = reconcile(world.c)
    assert clean["window"]["full"] is True and clean["ok"] is True, clean["violations"]
    advance(world, 86400)
    assert reconcile(world.c)["ok"] is True  # the next day's run: the watermark passes the first charge
    advance(world, 6 * 3600)
    unfreeze(world.c, "user_t", "cleared", "ops")
    second = world.sandbox.pay(co["order_id"])  # the other tab, a day later and more
    advance(world, 16)
    assert orphans.run_orphans(world.c)["outcomes"] == {"needs_review": 1, "recovered": 1}  # the first waits
    advance(world, 3600)
    report = reconcile(world.c)
    assert report["window"]["full"] is False and report["checked"]["payments"] == 1  # the second only
    assert [(v["payment_id"], v["payment_ids"]) for v in report["violations"] if v["check"] == "order_charged_twice"] \
        == [(second["id"], [first["id"], second["id"]])]
    orphans.resolve(world.c, first["id"], "refund", "charged twice", "ops")
    advance(world, 3600)
    assert "order_charged_twice" not in {v["check"] for v in reconcile(world.c)["violations"]}
