"""Reconcile is the invariant checker (issue "Money paths"): each check sees a planted violation, from
our books or from the orchestrator's, and a clean system reports nothing."""

from datetime import timedelta

import pytest
from sqlalchemy import insert, select, update

from billingctl.adapters.db.tables import credit_ledger, fraud_event, orphan_recovery, purchase, subscription, users
from billingctl.bootstrap import Container
from billingctl.domain.clock import ManualClock
from billingctl.services.reconcile import reconcile
from tests.conftest import clock_to_sandbox
from tests.integration.conftest import World

pytestmark = pytest.mark.integration
PRO = "credits-pro-USD-monthly"


@pytest.fixture
def world(one_try_world):
    return one_try_world


def paid(world, user="user_a"):
    co = world.checkout(user)
    payment = world.sandbox.pay(co["order_id"])
    world.c.clock.advance(60)
    world.sandbox.store.advance_clock(60)
    return co, payment


def checks(world):
    return {v["check"] for v in reconcile(world.c)["violations"]}


def test_a_clean_system_reports_nothing(world):
    paid(world, "user_a")
    _, refunded = paid(world, "user_b")
    world.sandbox.refund(refunded["id"], 500)  # reported and reversed
    world.c.clock.advance(2 * 3600)
    report = reconcile(world.c)
    assert report["violations"] == [] and report["ok"] is True


def plant_invoice_paid_twice(world):
    co, payment = paid(world)
    with world.c.uow() as uow:
        invoice_id = uow.execute(purchase.select().where(purchase.c.transaction_id == payment["id"])).one().invoice_id
        uow.execute(insert(purchase).values(invoice_id=invoice_id, transaction_id="pay_second", amount=1,
                                            subscription_id=co["subscription_id"], user_id="user_a", credits=0,
                                            created_at=world.c.clock.now(), provider_recorded_at=world.c.clock.now()))
        uow.commit()


def unreport(uow, payment_id):
    uow.execute(update(purchase).where(purchase.c.transaction_id == payment_id).values(provider_recorded_at=None))


def plant_unreported(world):
    _, payment = paid(world)
    with world.c.uow() as uow:
        unreport(uow, payment["id"])
        uow.commit()
    world.c.clock.advance(2 * 3600)


def plant_paid_not_active(world):
    co, _ = paid(world)
    with world.c.uow() as uow:
        uow.execute(update(subscription).where(subscription.c.id == co["subscription_id"]).values(
            status="future", activation_pending_since=world.c.clock.now()))
        uow.commit()
    world.c.clock.advance(2 * 3600)


def plant_credits_after_freeze(world):
    paid(world)
    now = world.c.clock.now()
    with world.c.uow() as uow:
        uow.execute(update(users).where(users.c.id == "user_a").values(frozen_at=now - timedelta(hours=1),
                                                                       frozen_reason="fraud"))
        uow.commit()


def plant_quota_over_limit(world):
    now = world.c.clock.now()
    with world.c.uow() as uow:
        for i in range(6):
            uow.execute(insert(fraud_event).values(user_id="user_q", event_type="authorization_attempt",
                                                   created_at=now - timedelta(hours=i + 1),
                                                   metadata={"merchant_context": "full"}))
        uow.commit()


def plant_order_charged_twice(world):
    co, _ = paid(world)
    world.sandbox.pay(co["order_id"], drop_webhook=True)  # the same checkout settles a second time
    world.c.clock.advance(60)


def plant_refund_not_reversed(world):
    _, payment = paid(world)
    world.sandbox.hold_webhooks()  # the refund report is lost
    world.sandbox.refund(payment["id"])


def plant_ledger_without_purchase(world):
    with world.c.uow() as uow:
        uow.execute(insert(users).values(id="user_g", created_at=world.c.clock.now(), credits=0))
        uow.execute(insert(credit_ledger).values(user_id="user_g", amount=0, source_key="payment:pay_ghost",
                                                 reason="payment", payment_id="pay_ghost",
                                                 created_at=world.c.clock.now()))
        uow.commit()


def plant_unreported_behind_a_recovered_review_row(world):
    """The row says recovered, and the purchase still waits for its invoice (issue 35 defect 3): a review
    row that has ended no longer hides the purchase."""
    _, payment = paid(world)
    with world.c.uow() as uow:
        unreport(uow, payment["id"])
        uow.execute(insert(orphan_recovery).values(
            payment_id=payment["id"], user_id="user_a", status="recovered", attempts=1,
            created_at=world.c.clock.now(), updated_at=world.c.clock.now()))
        uow.commit()
    world.c.clock.advance(2 * 3600)


def plant_closed_purchase_not_reversed(world):
    _, payment = paid(world)
    with world.c.uow() as uow:
        unreport(uow, payment["id"])
        assert uow.purchases.close(payment["id"], "invoice_voided", world.c.clock.now())  # its credits kept
        uow.commit()


@pytest.mark.parametrize(("plant", "check"), [
    (plant_unreported_behind_a_recovered_review_row, "recorded_not_on_provider_invoice"),
    (plant_closed_purchase_not_reversed, "closed_purchase_not_reversed"),
    (plant_invoice_paid_twice, "invoice_paid_twice"),
    (plant_unreported, "recorded_not_on_provider_invoice"),
    (plant_paid_not_active, "paid_not_active"),
    (plant_credits_after_freeze, "credits_after_freeze"),
    (plant_order_charged_twice, "order_charged_twice"),
    (plant_refund_not_reversed, "refund_not_reversed"),
    (plant_ledger_without_purchase, "ledger_without_purchase"),
])
def test_each_planted_violation_is_named(world, plant, check):
    plant(world)
    report = reconcile(world.c)
    assert check in {v["check"] for v in report["violations"]} and report["ok"] is False
    assert report["counts"][next(k for k in report["counts"] if k.split(":")[0] == check)] >= 1
    assert world.c.metrics.sample("billing_reconcile_violations", {}) == sum(report["counts"].values())


def test_credits_beside_the_ledger_are_named_with_both_sums(world):
    """The detail names the two sums (it read the row's tuple accessor `Row.t` instead of the column and
    printed the whole row)."""
    paid(world)
    with world.c.uow() as uow:
        credits = uow.execute(select(users.c.credits).where(users.c.id == "user_a")).scalar_one()
        uow.execute(update(users).where(users.c.id == "user_a").values(credits=credits + 7))
        uow.commit()
    [violation] = [v for v in reconcile(world.c)["violations"] if v["check"] == "credits_differ_from_ledger"]
    assert violation == {"check": "credits_differ_from_ledger", "user_id": "user_a",
                         "detail": f"users.credits={credits + 7}, ledger sum={credits}"}


def test_a_second_charge_refunded_in_full_clears_the_order_check(world):
    co, _ = paid(world)
    second = world.sandbox.pay(co["order_id"], drop_webhook=True)
    world.c.clock.advance(60)
    assert "order_charged_twice" in checks(world)
    world.sandbox.hold_webhooks()
    world.sandbox.refund(second["id"])  # the operator refunds the double charge
    assert "order_charged_twice" not in checks(world)


def plant_payment_on_two_invoices(world):
    """The orchestrator payment recorded on a second provider invoice (what defect 1 used to leave)."""
    co, payment = paid(world)
    other = world.checkout("user_b")
    world.sandbox.pay(other["order_id"])
    second = next(i for i in world.sandbox.store.all("invoice") if i["subscription_id"] == other["subscription_id"])
    world.sandbox.store.put("invoice", second["id"], {**second, "status": "payment_due", "amount_due": 1})
    world.sandbox.record_payment(second["id"], 1, payment["id"])


def plant_marked_recorded_without_a_provider_transaction(world):
    co, payment = paid(world)
    with world.c.uow() as uow:
        uow.execute(insert(purchase).values(invoice_id="inv_ghost", transaction_id="pay_ghost2", amount=1,
                                            subscription_id=co["subscription_id"], user_id="user_a", credits=0,
                                            created_at=world.c.clock.now(), provider_recorded_at=world.c.clock.now()))
        uow.commit()


@pytest.mark.parametrize(("plant", "check"), [
    (plant_payment_on_two_invoices, "payment_on_two_invoices"),
    (plant_marked_recorded_without_a_provider_transaction, "recorded_not_on_provider_invoice"),
])
def test_checks_from_the_providers_books(world, plant, check):
    plant(world)
    report = reconcile(world.c)
    assert check in {v["check"] for v in report["violations"]} and report["ok"] is False


def test_tries_in_one_payment_form_over_the_limit_are_no_violation_but_a_start_after_them_is(
        make_settings, db_url, tmp_path, redis_url):
    """Found by the production month of the simulation: a customer declined five times in one checkout's
    payment form, then paid, holds six attempts in the daily window. The quota counts them (the next
    checkout is refused) but could not stop them, so reconcile called a false alarm every day; what it
    checks now is that no attempt started while a window was full."""
    from billingctl.domain.errors import QuotaExhausted
    from billingctl.services.checkout import create_checkout
    from tests.helpers import ProductionStack

    with ProductionStack(make_settings, db_url, tmp_path, clock=ManualClock(), redis_url=redis_url) as stack:
        c, sandbox = stack.container, stack.sandbox
        clock_to_sandbox(c, sandbox.store)
        co = create_checkout(c, "user_q", "credits-pro-nsfw-USD-monthly")
        for _ in range(5):
            sandbox.decline_checkout(co["order_id"])
        sandbox.pay(co["order_id"])
        with c.uow() as uow:
            assert len(uow.fraud.since("user_q", "authorization_attempt", c.clock.now() - timedelta(days=1))) == 6
        with pytest.raises(QuotaExhausted):  # the tries count toward the next start
            create_checkout(c, "user_q", "credits-max-nsfw-USD-monthly")
        assert "quota_over_limit" not in {v["check"] for v in reconcile(c)["violations"]}
        with c.uow() as uow:  # a start admitted although the window was full (a gate that let it through)
            uow.execute(insert(fraud_event).values(user_id="user_q", event_type="authorization_attempt",
                                                   created_at=c.clock.now() + timedelta(minutes=1),
                                                   metadata={"merchant_context": "full", "initiator": "merchant",
                                                             "order_id": "inv_q"}))
            uow.commit()
        [violation] = [v for v in reconcile(c)["violations"] if v["check"] == "quota_over_limit"]
        assert violation == {"check": "quota_over_limit", "user_id": "user_q", "detail":
                             "a merchant-initiated attempt started with 6 attempts in the daily window (limit 5)"}


def test_a_quota_window_over_its_limit_is_a_violation_where_the_quota_is_enforced(make_settings, db_url, tmp_path,
                                                                                redis_url):
    from tests.helpers import ProductionStack

    with ProductionStack(make_settings, db_url, tmp_path, clock=ManualClock(), redis_url=redis_url) as stack:
        world = World(stack.container)
        world.sandbox = stack.sandbox
        plant_quota_over_limit(world)
        assert "quota_over_limit" in {v["check"] for v in reconcile(world.c)["violations"]}
    dev = Container(make_settings(database_url=db_url), clock=ManualClock())
    assert "quota_over_limit" not in {v["check"] for v in reconcile(dev)["violations"]}  # not enforced there
    dev.close()
