"""Reconcile is the invariant checker (issue "Money paths"): each check sees a planted violation, from
our books or from the orchestrator's, and a clean system reports nothing."""

from datetime import timedelta

import pytest
from sqlalchemy import delete, insert, select, update

from billingctl.adapters.db.tables import (
    checkout_session,
    credit_ledger,
    dispute,
    dunning_attempt,
    fraud_event,
    orphan_recovery,
    purchase,
    subscription,
    users,
)
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


def purchase_of(world, payment_id):
    with world.c.uow() as uow:
        return uow.execute(purchase.select().where(purchase.c.transaction_id == payment_id)).one()


def credit_second_purchase(world, invoice_id, subscription_id, payment_id="pay_second", user="user_a"):
    """A second purchase on an invoice, credited (a double charge recorded twice)."""
    now = world.c.clock.now()
    with world.c.uow() as uow:
        uow.execute(insert(purchase).values(invoice_id=invoice_id, transaction_id=payment_id, amount=1,
                                            subscription_id=subscription_id, user_id=user, credits=10,
                                            created_at=now, provider_recorded_at=now))
        assert uow.ledger.apply(user, 10, f"payment:{payment_id}", "payment", payment_id, now)
        uow.commit()


def plant_invoice_paid_twice(world):
    co, payment = paid(world)
    credit_second_purchase(world, purchase_of(world, payment["id"]).invoice_id, co["subscription_id"])
    later(world)  # the provider's invoice, paid over an hour ago, holds two terms


def plant_term_paid_twice(world):
    """A second term of the subscription whose days overlap the paid one's, paid in full and credited (a
    reactivation's new term charged beside a paid term: decisions 204, 258)."""
    from billingctl.adapters.db.tables import invoice

    co, payment = paid(world)
    first = purchase_of(world, payment["id"]).invoice_id
    with world.c.uow() as uow:
        paid_copy = uow.execute(select(invoice).where(invoice.c.id == first)).mappings().one()
        assert paid_copy["term_start"] is not None and paid_copy["total_amount"]
        shift = (paid_copy["term_end"] - paid_copy["term_start"]) / 3
        uow.execute(insert(invoice).values(
            id="inv_reactivated", subscription_id=co["subscription_id"], customer_id="user_a",
            total_amount=paid_copy["total_amount"], currency_code="USD", status="paid",
            created_at=world.c.clock.now(), term_start=paid_copy["term_start"] + shift,
            term_end=paid_copy["term_end"] + shift))
        uow.commit()
    credit_second_purchase(world, "inv_reactivated", co["subscription_id"])
    with world.c.uow() as uow:
        uow.execute(update(purchase).where(purchase.c.transaction_id == "pay_second").values(
            amount=paid_copy["total_amount"]))
        uow.commit()
    later(world)


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
                                                                       frozen_reason="fraud", frozen_ledger_id=0))
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


def unreported_behind_review_row(world, status, reported=False):
    """A purchase still waiting for its invoice (or, `reported`, on it) while a review row in `status`
    names its payment."""
    _, payment = paid(world)
    with world.c.uow() as uow:
        if not reported:
            unreport(uow, payment["id"])
        uow.execute(insert(orphan_recovery).values(
            payment_id=payment["id"], user_id="user_a", status=status, attempts=1,
            created_at=world.c.clock.now(), updated_at=world.c.clock.now()))
        uow.commit()
    world.c.clock.advance(2 * 3600)
    world.sandbox.store.advance_clock(2 * 3600)


def plant_unreported_behind_a_recovered_review_row(world):
    """The row says recovered, and the purchase still waits for its invoice (issue 35 defect 3): a review
    row that has ended no longer hides the purchase."""
    unreported_behind_review_row(world, "recovered")


def plant_recorded_payment_refunded_as_a_duplicate(world):
    """Recorded on the provider's invoice and credited, while recovery refunded the payment as a same-plan
    duplicate: the customer keeps the term and has the money back (a purchase recovery closed is no
    violation, decision 183)."""
    unreported_behind_review_row(world, "duplicate_refunded", reported=True)


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
    (plant_term_paid_twice, "term_paid_twice"),
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


def test_a_second_charge_captured_in_part_and_refunded_all_it_captured_clears_the_order_check(world):
    """Found by the exploration (decision 236): the order's second payment was captured in part (a capture
    that was not final), held for review, and a person refunded it from the review queue: all 499 taken
    went back, and reconcile named the order charged twice every day, comparing the refund with the
    amount authorized instead of what was captured."""
    from billingctl.services import orphans

    co, _ = paid(world)
    second = world.sandbox.pay(co["order_id"], capture=False)
    world.sandbox.capture(second["id"], 499, final=False)  # PARTIALLY_SETTLED: held, nothing credited
    world.c.clock.advance(60)
    assert "order_charged_twice" in checks(world)  # 999 and 499 taken for one order
    orphans.resolve(world.c, second["id"], "refund", "charged twice", "oncall")
    assert world.sandbox.store.get("payment", second["id"])["processor"]["amountRefunded"] == 499
    assert "order_charged_twice" not in checks(world)


def test_an_operator_refund_of_a_payment_captured_in_part_plans_what_it_captured(world):
    """Decision 236: `payments refund` tells what is left to refund from what the payment took; it planned
    the amount authorized (999 to refund of a payment that took 499)."""
    from billingctl.services import orphans
    from billingctl.services.payments import refund_by_operator

    co = world.checkout("user_a")
    payment = world.sandbox.pay(co["order_id"], capture=False)
    world.sandbox.capture(payment["id"], 499, final=False)
    world.c.clock.advance(60)
    orphans.resolve(world.c, payment["id"], "mark-handled", "the customer keeps the part", "oncall")
    assert refund_by_operator(world.c, payment["id"], "customer asked", "ops", dry_run=True)["to_refund"] == 499
    done = refund_by_operator(world.c, payment["id"], "customer asked", "ops")
    assert (done["outcome"], done["refunded"], done["to_refund"]) == ("refunded", 499, 499)
    assert refund_by_operator(world.c, payment["id"], "customer asked", "ops")["outcome"] == "already_refunded"


def test_a_second_charge_is_not_named_while_its_refund_is_pending_and_named_again_once_refused(world):
    """Decision 174: refunds can take days at the processor; a refund asked for is the fix under way, and a
    refused one leaves the customer charged twice again."""
    co, _ = paid(world)
    second = world.sandbox.pay(co["order_id"], drop_webhook=True)
    world.c.clock.advance(60)
    world.sandbox.hold_webhooks()
    world.sandbox.async_refunds("FAILED")
    world.sandbox.refund(second["id"])
    assert "order_charged_twice" not in checks(world)
    assert world.sandbox.finish_refunds() == [second["id"]]
    assert "order_charged_twice" in checks(world)


@pytest.mark.parametrize("disputed", ["second", "first"])
def test_a_charge_of_a_paid_twice_order_taken_back_by_a_lost_chargeback_clears_the_order_check(world, disputed):
    """A lost chargeback returns the money as a full refund does: the customer paid once. Found by the
    exploration (decision 176): a chargeback on one of two charges was named every day."""
    co, first = paid(world)
    second = world.sandbox.pay(co["order_id"], drop_webhook=True)
    world.c.clock.advance(60)
    taken_back = second if disputed == "second" else first
    world.sandbox.dispute_status(taken_back["id"], "WON")  # a chargeback the merchant won returns nothing
    assert "order_charged_twice" in checks(world)
    world.sandbox.dispute_status(taken_back["id"], "LOST")
    assert "order_charged_twice" not in checks(world)


def test_a_freeze_stamped_by_a_clock_behind_the_credits_is_no_false_alarm_and_a_credit_after_it_is_named(world):
    """Decision 177, found by the exploration: the operator's host runs 90 s behind the webhook worker's, so
    a freeze made after a payment was credited is stamped before it; "credited after the freeze" is read by
    the ledger's order, and a credit written after the freeze by a clock further behind is still named."""
    from billingctl.services.users import freeze

    paid(world)
    world.c.clock.advance(-90)
    freeze(world.c, "user_a", "fraud review", "ops")
    assert "credits_after_freeze" not in checks(world)
    world.c.clock.advance(-60)
    with world.c.uow() as uow:
        uow.ledger.apply("user_a", 5, "planted:after-freeze", "payment", None, world.c.clock.now())
        uow.commit()
    [named] = [v for v in reconcile(world.c)["violations"] if v["check"] == "credits_after_freeze"]
    assert named["user_id"] == "user_a" and named["detail"] == "credits applied after the account was frozen"


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


def test_attempts_stamped_before_a_start_by_a_clock_stepped_back_are_no_violation(make_settings, db_url, tmp_path,
                                                                                 redis_url):
    """Decision 249 (found by the production exploration: our clock 90 s ahead of the sandbox's, then 90 s
    behind): a checkout started, our clock stepped back three minutes, and the customer's tries in its
    payment form were stamped before the start. Reconcile judged each start against the attempts stamped
    before it, not those written before it, so the start seemed to have met four tries in the window: a
    false alarm the gate, which counted what was written, never made. The attempts are read in the order
    they were written; a start after them is still named."""
    from billingctl.domain.errors import QuotaExhausted
    from billingctl.services.checkout import create_checkout
    from tests.helpers import ProductionStack

    with ProductionStack(make_settings, db_url, tmp_path, clock=ManualClock(), redis_url=redis_url) as stack:
        c, sandbox = stack.container, stack.sandbox
        clock_to_sandbox(c, sandbox.store)
        co = create_checkout(c, "user_q", "credits-pro-nsfw-USD-monthly")
        c.clock.advance(-180)  # our clock steps back (NTP), the sandbox's does not
        for _ in range(5):  # the first is the checkout's start (its reservation, stamped before the step)
            sandbox.decline_checkout(co["order_id"])
        with c.uow() as uow:
            stamps = sorted(r[0] for r in uow.fraud.since("user_q", "authorization_attempt",
                                                          c.clock.now() - timedelta(days=1)))
        assert len(stamps) == 5 and stamps[-1] - stamps[-2] > timedelta(minutes=2), stamps  # the start is last
        assert "quota_over_limit" not in {v["check"] for v in reconcile(c)["violations"]}
        with pytest.raises(QuotaExhausted):  # the tries count toward the next start
            create_checkout(c, "user_q", "credits-max-nsfw-USD-monthly")
        with c.uow() as uow:  # a start admitted although the window was full (a gate that let it through)
            uow.execute(insert(fraud_event).values(user_id="user_q", event_type="authorization_attempt",
                                                   created_at=c.clock.now() - timedelta(minutes=10),
                                                   metadata={"merchant_context": "full", "initiator": "merchant",
                                                             "order_id": "inv_q"}))
            uow.commit()
        [violation] = [v for v in reconcile(c)["violations"] if v["check"] == "quota_over_limit"]
        assert violation["detail"] == "a merchant-initiated attempt started with 5 attempts in the daily window " \
                                      "(limit 5)"


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


# ---- issue 36: the checks an auditor would make, each planted ------------------------------------------------
def later(world, seconds=2 * 3600):
    world.c.clock.advance(seconds)
    world.sandbox.store.advance_clock(seconds)


def plant_two_live_subscriptions_here(world):
    """Our copy holds two billed subscriptions of one plan for one customer."""
    co, _ = paid(world)
    with world.c.uow() as uow:
        uow.execute(insert(subscription).values(id="sub_twin", status="active", customer_id="user_a",
                                                item_price_id=PRO, created_at=world.c.clock.now(), coupon_ids=[]))
        uow.commit()


def plant_two_live_subscriptions_at_the_provider(world):
    """The provider bills a second subscription of the plan we never heard of (another integration)."""
    paid(world)
    world.c.activations_run = None
    from billingctl.services.payments import retry_pending

    retry_pending(world.c)  # the first is active at the provider
    world.sandbox.create_subscription_for_items("user_a", PRO, None, "off")


def plant_renewal_charge_in_flight_too_long(world):
    co, payment = paid(world)
    with world.c.uow() as uow:
        uow.execute(insert(dunning_attempt).values(
            invoice_id="inv_stuck", subscription_id=co["subscription_id"], user_id="user_a", status="pending",
            decline_code="AUTHORIZED", payment_id="pay_stuck", created_at=world.c.clock.now(), attempt_no=1,
            amount=1999))
        uow.commit()
    later(world, 3 * 3600)  # past the capture limit (an hour) and the grace


def plant_authorization_never_captured(world):
    """At the orchestrator: a payment AUTHORIZED days ago that nothing captured or cancelled."""
    _, payment = paid(world)
    stuck = {**payment, "id": "pay_held", "status": "AUTHORIZED", "orderId": "order_held"}
    world.sandbox.store.put("payment", "pay_held", stuck)
    later(world, 3 * 86400)


def plant_dunning_left_open_on_a_paid_invoice(world):
    """The invoice is paid by a standing purchase, and its renewal attempts still end on a retry."""
    co, payment = paid(world)
    invoice_id = purchase_of(world, payment["id"]).invoice_id
    with world.c.uow() as uow:
        uow.execute(insert(dunning_attempt).values(
            invoice_id=invoice_id, subscription_id=co["subscription_id"], user_id="user_a", status="declined",
            created_at=world.c.clock.now(), attempt_no=1, next_attempt_at=world.c.clock.now()))
        uow.commit()
    later(world)


def plant_dunning_resolved_without_outcome(world):
    paid(world)
    now = world.c.clock.now()
    with world.c.uow() as uow:
        uow.execute(insert(dunning_attempt).values(
            invoice_id="inv_half", subscription_id="sub_x", user_id="user_a", status="pending", payment_id="pay_h",
            created_at=now, resolved_at=now, attempt_no=1))
        uow.commit()
    later(world)


def plant_dispute_lost_not_reversed(world):
    _, payment = paid(world)
    now = world.c.clock.now()
    with world.c.uow() as uow:
        uow.execute(insert(dispute).values(dispute_id="dp_lost", payment_id=payment["id"], user_id="user_a",
                                           kind="DISPUTE", status="LOST", state="lost", created_at=now,
                                           updated_at=now))
        uow.commit()
    later(world)


def plant_credited_for_another_amount(world):
    """The order asked for one amount; the payment charged another and was credited all the same."""
    co, payment = paid(world)
    with world.c.uow() as uow:
        uow.execute(update(checkout_session).where(checkout_session.c.order_id == co["order_id"])
                    .values(amount=payment["amount"] + 100))
        uow.commit()


def plant_paid_invoice_nobody_credited(world):
    """The provider holds the invoice as paid; nothing of ours stands on it."""
    _, payment = paid(world)
    later(world)
    with world.c.uow() as uow:
        uow.execute(delete(credit_ledger).where(credit_ledger.c.payment_id == payment["id"]))
        uow.execute(delete(purchase).where(purchase.c.transaction_id == payment["id"]))
        uow.execute(update(users).where(users.c.id == "user_a").values(credits=0))
        uow.commit()


def plant_purchase_on_a_voided_invoice(world):
    """A standing purchase whose invoice the provider holds as voided."""
    _, payment = paid(world)
    invoice_id = purchase_of(world, payment["id"]).invoice_id
    stored = world.sandbox.store.get("invoice", invoice_id)
    world.sandbox.store.put("invoice", invoice_id, {**stored, "status": "voided",
                                                    "updated_at": world.sandbox.now()})
    later(world)


def plant_purchase_stranded_with_a_person(world):
    """Recorded by us, never on the provider's invoice, and parked with a person (needs review): whoever
    owns it, reconcile names it."""
    unreported_behind_review_row(world, "needs_review")


@pytest.mark.parametrize(("plant", "check"), [
    (plant_two_live_subscriptions_here, "two_live_subscriptions"),
    (plant_two_live_subscriptions_at_the_provider, "two_live_subscriptions"),
    (plant_renewal_charge_in_flight_too_long, "charge_in_flight_too_long"),
    (plant_authorization_never_captured, "charge_in_flight_too_long"),
    (plant_dunning_left_open_on_a_paid_invoice, "dunning_unfinished"),
    (plant_dunning_resolved_without_outcome, "dunning_unfinished"),
    (plant_dispute_lost_not_reversed, "dispute_lost_not_reversed"),
    (plant_credited_for_another_amount, "payment_amount_differs"),
    (plant_invoice_paid_twice, "invoice_credits_not_one_term"),
    (plant_paid_invoice_nobody_credited, "invoice_credits_not_one_term"),
    (plant_purchase_on_a_voided_invoice, "purchase_on_unpaid_invoice"),
    (plant_purchase_stranded_with_a_person, "recorded_not_on_provider_invoice"),
    (plant_recorded_payment_refunded_as_a_duplicate, "payment_recorded_and_refunded"),
])
def test_each_check_of_the_three_books_names_its_planted_violation(world, plant, check):
    """Issue 36 item 1: each invariant a billing auditor checks, planted, is named (and exit 5 follows
    from `ok` false); a clean system names nothing (test_a_clean_system_reports_nothing)."""
    plant(world)
    report = reconcile(world.c)
    assert check in {v["check"] for v in report["violations"]} and report["ok"] is False, report["violations"]


def test_a_refunded_duplicate_is_not_counted_as_paid_twice(world):
    """Issue 38 item 6: after the right fix for a double charge (a refund at the orchestrator, reversed in
    the ledger), the invoice is no longer paid twice."""
    co, payment = paid(world)
    invoice_id = purchase_of(world, payment["id"]).invoice_id
    credit_second_purchase(world, invoice_id, co["subscription_id"])
    later(world)
    assert {"invoice_paid_twice", "invoice_credits_not_one_term"} <= checks(world)
    with world.c.uow() as uow:
        assert uow.ledger.apply("user_a", -10, "refund:pay_second", "refund", "pay_second", world.c.clock.now())
        uow.commit()
    later(world)
    assert not {"invoice_paid_twice", "invoice_credits_not_one_term"} & checks(world)


def test_an_acknowledged_violation_stops_counting_and_a_new_one_still_counts(world):
    """Issue 36 item 3: `reconcile ack` with a reason: the known case is reported apart and no longer
    counted (no page), a new violation still is; the acknowledgement is audited."""
    from billingctl.adapters.db.tables import audit_log
    from billingctl.services.reconcile.acks import acknowledge

    plant_dispute_lost_not_reversed(world)
    [known] = [v for v in reconcile(world.c)["violations"] if v["check"] == "dispute_lost_not_reversed"]
    acknowledge(world.c, "dispute_lost_not_reversed", known["payment_id"], "won on appeal, bank confirmed",
                "ops@example")
    report = reconcile(world.c)
    assert report["ok"] is True and report["violations"] == []
    assert [a["acknowledged"] for a in report["acknowledged"]] == ["won on appeal, bank confirmed"]
    assert world.c.metrics.sample("billing_reconcile_violations", {}) == 0
    plant_ledger_without_purchase(world)  # a new case pages
    assert reconcile(world.c)["ok"] is False
    with world.c.uow() as uow:
        [row] = uow.execute(select(audit_log).where(audit_log.c.action == "reconcile.ack")).all()
    assert (row.actor, row.target) == ("ops@example", f"dispute_lost_not_reversed:{known['payment_id']}")


def test_an_acknowledgement_needs_a_known_check_and_a_reason(world):
    from billingctl.domain.errors import InvalidInput
    from billingctl.services.reconcile.acks import acknowledge

    with pytest.raises(InvalidInput):
        acknowledge(world.c, "no_such_check", "pay_1", "because", "ops")
    with pytest.raises(InvalidInput):
        acknowledge(world.c, "payment_unrecorded", "pay_1", " ", "ops")
    with world.c.uow() as uow:
        assert uow.acks.all() == {}


def test_runs_read_the_external_books_from_their_watermark(world):
    """Issue 36 item 2: the first run is a full pass; the next reads only what changed since the last run
    (less an overlap), so a payment older than the window is not listed again; --full reads it all."""
    paid(world, "user_a")
    later(world, 3 * 3600)
    first = reconcile(world.c)
    assert first["window"]["full"] is True and first["checked"]["payments"] == 1
    later(world, 86400)
    paid(world, "user_b")
    second = reconcile(world.c)
    assert second["window"]["full"] is False and second["checked"]["payments"] == 1
    assert reconcile(world.c, full=True)["checked"]["payments"] == 2
    later(world, 8 * 86400)  # a week on: the weekly full pass
    assert reconcile(world.c)["window"]["why"] == "weekly full pass"


def test_an_incremental_run_still_sees_a_refund_notified_in_its_window(world):
    """A refund's notification names the payment: an incremental run reads that payment (one read, not
    one per payment of the refund window) and finds the refund not reversed."""
    _, payment = paid(world)
    reconcile(world.c)
    later(world, 86400)
    world.sandbox.refund(payment["id"])  # notified, reversed
    credits = purchase_of(world, payment["id"]).credits
    with world.c.uow() as uow:  # ... and the reversal lost (a bug we plant)
        uow.execute(delete(credit_ledger).where(credit_ledger.c.reason == "refund"))
        uow.execute(update(users).where(users.c.id == "user_a").values(credits=credits))
        uow.commit()
    report = reconcile(world.c)
    assert report["window"]["full"] is False
    assert "refund_not_reversed" in {v["check"] for v in report["violations"]}


def named_by_the_next_daily_runs(world, check, days=2):
    for _ in range(days):
        later(world, 86400)
        report = reconcile(world.c)
        assert report["window"]["full"] is False
        assert check in {v["check"] for v in report["violations"]}


def test_an_open_violation_stays_reported_until_it_is_fixed(world):
    """An incremental run's window still reaches an open violation (the watermark never passes it): a
    payment left unrecorded is named every day, not only on the day it settled, and once it is recorded
    the window moves on."""
    from billingctl.services.payments import record_payment

    co = world.checkout("user_a")
    lost = world.sandbox.pay(co["order_id"], drop_webhook=True)
    later(world, 3 * 3600)
    assert "payment_unrecorded" in checks(world)
    named_by_the_next_daily_runs(world, "payment_unrecorded")
    record_payment(world.c, world.c.orchestrator.get_payment(lost["id"]), "operator")
    assert reconcile(world.c)["ok"] is True
    later(world, 86400)
    report = reconcile(world.c)
    assert report["ok"] is True and report["checked"]["payments"] == 0  # the window moved past it


def test_a_violation_in_our_own_books_stays_reported_by_the_daily_runs(world):
    """The daily run reads only the ledger rows written in its window; one that shows a violation keeps
    the window reaching back to it (a credit matching no purchase, two days on)."""
    plant_ledger_without_purchase(world)
    assert "ledger_without_purchase" in checks(world)
    named_by_the_next_daily_runs(world, "ledger_without_purchase")


def test_an_operator_refund_of_a_recorded_payment_reverses_its_credits_once(world):
    """`payments refund` (issue 38 item 6): through the orchestrator, audited; the reversal it makes and the
    refund notification that follows reverse the credits once; run again, it changes nothing."""
    from billingctl.services.payments import refund_by_operator

    _, payment = paid(world)
    credits = purchase_of(world, payment["id"]).credits
    done = refund_by_operator(world.c, payment["id"], "customer asked", "ops")
    assert (done["outcome"], done["refunded"], done["credits_reversed_total"]) == ("refunded", payment["amount"],
                                                                                   credits)
    again = refund_by_operator(world.c, payment["id"], "customer asked", "ops")
    assert (again["outcome"], again["credits_reversed"]) == ("already_refunded", 0)
    with world.c.uow() as uow:
        reversals = uow.execute(select(credit_ledger.c.amount).where(credit_ledger.c.reason == "refund")).all()
        balance = uow.execute(select(users.c.credits).where(users.c.id == "user_a")).scalar_one()
    assert [r.amount for r in reversals] == [-credits] and balance == 0
    later(world)
    assert reconcile(world.c)["ok"] is True


def test_a_daily_run_sums_each_user_of_its_window_and_each_payment_reversed_in_it(world):
    """The daily run's two ledger checks read their window only: each user credited or debited in it is
    summed over that user's own rows, and each payment reversed in it over its own reversals (at 1,000,000
    ledger rows, grouping the whole ledger took 0.4 s a run). Both still find what they find in a full pass."""
    _, first = paid(world, "user_a")
    assert reconcile(world.c)["ok"] is True
    later(world, 86400)
    paid(world, "user_b")
    over = purchase_of(world, first["id"]).credits + 5
    with world.c.uow() as uow:  # planted: user_b's balance off its ledger; user_a's first payment over-reversed
        uow.execute(update(users).where(users.c.id == "user_b").values(credits=users.c.credits + 7))
        assert uow.ledger.apply("user_a", -over, "refund:planted", "refund", first["id"], world.c.clock.now())
        uow.commit()
    later(world, 60)
    for full in (False, True):
        report = reconcile(world.c, full=full)
        assert report["window"]["full"] is full
        found = {(v["check"], v["user_id"], v.get("payment_id")) for v in report["violations"]
                 if v["check"] in ("credits_differ_from_ledger", "refund_exceeds_credit")}
        assert found == {("credits_differ_from_ledger", "user_b", None),
                         ("refund_exceeds_credit", "user_a", first["id"])}, report["window"]


def plant_credits_matching_no_purchase(world, count, first=0):
    """`count` credits of a user that match no purchase (`ledger_without_purchase`), one payment id each."""
    now = world.c.clock.now()
    with world.c.uow() as uow:
        if first == 0:
            uow.execute(insert(users).values(id="user_g", created_at=now, credits=0))
        for i in range(first, first + count):
            uow.execute(insert(credit_ledger).values(user_id="user_g", amount=0, source_key=f"payment:pay_ghost_{i}",
                                                     reason="payment", payment_id=f"pay_ghost_{i}", created_at=now))
        uow.commit()


def test_a_new_violation_is_named_beside_as_many_acknowledged_ones_as_a_report_lists(world):
    """Each check of our own books read at most LIMIT rows: once a person had acknowledged that many cases
    of one check, a new one was never read and reconcile reported a clean system (decision 234)."""
    from billingctl.services.reconcile import LIMIT

    plant_credits_matching_no_purchase(world, LIMIT)
    with world.c.uow() as uow:
        for i in range(LIMIT):
            assert uow.acks.put("ledger_without_purchase", f"pay_ghost_{i}", "imported history", "ops",
                                world.c.clock.now())
        uow.commit()
    assert reconcile(world.c)["ok"] is True
    plant_credits_matching_no_purchase(world, 1, first=LIMIT)
    report = reconcile(world.c)
    assert report["ok"] is False and report["counts"] == {"ledger_without_purchase": 1}
    assert [v["payment_id"] for v in report["violations"]] == [f"pay_ghost_{LIMIT}"]
    assert len(report["acknowledged"]) == LIMIT


def test_every_violation_of_a_check_is_counted_and_as_many_as_a_report_lists_are_named(world):
    """The count (and the metric that pages) is every violation, not the rows one page read."""
    from billingctl.services.reconcile import LIMIT

    plant_credits_matching_no_purchase(world, LIMIT + 20)
    report = reconcile(world.c)
    assert report["counts"] == {"ledger_without_purchase": LIMIT + 20}
    assert len(report["violations"]) == LIMIT
    assert world.c.metrics.sample("billing_reconcile_violations", {}) == LIMIT + 20
