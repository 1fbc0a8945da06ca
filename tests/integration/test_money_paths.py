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
from tests.integration.conftest import World

pytestmark = pytest.mark.integration
PRO, NSFW = "credits-pro-USD-monthly", "credits-pro-nsfw-USD-monthly"


@pytest.fixture
def world(make_settings, db_url):
    c = Container(make_settings(database_url=db_url, http_max_attempts=1), clock=ManualClock())
    c.provider.http.sleep = c.orchestrator.http.sleep = lambda s: None
    yield World(c)
    c.close()


def advance(world, seconds):
    world.c.clock.advance(seconds)
    world.sandbox.store.advance_clock(seconds)


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
    world.sandbox.pay(world.checkout()["order_id"])  # the user already holds the plan
    co = world.checkout()
    world.sandbox.cancel(co["subscription_id"])
    payment = world.sandbox.pay(co["order_id"], drop_webhook=True)
    from billingctl.services.payments import record_payment

    record_payment(world.c, world.sandbox.store.get("payment", payment["id"]), "settled_poller")
    assert world.credits() == 4000  # credited before the provider said cancelled
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
