"""Shared fixtures for the payment tests: a container on each database, checkouts through the real
services, payments settled by the sandbox orchestrator."""

import pytest
from sqlalchemy import func, select

from billingctl.adapters.db.tables import credit_ledger, purchase, users
from billingctl.services.checkout import create_checkout


class World:
    def __init__(self, container):
        self.c = container
        self.sandbox = container.sandbox

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

    def provider_record_calls(self):
        return self.sandbox.store.count_requests("provider", "POST", "record_payment")


@pytest.fixture
def world(container):
    return World(container)
