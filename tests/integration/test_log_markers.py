"""The spec's log markers carry their fields (spec sections 2 and 3): what an operator greps for names
the user, the lane and the processors involved. Written against the survivors of `make mutation`."""

import logging

import pytest

from billingctl.services.renewals import run_renewals
from tests.integration.test_processor_lock import settle
from tests.integration.test_renewals import NSFW, month_passes, subscribed
from tests.integration.test_renewals import world as world  # noqa: F401 - the fixture

pytestmark = pytest.mark.integration


def marked(caplog, message):
    return [r for r in caplog.records if r.getMessage() == message]


def test_drift_names_the_user_lane_and_both_processors_and_a_same_processor_settle_is_no_drift(world, caplog):
    settle(world, processor="NSFW_SEGPAY")
    with caplog.at_level(logging.WARNING, logger="billingctl.processor_lock"):
        settle(world, processor="NSFW_SEGPAY")  # the locked processor again: no drift
        assert marked(caplog, "settled processor differs from locked psp") == []
        settle(world, processor="NSFW_CCBILL")
    [drift] = marked(caplog, "settled processor differs from locked psp")
    assert (drift.user_id, drift.lane, drift.locked_psp, drift.settled_psp) == (
        "user_a", "nsfw", "NSFW_SEGPAY", "NSFW_CCBILL")
    assert world.c.metrics.sample("billing_processor_lock_drift_total", {
        "lane": "nsfw", "locked_psp": "NSFW_SEGPAY", "settled_psp": "NSFW_SEGPAY"}) == 0


def test_card_substitution_and_no_card_found_name_the_user_and_what_was_stored(world, caplog):
    subscribed(world, "user_w", plan=NSFW, method="PAYPAL")
    subscribed(world, "user_c", plan=NSFW, method="PAYPAL")
    world.sandbox.add_instrument("user_c", "PAYMENT_CARD")
    month_passes(world)
    with caplog.at_level(logging.INFO, logger="billingctl.renewals"):
        run_renewals(world.c)
    [substituted] = marked(caplog, "nsfw_renewal_card_substitution")
    assert (substituted.user_id, substituted.from_type) == ("user_c", "PAYPAL")
    [none_found] = marked(caplog, "nsfw_renewal_no_card_found")
    assert none_found.user_id == "user_w"


def test_a_renewal_paid_at_the_provider_by_the_orchestrator_is_marked_recorded(world):
    """The orchestrator's workflow records the renewal on the invoice; the provider's payment_succeeded
    event confirms it (issue 39 item 1: we no longer post it again to be refused as already paid)."""
    from billingctl.services import events

    subscribed(world)
    month_passes(world)
    run_renewals(world.c)
    renewal = [p for p in world.sandbox.store.all("payment") if p["paymentMethod"]["paymentType"] == "SUBSCRIPTION"]
    with world.c.uow() as uow:
        assert uow.purchases.by_payment_id(renewal[0]["id"])["provider_recorded_at"] is None
    events.poll(world.c)
    with world.c.uow() as uow:
        assert uow.purchases.by_payment_id(renewal[0]["id"])["provider_recorded_at"] is not None
