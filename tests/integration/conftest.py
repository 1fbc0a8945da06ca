"""Shared fixtures for the payment tests: a container on each database, checkouts through the real
services, payments settled by the sandbox orchestrator."""

import pytest
from sqlalchemy import func, select

from billingctl.adapters.db.tables import credit_ledger, purchase, users
from billingctl.services.checkout import create_checkout
from tests.conftest import advance_with_sandbox
from tests.helpers import term_runs_out


class World:
    def __init__(self, container):
        self.c = container
        self.sandbox = container.sandbox

    def advance(self, seconds):
        advance_with_sandbox(self.c, seconds)

    def checkout(self, user_id="user_a", item_price_id="credits-pro-USD-monthly"):
        return create_checkout(self.c, user_id, item_price_id)

    def settle(self, order_id, **kw):
        """Settle at the orchestrator without delivering the webhook; returns the payment."""
        kw.setdefault("drop_webhook", True)
        return self.sandbox.pay(order_id, **kw)

    def purchases(self, payment_id=None):
        query = select(func.count()).select_from(purchase)
        if payment_id:
            query = query.where(purchase.c.transaction_id == payment_id)
        with self.c.uow() as uow:
            return uow.execute(query).scalar_one()

    def credits(self, user_id="user_a"):
        with self.c.uow() as uow:
            balance = uow.execute(select(users.c.credits).where(users.c.id == user_id)).scalar()
            ledger = uow.execute(select(func.coalesce(func.sum(credit_ledger.c.amount), 0)).where(
                credit_ledger.c.user_id == user_id)).scalar_one()
        assert balance == ledger, "users.credits must equal the ledger sum"
        return balance

    def renewal_charged_unseen(self, user_id="user_a", item_price_id="credits-pro-USD-monthly"):
        """A paid checkout, then its renewal charged by the orchestrator and reported to the provider
        (the invoice paid, payment_succeeded emitted) while our answer and the webhook were lost:
        what the event poller and the invoice scan exist for. Returns (checkout, invoice, payment)."""
        co = self.checkout(user_id, item_price_id)
        self.sandbox.pay(co["order_id"])  # webhook delivered: recorded, activated, first invoice paid
        term_runs_out(self.sandbox, co["subscription_id"], self.c)
        invoice = self.sandbox.renew_due()[0]
        token = self.sandbox.instruments(user_id)[0]["token"]
        lane = self.sandbox.item_price(item_price_id)["metadata"]["lane"]
        payment = self.sandbox.charge({
            "paymentMethodToken": token, "amount": invoice["total"], "currencyCode": "USD", "orderId": invoice["id"],
            "customerId": user_id, "paymentMethod": {"paymentType": "SUBSCRIPTION"},
            "metadata": {"psp": "SFW_STRIPE" if lane == "sfw" else "NSFW_SEGPAY", "lane": lane,
                         "subscription_id": co["subscription_id"], "item_price_id": item_price_id}},
            drop_webhook=True)
        assert payment["status"] == "SETTLED" and self.sandbox.invoice(invoice["id"])["status"] == "paid"
        return co, invoice, payment

    def provider_record_calls(self):
        return self.sandbox.store.count_requests("provider", "POST", "record_payment")


@pytest.fixture
def world(make_settings, db_url):
    """Our clock is the sandbox's (real time until a test moves it), so time passes for both together."""
    from billingctl.bootstrap import Container

    c = Container(make_settings(database_url=db_url, clock="sandbox"))
    yield World(c)
    c.close()


@pytest.fixture
def one_try_world(make_settings, db_url):
    """A world whose clients try each call once and never sleep: a fault is seen at once."""
    from billingctl.bootstrap import Container
    from billingctl.domain.clock import ManualClock

    c = Container(make_settings(database_url=db_url, http_max_attempts=1), clock=ManualClock())
    c.provider.http.sleep = c.orchestrator.http.sleep = lambda s: None
    yield World(c)
    c.close()
