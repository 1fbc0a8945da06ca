"""Issue 35: the subscription lifecycle against the real provider (Chargebee-shaped): customers and
subscriptions collected offline, operator actions while a charge is in flight, provider-side payments,
event order, clocks. Each test failed before its fix, on SQLite and PostgreSQL."""

import pytest

from tests.integration.test_renewals import PRO, month_passes, subscribed
from tests.integration.test_renewals import world as world  # noqa: F401 - the fixture

pytestmark = pytest.mark.integration


# ---- defect 6: customers and subscriptions are created with auto-collection off -------------------------

def test_a_checkout_creates_its_customer_and_subscription_with_auto_collection_off_and_activates(world):
    co = world.checkout("user_ac", PRO)
    assert world.sandbox.customer("user_ac")["auto_collection"] == "off"
    assert world.sandbox.subscription(co["subscription_id"])["auto_collection"] == "off"
    world.sandbox.pay(co["order_id"])  # no card is ever stored at the provider: it must still start
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "active"
    assert world.credits("user_ac") == 2000
