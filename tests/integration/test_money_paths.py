"""Issue "Money paths": flows that cross several paths (a freeze then a late payment, a cancellation at
the provider then a payment, a refund reported before its settle, an outage in the middle of a
webhook), judged from our books and from the sandbox's provider and orchestrator."""

import pytest
from sqlalchemy import select

from billingctl.adapters.db.tables import alert_outbox, orphan_recovery
from billingctl.bootstrap import Container
from billingctl.domain import errors as e
from billingctl.domain.clock import ManualClock
from billingctl.services import orphans
from billingctl.services.users import freeze, unfreeze

pytestmark = pytest.mark.integration
PRO, NSFW = "credits-pro-USD-monthly", "credits-pro-nsfw-USD-monthly"


@pytest.fixture
def world(one_try_world):
    return one_try_world


def advance(world, seconds):
    world.advance(seconds)


def chat(world):
    with world.c.uow() as uow:
        return [p["text"] for p in uow.execute(select(alert_outbox.c.payload).where(
            alert_outbox.c.sink == "chat")).scalars()]


def review_row(world, payment_id):
    with world.c.uow() as uow:
        return uow.execute(select(orphan_recovery).where(orphan_recovery.c.payment_id == payment_id)).mappings().first()


# ---- defect 10: a freeze disables further payments --------------------------------------------------

def test_a_payment_settled_after_a_freeze_is_held_for_review_then_recorded_once_unfrozen(world):
    co = world.checkout()
    freeze(world.c, "user_a", "chargeback", "ops")
    payment = world.sandbox.pay(co["order_id"])  # the still-open checkout is paid; its webhook arrives
    assert world.purchases() == 0 and world.credits() == 0
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "future"  # not activated
    held = review_row(world, payment["id"])
    assert (held["status"], held["last_error"]) == ("needs_review", "user is frozen")
    advance(world, 60)
    assert orphans.run_orphans(world.c)["outcomes"] == {"needs_review": 1}  # the poller sees it held
    assert len([t for t in chat(world) if payment["id"] in t]) == 1  # one chat alert
    # A person decides: unfreeze, then retry records it on its own subscription.
    unfreeze(world.c, "user_a", "chargeback lost by the customer", "ops")
    assert orphans.retry(world.c, payment["id"], "ops")["outcome"] == "recovered"
    assert world.purchases(payment["id"]) == 1 and world.credits() == 2000
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "active"
    assert review_row(world, payment["id"])["resolution"] == "recorded"
    invoices = [i for i in world.sandbox.store.all("invoice") if i["subscription_id"] == co["subscription_id"]]
    assert [i["status"] for i in invoices] == ["paid"]


def test_a_freeze_made_while_a_payment_is_being_recorded_comes_after_its_credit(world, monkeypatch):
    """Decision 177: recording read the freeze gate without holding the user's row, so an operator's freeze
    committed between that read and the write left a credit after the freeze (PostgreSQL; SQLite serializes
    writers). The gate now holds the row: the freeze waits for the payment, and falls after its credit."""
    import threading

    from billingctl.services.payments import recording
    from billingctl.services.reconcile import reconcile

    co = world.checkout()
    payment = world.sandbox.pay(co["order_id"], drop_webhook=True)
    froze = threading.Thread(target=freeze, args=(world.c, "user_a", "fraud review", "ops"))
    gates = recording._unrecorded_gates

    def gates_then_a_freeze(uow, facts):
        answer = gates(uow, facts)
        froze.start()  # the operator's freeze, on another connection, while this payment is being recorded
        froze.join(timeout=1)
        return answer

    monkeypatch.setattr(recording, "_unrecorded_gates", gates_then_a_freeze)
    assert recording.record_payment(world.c, payment, "settled_poller")["outcome"] == "recorded"
    froze.join()
    assert world.credits() == 2000
    with world.c.uow() as uow:
        assert uow.users.frozen_at("user_a") is not None
    assert "credits_after_freeze" not in {v["check"] for v in reconcile(world.c)["violations"]}


def test_a_payment_recorded_while_a_freeze_is_being_made_waits_for_it_and_is_held(world):
    """Decision 177, the other order: the freeze holds the user's row; the payment's gate waits for it and
    reads the freeze (the latest row, not the one its statement started with)."""
    import threading

    from billingctl.services.payments import record_payment

    co = world.checkout()
    payment = world.sandbox.pay(co["order_id"], drop_webhook=True)
    outcomes = []
    recording = threading.Thread(target=lambda: outcomes.append(
        record_payment(world.c, payment, "settled_poller")["outcome"]))
    with world.c.uow() as uow:
        assert uow.users.freeze("user_a", world.c.clock.now(), "fraud review")
        recording.start()
        recording.join(timeout=1)
        uow.commit()
    recording.join()
    assert outcomes == ["held_frozen"] and world.credits() == 0 and world.purchases(payment["id"]) == 0


def test_a_renewal_settled_after_a_freeze_is_held_with_its_own_facts(world):
    """The user's earlier purchase does not let a later payment past the freeze: only this payment's own
    purchase would. The held row keeps the payment's amount, currency and settle time (not the time it
    was held), which the person deciding reads."""
    from billingctl.services.payments import record_payment

    co, invoice, payment = world.renewal_charged_unseen()
    freeze(world.c, "user_a", "chargeback", "ops")
    world.c.clock.advance(3600)  # the poller finds it an hour later
    assert record_payment(world.c, payment, "settled_poller")["outcome"] == "held_frozen"
    assert world.purchases() == 1 and world.credits() == 2000  # the checkout's only
    held = review_row(world, payment["id"])
    assert (held["status"], held["amount"], held["currency_code"], held["subscription_id"]) == \
        ("needs_review", invoice["total"], "USD", co["subscription_id"])
    held_for = world.c.clock.now() - held["settled_at"].replace(tzinfo=world.c.clock.now().tzinfo)
    assert held_for.total_seconds() > 3000  # settled an hour before it was held


def test_a_recorded_payment_seen_again_after_a_freeze_or_a_cancellation_is_a_duplicate(world):
    """Neither gate applies to a payment that is already bought: its webhook repeated after the user was
    frozen, or after its subscription was cancelled, is a duplicate, not a new hold or orphan."""
    from billingctl.services.payments import record_payment
    from billingctl.services.sync import sync_subscription

    co = world.checkout()
    payment = world.sandbox.pay(co["order_id"])
    freeze(world.c, "user_a", "chargeback", "ops")
    assert record_payment(world.c, payment, "webhook")["outcome"] == "duplicate"
    unfreeze(world.c, "user_a", "lost", "ops")
    world.sandbox.cancel(co["subscription_id"])
    sync_subscription(world.c, co["subscription_id"])
    again = record_payment(world.c, payment, "webhook")  # the full path: the fast one is for active ones
    assert (again["outcome"], again["activation"]) == ("duplicate", "cancelled_at_provider")
    assert review_row(world, payment["id"]) is None
    assert world.purchases(payment["id"]) == 1 and world.credits() == 2000

def test_a_payment_held_for_a_frozen_user_can_be_refunded(world):
    co = world.checkout()
    freeze(world.c, "user_a", "fraud", "ops")
    payment = world.sandbox.pay(co["order_id"])
    orphans.resolve(world.c, payment["id"], "refund", "fraud confirmed", "ops")
    assert world.sandbox.store.get("payment", payment["id"])["processor"]["amountRefunded"] == payment["amount"]
    assert world.purchases() == 0 and world.credits() == 0


def test_freezing_an_unknown_user_is_refused_and_creates_nothing(world):
    from billingctl.adapters.db.tables import users

    with pytest.raises(e.NotFound):
        freeze(world.c, "user_nobody", "fraud", "ops")
    with world.c.uow() as uow:
        assert uow.execute(select(users.c.id).where(users.c.id == "user_nobody")).first() is None


# ---- defect 6: a checkout cancelled at the provider, then paid ------------------------------------

def test_a_payment_for_a_checkout_cancelled_at_the_provider_becomes_an_orphan_and_is_recovered(world):
    from billingctl.services.payments import pending_activations
    from billingctl.services.renewals import run_renewals

    co = world.checkout()
    world.sandbox.cancel(co["subscription_id"])  # cancelled at the provider; our copy still says future
    payment = world.sandbox.pay(co["order_id"])  # its webhook arrives
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "cancelled"
    opened = review_row(world, payment["id"])
    assert opened is not None and opened["status"] == "retrying"  # an orphan, not "activation pending"
    assert [r["id"] for r in pending_activations(world.c)] == []
    advance(world, 16)
    orphans.run_orphans(world.c)
    advance(world, 16)
    orphans.run_orphans(world.c)
    state = review_row(world, payment["id"])
    assert (state["status"], state["resolution"]) == ("recovered", "resubscribed")
    new_sub = state["subscription_id"]
    assert new_sub != co["subscription_id"] and world.sandbox.subscription(new_sub)["status"] == "active"
    assert [i["status"] for i in world.sandbox.store.all("invoice") if i["subscription_id"] == new_sub] == ["paid"]
    assert world.purchases(payment["id"]) == 1 and world.credits() == 2000  # credited once
    assert run_renewals(world.c)["outcomes"] == {}
    assert [p["id"] for p in world.sandbox.store.all("payment")] == [payment["id"]]  # charged once
    assert pending_activations(world.c) == []


def test_a_payment_for_a_cancelled_checkout_of_a_plan_the_user_holds_is_refunded_and_reversed(world):
    from tests.helpers import legacy_checkout

    world.sandbox.pay(world.checkout()["order_id"])  # the user already holds the plan
    co = legacy_checkout(world.c, "user_a")  # a second checkout of it (made before decision 110)
    world.sandbox.cancel(co["subscription_id"])
    payment = world.sandbox.pay(co["order_id"], drop_webhook=True)
    from billingctl.services.payments import record_payment

    outcome = record_payment(world.c, world.sandbox.store.get("payment", payment["id"]), "settled_poller")
    assert outcome["outcome"] == "orphaned" and world.credits() == 2000  # a second payment of a held plan
    advance(world, 16)
    orphans.run_orphans(world.c)
    advance(world, 16)
    orphans.run_orphans(world.c)
    assert review_row(world, payment["id"])["status"] == "duplicate_refunded"
    assert world.sandbox.store.get("payment", payment["id"])["processor"]["amountRefunded"] == payment["amount"]
    assert world.credits() == 2000  # the refunded payment's credits are reversed


# ---- defect 9: a refund reported before its settle ------------------------------------------------

@pytest.mark.parametrize("share", [1, 2])
def test_a_refund_reported_before_its_settle_still_reverses_the_credits(world, share):
    co = world.checkout()
    world.sandbox.hold_webhooks()
    payment = world.sandbox.pay(co["order_id"])
    world.sandbox.refund(payment["id"], payment["amount"] // share)
    world.sandbox.release_webhooks(order="reverse")  # PAYMENT.REFUND arrives first, then the stale SETTLED
    assert world.purchases(payment["id"]) == 1
    expected = 2000 - 2000 * (payment["amount"] // share) // payment["amount"]  # the refunded share reversed
    assert world.credits() == expected
    world.sandbox.send_webhook("PAYMENT.REFUND", world.sandbox.store.get("payment", payment["id"]))  # again
    assert world.credits() == expected


def test_a_settle_recorded_while_its_refund_report_asks_the_orchestrator_still_reverses_the_credits(world):
    """Found by the month in separate processes (seed 1, day 8: reconcile's "refund_not_reversed"): the
    refund report and the stale settle report handled at once, by two processes. The refund's handler found
    no purchase and asked the orchestrator for the payment; meanwhile the settle's handler recorded it from
    its stale payload (nothing refunded yet); the refund's handler then found the payment recorded (a
    duplicate) and reversed nothing: credits kept for refunded money."""
    from billingctl.services.payments import apply_refund_report
    from billingctl.services.webhook_events import dispatch

    co = world.checkout()
    world.sandbox.hold_webhooks()
    stale = world.sandbox.pay(co["order_id"])  # the settle as notified, before the refund
    amount = stale["amount"]
    world.sandbox.refund(stale["id"], amount // 2)
    asked, real = [], world.c.orchestrator.get_payment

    def meanwhile(payment_id):
        answer = real(payment_id)
        if not asked:  # the other process's settle report commits while this one waits on the orchestrator
            asked.append(payment_id)
            dispatch(world.c, "orchestrator", "PAYMENT.STATUS", {"payment": stale})
        return answer

    world.c.orchestrator.get_payment = meanwhile
    try:
        apply_refund_report(world.c, stale["id"], amount // 2, "webhook")
    finally:
        world.c.orchestrator.get_payment = real
    assert asked == [stale["id"]]
    assert world.purchases(stale["id"]) == 1
    assert world.credits() == 2000 - 2000 * (amount // 2) // amount  # the refunded share reversed, once
    apply_refund_report(world.c, stale["id"], amount // 2, "event_poller")  # reported again: nothing more
    assert world.credits() == 2000 - 2000 * (amount // 2) // amount


# ---- defects 5 and 8: the NSFW quota counts authorizations, enforced by the database ----------------

def attempt_rows(world, user="user_a"):
    from billingctl.adapters.db.tables import fraud_event

    with world.c.uow() as uow:
        return uow.execute(select(fraud_event.c.dedupe_key).where(
            fraud_event.c.user_id == user, fraud_event.c.event_type == "authorization_attempt")).scalars().all()


def test_every_declined_authorization_in_one_session_counts_once(world):
    co = world.checkout("user_a", NSFW)
    assert attempt_rows(world) == [f"order:{co['order_id']}"]  # the session reserves its first one
    declined = [world.sandbox.decline_checkout(co["order_id"]) for _ in range(6)]
    world.sandbox.send_webhook("PAYMENT.STATUS", declined[0])  # a duplicate report adds nothing
    paid = world.sandbox.pay(co["order_id"], duplicates=2)
    keys = sorted(attempt_rows(world))
    assert keys == sorted(f"payment:{p['id']}" for p in [*declined, paid])  # 7 authorizations, 7 rows
    from billingctl.adapters.db.tables import fraud_event

    with world.c.uow() as uow:
        rows = dict(uow.execute(select(fraud_event.c.dedupe_key, fraud_event.c.metadata).where(
            fraud_event.c.user_id == "user_a", fraud_event.c.event_type == "authorization_attempt")).all())
    for further in [*declined[1:], paid]:  # the first try took the session's reservation; each further one is new
        assert rows[f"payment:{further['id']}"] == {
            "merchant_context": "full", "amount": further["amount"], "initiator": "customer",
            "order_id": co["order_id"], "payment_id": further["id"]}



def test_an_sfw_session_counts_nothing(world):
    co = world.checkout("user_a", PRO)
    world.sandbox.decline_checkout(co["order_id"])
    world.sandbox.pay(co["order_id"])
    assert attempt_rows(world) == []


class SkewedClock(ManualClock):
    """A worker's clock that runs on (a second each read) from its own offset: the workers disagree."""

    def now(self):
        return self.advance(1)


@pytest.mark.parametrize("clocks", ["one frozen clock", "clocks that move and disagree"])
def test_two_workers_cannot_both_take_the_last_customer_slot(make_settings, db_url, tmp_path, redis_url, clocks):
    """Defect 5: check and record were separate transactions guarded by a lock that is in-process
    without Redis: 5 attempts in a day in 3 of 3 trials. Now one transaction under the user's row lock.
    Issue 34 defect 7: with clocks that move (and disagree by seconds between workers), a worker that read
    its time before another committed, or whose clock is behind, must still count that attempt."""
    import threading
    from datetime import timedelta

    from sqlalchemy import insert

    from billingctl.adapters.db.tables import fraud_event, users
    from tests.helpers import ProductionStack

    with ProductionStack(make_settings, db_url, tmp_path, clock=ManualClock(), redis_url=redis_url) as stack:
        first = stack.container
        now = first.clock.now()
        with first.uow() as uow:
            uow.execute(insert(users).values(id="racer", created_at=now, credits=0))
            for i in range(3):  # three of the customer's four daily slots are used
                uow.execute(insert(fraud_event).values(user_id="racer", event_type="authorization_attempt",
                                                       created_at=now - timedelta(hours=i + 1),
                                                       metadata={"merchant_context": "full", "amount": 2999}))
            uow.commit()
        workers = [Container(first.settings, clock=ManualClock(now) if clocks == "one frozen clock" else
                             SkewedClock(now + timedelta(seconds=5 - 3 * n))) for n in range(4)]
        import redis

        from billingctl.adapters.locks import LockManager

        for w in workers:  # Redis is down: every named lock is skipped, only the database can decide
            w.locks = LockManager(redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2))
        from billingctl.services import catalog

        for w in workers:  # warm each worker's catalog so that all four reach the quota check together
            catalog.plan(w, NSFW)
        barrier = threading.Barrier(len(workers))
        outcomes = []

        orders = set()

        def buy(c):
            from billingctl.services.checkout import create_checkout

            barrier.wait()
            try:
                orders.add(create_checkout(c, "racer", NSFW)["order_id"])
                outcomes.append("created")
            except e.QuotaExhausted:
                outcomes.append("blocked")

        threads = [threading.Thread(target=buy, args=(w,)) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        # One checkout: the others were refused, or answered that same pending checkout (decision 110).
        assert len(orders) == 1 and "created" in outcomes and len(outcomes) == 4
        with first.uow() as uow:
            rows = uow.execute(select(fraud_event.c.id).where(
                fraud_event.c.user_id == "racer", fraud_event.c.event_type == "authorization_attempt")).all()
        assert len(rows) == 4
        for w in workers:
            w.close()


# ---- defect 13: an undo that failed at checkout ------------------------------------------------------

def test_a_checkout_whose_undo_failed_is_cancelled_by_the_cleanup_job(world):
    from billingctl.services.checkout import cleanup_expired

    world.sandbox.store.add_fault("orchestrator", "500", method="POST", path="/client-session", count=-1)
    world.sandbox.store.add_fault("provider", "500", method="POST", path="cancel_for_items", count=-1)
    with pytest.raises(e.ExternalError):
        world.checkout()
    world.sandbox.store.clear_faults()
    [stray] = world.sandbox.store.all("subscription")
    assert stray["status"] == "future"  # left at the provider; we hold no row for it
    assert cleanup_expired(world.c)["cancelled"] == []  # younger than a day
    advance(world, 2 * 86400)
    assert cleanup_expired(world.c)["cancelled"] == [stray["id"]]
    assert world.sandbox.subscription(stray["id"])["status"] == "cancelled"
    assert cleanup_expired(world.c)["cancelled"] == []


def test_a_refund_notification_our_front_could_not_take_is_delivered_again_and_takes_the_credits_back(world):
    """Found by the month in separate processes (seed 18, day 8; one run in four): a checkout paid and half
    refunded at once, its two notifications sent just after PostgreSQL restarted. The refund's got no 2xx
    answer ("database unavailable") and the sandbox dropped it, where Primer retries any delivery without a
    2xx answer; the settle's recorded the payment from its payload of before the refund, and nothing else
    reports that refund (the provider never held the payment). Credits were kept for refunded money until
    the weekly full reconcile named them."""
    co = world.checkout()
    world.sandbox.hold_webhooks()
    payment = world.sandbox.pay(co["order_id"])
    amount = payment["amount"]
    world.sandbox.refund(payment["id"], amount // 2)
    deliver, refused = world.sandbox.deliver, []

    def front(path, body, headers):  # the public front answers 503 once: the app behind it is restarting
        if b'"PAYMENT.REFUND"' in body and not refused:
            refused.append(path)
            return 503
        return deliver(path, body, headers)

    world.sandbox.deliver = front
    # the refund's refused, the settle's and the authorization's (it comes last, reversed) taken
    assert world.sandbox.release_webhooks(order="reverse") == [503, 200, 200]
    assert world.purchases(payment["id"]) == 1 and world.credits() == 2000  # the refund not heard of yet
    advance(world, 60)  # the orchestrator's first retry falls due
    assert world.credits() == 2000 - 2000 * (amount // 2) // amount  # the refunded share taken back, once
    assert world.sandbox.store.all("webhook_retry") == []
    advance(world, 86400)
    assert world.credits() == 2000 - 2000 * (amount // 2) // amount
