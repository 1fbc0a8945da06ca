"""Which card an NSFW renewal substitutes (spec section 3 rule 3): the one vaulted at the user's latest
NSFW checkout (never an SFW checkout's, a renewal's or another user's), else the newest usable card.
Written against the survivors of `make mutation`."""

import pytest

from billingctl.services.renewals import _latest_nsfw_checkout_token, run_renewals
from tests.integration.test_renewals import NSFW, PRO, month_passes
from tests.integration.test_renewals import world as world  # noqa: F401 - the fixture

pytestmark = pytest.mark.integration


def paid(world, user, plan):
    payment = world.sandbox.pay(world.checkout(user, plan)["order_id"])
    return payment["paymentMethod"]["paymentMethodToken"]


def test_the_latest_nsfw_checkouts_card_and_no_other(world):
    assert _latest_nsfw_checkout_token(world.c, "user_a") is None  # no checkout yet
    paid(world, "user_a", NSFW)
    latest = paid(world, "user_a", "credits-max-nsfw-USD-monthly")  # the lane's other plan (one live per plan)
    paid(world, "user_a", PRO)  # a later SFW checkout's card is not the NSFW lane's
    paid(world, "user_b", NSFW)  # nor another user's
    assert _latest_nsfw_checkout_token(world.c, "user_a") == latest
    newest = world.sandbox.add_instrument("user_a", "PAYMENT_CARD", default=True)["token"]
    month_passes(world)
    assert run_renewals(world.c)["outcomes"] == {"succeeded": 4}  # renewals charge the new primary card
    renewals = [p for p in world.sandbox.store.all("payment") if p["paymentMethod"]["paymentType"] == "SUBSCRIPTION"
                and p["customerId"] == "user_a"]
    assert {p["paymentMethod"]["paymentMethodToken"] for p in renewals} == {newest}
    assert _latest_nsfw_checkout_token(world.c, "user_a") == latest  # a renewal is not a checkout


def test_an_unreadable_payment_means_no_preference(world):
    paid(world, "user_a", NSFW)
    world.sandbox.store.add_fault("orchestrator", "500", method="GET", path="/payments/", count=-1)
    assert _latest_nsfw_checkout_token(world.c, "user_a") is None


def test_substitution_takes_the_latest_checkouts_card_over_a_newer_card(world):
    """The stored instrument is a wallet; of two usable cards the one vaulted at the latest NSFW checkout is
    charged, not the newest."""
    world.sandbox.add_instrument("user_a", "PAYPAL", default=True)
    world.sandbox.store.add_fault("orchestrator", "500", method="POST", path="/default", count=-1)
    checkout_card = paid(world, "user_a", NSFW)  # making it primary fails: the wallet stays stored
    world.sandbox.store.clear_faults()
    world.sandbox.add_instrument("user_a", "PAYMENT_CARD")  # a newer usable card, not a checkout's
    month_passes(world)
    assert run_renewals(world.c)["outcomes"] == {"succeeded": 1}
    renewal = [p for p in world.sandbox.store.all("payment") if p["paymentMethod"]["paymentType"] == "SUBSCRIPTION"]
    assert [p["paymentMethod"]["paymentMethodToken"] for p in renewal] == [checkout_card]
