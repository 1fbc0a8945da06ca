"""Provider calls per business operation, counted on the sandbox's side (issue 39 item 1): what each
operation costs of the 60 calls a minute every process shares. The renewal's figure is in the issue (2
besides the tick's list today, against a goal of 1)."""

import pytest

from billingctl.services import events
from billingctl.services.catalog import products
from billingctl.services.checkout import create_checkout

pytestmark = pytest.mark.integration


def calls(world, operation) -> int:
    before = world.sandbox.store.count_requests("provider")
    operation()
    return world.sandbox.store.count_requests("provider") - before


def test_each_operation_spends_what_it_must_and_no_more(one_try_world):
    world = one_try_world
    products(world.c)  # a warm catalog, as in production
    assert calls(world, lambda: events.poll(world.c)) <= 1  # an idle poll: one page
    assert calls(world, lambda: events.poll(world.c)) == 1
    checkouts = []
    # A new user: the provider's customer, then the subscription; a returning user: the subscription only.
    assert calls(world, lambda: checkouts.append(create_checkout(world.c, "budget_user",
                                                                 "credits-pro-USD-monthly"))) == 2
    assert calls(world, lambda: create_checkout(world.c, "budget_user", "credits-basic-USD-monthly")) == 1
    # Recording and activating a checkout's payment: the start (which names the invoice) and the record on it.
    assert calls(world, lambda: world.sandbox.pay(checkouts[0]["order_id"])) == 2
