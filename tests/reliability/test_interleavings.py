"""Property-based interleavings on PostgreSQL (Hypothesis stateful testing): random sequences and
concurrent mixes of payment webhooks (duplicates, out of order), event polls, settled-payment polls,
activations, syncs, refunds and orphans over a handful of users and payments.

Invariants after every step: at most one purchase per payment; users.credits equals the ledger sum;
no refund reversed more than once. After the pollers have run: every settled payment is recorded or
owned by orphan recovery, and every refund is reversed exactly once."""

import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import func, select

from billingctl.adapters.db.tables import credit_ledger, orphan_recovery, purchase, users
from billingctl.bootstrap import Container
from billingctl.domain.clock import ManualClock
from billingctl.domain.errors import AlreadySubscribed
from billingctl.domain.lifecycle import ORPHAN
from billingctl.services import events, orphans
from billingctl.services import users as users_service
from billingctl.services.checkout import create_checkout
from billingctl.services.payments import record_payment, retry_pending
from billingctl.services.sync import cancel_subscription, sync_subscription
from tests.conftest import _truncate_postgres, advance_with_sandbox, clock_to_sandbox
from tests.helpers import assert_books_hold_at_every_moment

pytestmark = pytest.mark.reliability
USERS = ("ada", "bo", "cy")
PLANS = ("credits-basic-USD-monthly", "credits-pro-USD-monthly", "credits-pro-nsfw-USD-monthly")
FIGURES = {"examples": 0, "steps": 0}


class Billing(RuleBasedStateMachine):
    checkouts = Bundle("checkouts")
    payments = Bundle("payments")

    def __init__(self):
        super().__init__()
        FIGURES["examples"] += 1
        _truncate_postgres(CONTEXT["db_url"])
        n = FIGURES["examples"]
        sandbox_db = Path(CONTEXT["tmp"]) / f"sandbox-{n}.db"
        self.c = Container(CONTEXT["make_settings"](database_url=CONTEXT["db_url"], sandbox_db=str(sandbox_db),
                                                    http_max_attempts=2, provider_rate_limit=1_000_000),
                           clock=ManualClock())  # the model's clock runs fast: the real-time budget is lifted
        self.c.provider.http.sleep = self.c.orchestrator.http.sleep = lambda s: None
        self.sandbox = self.c.sandbox
        clock_to_sandbox(self.c)
        self.paid_orders: set[str] = set()

    def teardown(self):
        self.c.close()

    def tick(self, seconds=1):
        advance_with_sandbox(self.c, seconds)

    # ---- rules ---------------------------------------------------------------------------------
    @rule(target=checkouts, user=st.sampled_from(USERS), plan=st.sampled_from(PLANS))
    def checkout(self, user, plan):
        FIGURES["steps"] += 1
        try:
            return create_checkout(self.c, user, plan)  # a second tab of a pending plan: that same checkout
        except AlreadySubscribed:
            return multiple()  # the customer holds the plan live: refused, nothing made (decision 110)

    @rule(target=payments, co=checkouts, drop=st.booleans(), dups=st.integers(0, 2), hold=st.booleans())
    def settle(self, co, drop, dups, hold):
        FIGURES["steps"] += 1
        if co["order_id"] in self.paid_orders:
            return self.sandbox.payments("SETTLED")[0]["id"]
        self.paid_orders.add(co["order_id"])
        if hold:
            self.sandbox.hold_webhooks()
        payment = self.sandbox.pay(co["order_id"], drop_webhook=drop, duplicates=1 + dups)
        if hold:
            self.sandbox.send_webhook("PAYMENT.STATUS", {**payment, "status": "AUTHORIZED"})
            self.sandbox.release_webhooks("reverse")  # out of order: SETTLED before AUTHORIZED, or after
        return payment["id"]

    @rule(co=checkouts)
    def cancel_before_payment(self, co):
        """A checkout-retry orphan in the making: the pending subscription is cancelled."""
        FIGURES["steps"] += 1
        if co["order_id"] not in self.paid_orders:
            cancel_subscription(self.c, co["subscription_id"], "abandoned", "test")

    @rule(payment_id=payments)
    def redeliver(self, payment_id):
        FIGURES["steps"] += 1
        self.sandbox.send_webhook("PAYMENT.STATUS", self.sandbox.store.get("payment", payment_id))

    @rule()
    def poll(self):
        FIGURES["steps"] += 1
        self.tick()
        events.poll(self.c)

    @rule()
    def settled_poll(self):
        FIGURES["steps"] += 1
        self.tick(16)
        orphans.run_orphans(self.c)

    @rule()
    def activations(self):
        FIGURES["steps"] += 1
        retry_pending(self.c)

    @rule(co=checkouts)
    def sync(self, co):
        FIGURES["steps"] += 1
        sync_subscription(self.c, co["subscription_id"])

    @rule(payment_id=payments, partial=st.booleans())
    def refund(self, payment_id, partial):
        FIGURES["steps"] += 1
        payment = self.sandbox.store.get("payment", payment_id)
        left = payment["amount"] - payment["processor"]["amountRefunded"]
        if left > 0:
            self.sandbox.refund(payment_id, left // 2 if partial and left > 1 else left)

    @rule(payment_id=payments, freeze=st.booleans())
    def concurrent_mix(self, payment_id, freeze):
        """The payment's webhook, both pollers and a direct record at once, and maybe an operator freezing its
        customer meanwhile: the freeze comes before the payment (held) or after its credit (decision 177)."""
        FIGURES["steps"] += 1
        payment = self.sandbox.store.get("payment", payment_id)
        user = payment["customerId"]
        self.tick(16)
        barrier = threading.Barrier(5 if freeze else 4)
        errors = []

        def run(fn):
            try:
                barrier.wait(10)
                fn()
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        jobs = [lambda: self.sandbox.send_webhook("PAYMENT.STATUS", payment),
                lambda: events.poll(self.c), lambda: orphans.run_orphans(self.c),
                lambda: record_payment(self.c, payment, "settled_poller")]
        if freeze:
            jobs.append(lambda: users_service.freeze(self.c, user, "fraud review", "ops"))
        threads = [threading.Thread(target=run, args=(j,)) for j in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        if freeze:
            with self.c.uow() as uow:
                last = uow.execute(select(users.c.frozen_ledger_id).where(users.c.id == user)).scalar_one()
                after = uow.execute(select(credit_ledger.c.id).where(
                    credit_ledger.c.user_id == user, credit_ledger.c.amount > 0, credit_ledger.c.id > last)).all()
            assert not after, f"credited after the freeze: {user} {after}"
            users_service.unfreeze(self.c, user, "review passed", "ops")

    @precondition(lambda self: bool(self.paid_orders))
    @rule()
    def drain_then_check_everything(self):
        """After the pollers have run, nothing settled is left unrecorded and refunds are reversed once."""
        FIGURES["steps"] += 1
        self.tick(16)
        events.poll(self.c)
        orphans.run_orphans(self.c)
        retry_pending(self.c)
        events.poll(self.c)
        with self.c.uow() as uow:
            recorded = {r.transaction_id: r for r in uow.execute(select(purchase))}
            owned = dict(uow.execute(select(orphan_recovery.c.payment_id, orphan_recovery.c.status)).all())
            reversed_ = dict(uow.execute(select(credit_ledger.c.payment_id, -func.sum(credit_ledger.c.amount))
                                         .where(credit_ledger.c.reason == "refund")
                                         .group_by(credit_ledger.c.payment_id)).all())
        for payment in self.sandbox.payments("SETTLED"):
            pid = payment["id"]
            assert pid in recorded or owned.get(pid) in ORPHAN.states, pid
            if pid in recorded:
                bought = recorded[pid]
                expected = bought.credits * payment["processor"]["amountRefunded"] // bought.amount
                assert int(reversed_.get(pid, 0)) == expected, (pid, reversed_.get(pid), expected)

    # ---- invariants after every step -----------------------------------------------------------------
    @invariant()
    def one_purchase_per_payment_and_credits_equal_the_ledger(self):
        assert_books_hold_at_every_moment(self.c)


CONTEXT: dict = {}


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_random_interleavings_keep_the_invariants(db_url, make_settings, tmp_path, record_property):
    CONTEXT.update(db_url=db_url, make_settings=make_settings, tmp=tmp_path)
    run_state_machine_as_test(Billing, settings=settings(
        max_examples=30, stateful_step_count=25, deadline=None, derandomize=False,
        suppress_health_check=list(HealthCheck)))
    record_property("examples", FIGURES["examples"])
    record_property("steps", FIGURES["steps"])
    print(f"interleavings: {FIGURES['examples']} examples, {FIGURES['steps']} steps")
    assert FIGURES["steps"] > 0
