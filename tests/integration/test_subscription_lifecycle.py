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


# ---- defect 2: a cancel while a renewal charge is in flight never re-subscribes -------------------------

def provider_invoices_holding(world, payment_id):
    return [i["id"] for i in world.sandbox.store.all("invoice")
            if any(world.sandbox.store.get("transaction", link["txn_id"])["reference_number"] == payment_id
                   for link in i.get("linked_payments") or [])]


@pytest.mark.parametrize("seen_by", ["webhook", "settled-payments poller"])
def test_a_renewal_settling_after_the_customer_cancelled_pays_its_period_once_and_never_resubscribes(world,
                                                                                                    seen_by):
    from billingctl.services.orphans import run_orphans
    from billingctl.services.payments import retry_pending
    from billingctl.services.renewals import run_renewals
    from billingctl.services.sync import cancel_subscription
    from tests.conftest import advance_with_sandbox

    co = subscribed(world)
    month_passes(world)
    world.sandbox.async_charges("PENDING")
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    [charge] = [p for p in world.sandbox.store.all("payment") if p["orderId"] != co["order_id"]]
    cancel_subscription(world.c, co["subscription_id"], "customer asked", "ops")
    world.sandbox.finish_payment(charge["id"], settle=True, drop_webhook=seen_by != "webhook")
    advance_with_sandbox(world.c, 60)
    run_orphans(world.c)
    retry_pending(world.c)
    run_renewals(world.c)
    assert provider_invoices_holding(world, charge["id"]) == [charge["orderId"]]  # one invoice holds it
    subs = world.sandbox.store.all("subscription")
    assert [(s["id"], s["status"]) for s in subs] == [(co["subscription_id"], "cancelled")]  # no new one
    assert world.credits() == 4000  # the paid period is honoured once
    from billingctl.services.orphans import list_orphans

    assert list_orphans(world.c) == []
