"""Where each fact of a payment comes from (spec section 1: the orchestrator's payment, our checkout, the
provider only for what we do not hold): every field, every fallback, every refusal with its message.
Written against the survivors of `make mutation`."""

from dataclasses import asdict

import pytest

from billingctl.domain import errors as e
from billingctl.domain.clock import parse_time
from billingctl.services.payments import facts_from_payment
from tests.helpers import term_runs_out

pytestmark = pytest.mark.integration
PRO = "credits-pro-USD-monthly"


def refused(world, payment) -> str:
    with pytest.raises(e.InvalidInput) as error:
        facts_from_payment(world.c, payment)
    return error.value.message


def test_every_fact_comes_from_the_payment_when_it_names_it(world):
    payment = {"id": "pay_1", "status": "SETTLED", "orderId": "inv_77", "customerId": "user_z", "amount": "1234",
               "currencyCode": "EUR", "date": "2026-11-20T10:00:00Z",
               "processor": {"name": "NSFW_NMI", "processorMerchantId": "mid_9"},
               "metadata": {"subscription_id": "sub_9", "item_price_id": PRO, "lane": "nsfw", "user_id": "other"}}
    assert asdict(facts_from_payment(world.c, payment)) == {
        "payment_id": "pay_1", "user_id": "user_z", "subscription_id": "sub_9", "invoice_id": "inv_77",
        "item_price_id": PRO, "lane": "nsfw", "amount": 1234, "currency_code": "EUR", "credits": 2000,
        "processor": "NSFW_NMI", "merchant_id": "mid_9", "settled_at": parse_time("2026-11-20T10:00:00Z"),
        "expected_amount": None, "expected_currency": None,  # no checkout of ours names this order
        "provider_side": False,
        "renewal": True}  # ordered as an invoice: a renewal charge (its record on the invoice is the workflow's)


def test_a_checkout_payment_is_completed_from_our_checkout_and_has_no_invoice_yet(world):
    world.checkout("user_other")  # another checkout, also without an invoice: never this payment's
    co = world.checkout("user_k")
    paid = world.settle(co["order_id"])
    bare = {"id": paid["id"], "status": "SETTLED", "orderId": co["order_id"], "amount": paid["amount"]}
    facts = facts_from_payment(world.c, bare)
    assert (facts.user_id, facts.subscription_id, facts.invoice_id, facts.item_price_id, facts.lane,
            facts.currency_code, facts.amount, facts.processor, facts.settled_at) == (
        "user_k", co["subscription_id"], None, PRO, "sfw", "USD", paid["amount"], None, None)
    assert facts_from_payment(world.c, {**bare, "metadata": {"user_id": "meta_user"}}).user_id == "meta_user"


def test_a_renewal_payment_finds_its_subscription_from_the_invoice_and_its_plan_locally(world):
    co = world.checkout("user_r")
    world.sandbox.pay(co["order_id"])  # recorded and activated: the local subscription knows its plan
    term_runs_out(world.sandbox, co["subscription_id"], world.c)
    invoice = world.sandbox.renew_due()[0]
    payment = {"id": "pay_r", "status": "SETTLED", "orderId": invoice["id"], "customerId": "user_r", "amount": 5}
    facts = facts_from_payment(world.c, payment)
    assert (facts.subscription_id, facts.invoice_id, facts.item_price_id) == (co["subscription_id"], invoice["id"],
                                                                           PRO)


def test_a_payment_naming_only_its_invoice_finds_the_subscription_in_our_copy_even_once_finance_deleted_it(world):
    """A settled payment whose facts name an invoice but no subscription (one made outside our client) read
    the invoice at the provider each time it was recorded; for an invoice finance deleted meanwhile that
    read is "not found", so the payment was retried for ever instead of reaching decision 201's refund.
    Our copy of the invoice names its subscription: it is read first, and the provider only without one."""
    from billingctl.services import events

    co = world.checkout("user_d")
    world.sandbox.pay(co["order_id"])
    term_runs_out(world.sandbox, co["subscription_id"], world.c)
    invoice = world.sandbox.renew_due()[0]
    events.poll(world.c)  # our copy of the renewal invoice
    world.sandbox.delete_invoice(invoice["id"])
    events.poll(world.c)
    reads = world.sandbox.store.count_requests("provider", "GET", f"/invoices/{invoice['id']}")
    payment = {"id": "pay_d", "status": "SETTLED", "orderId": invoice["id"], "customerId": "user_d", "amount": 5}
    facts = facts_from_payment(world.c, payment)
    assert (facts.subscription_id, facts.invoice_id) == (co["subscription_id"], invoice["id"])
    assert world.sandbox.store.count_requests("provider", "GET", f"/invoices/{invoice['id']}") == reads


def test_a_plan_unknown_locally_is_read_from_the_provider_with_its_customer(world):
    co = world.checkout("user_p")
    world.sandbox.pay(co["order_id"])
    with world.c.uow() as uow:
        uow.subscriptions.set(co["subscription_id"], item_price_id=None)
        uow.commit()
    facts = facts_from_payment(world.c, {"id": "pay_p", "status": "SETTLED",
                                         "metadata": {"subscription_id": co["subscription_id"]}})
    assert (facts.item_price_id, facts.user_id, facts.credits) == (PRO, "user_p", 2000)


def test_refusals_name_the_payment_and_what_is_missing(world):
    assert refused(world, {"status": "SETTLED"}) == "payment id is missing"
    assert refused(world, "pay_1") == "payment is not an object"
    assert refused(world, {"id": "pay_1", "status": "DECLINED"}) == "payment pay_1 is DECLINED, not SETTLED"
    assert refused(world, {"id": "pay_1"}) == "payment status is missing"
    assert refused(world, {"id": "pay_1", "status": "SETTLED", "amount": "much"}) == \
        "invalid payment amount: Input should be a valid integer, unable to parse string as an integer"
    assert refused(world, {"id": "pay_2", "status": "SETTLED"}) == "payment pay_2 names no subscription or invoice"
    co = world.checkout("user_q")
    world.sandbox.pay(co["order_id"])
    with world.c.uow() as uow:
        uow.subscriptions.set(co["subscription_id"], item_price_id=PRO)
        uow.commit()
    assert refused(world, {"id": "pay_3", "status": "SETTLED", "metadata": {
        "subscription_id": co["subscription_id"]}}) == "payment pay_3 names no customer"


def test_a_payment_for_a_checkout_already_started_belongs_to_its_first_invoice(world):
    """Once activation has given the checkout its first term's invoice, a further payment naming only the
    checkout's order belongs to that invoice (recording it there finds it already paid)."""
    co = world.checkout("user_s")
    world.sandbox.pay(co["order_id"])
    with world.c.uow() as uow:
        first = uow.purchases.first_of_subscription(co["subscription_id"]).invoice_id
    assert first and first != co["subscription_id"]
    facts = facts_from_payment(world.c, {"id": "pay_again", "status": "SETTLED", "orderId": co["order_id"]})
    assert (facts.invoice_id, facts.subscription_id, facts.user_id) == (first, co["subscription_id"], "user_s")
