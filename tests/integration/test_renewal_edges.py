"""A renewal attempt's documents at its edges: what is charged (the whole metadata), what is recorded when
there is no card to charge, which invoices are not renewals, and what a dry run says about a charge in
flight. Written against the mutants of `make mutation` that survived the suite."""

from datetime import timedelta

import pytest
from sqlalchemy import select

from billingctl.adapters.db.tables import fraud_event
from billingctl.services.renewals import attempt_invoice, run_renewals
from tests.integration.test_dunning_rows import FIELDS, renewal_invoice, rows
from tests.integration.test_renewals import NSFW, PRO, month_passes, subscribed
from tests.integration.test_renewals import world as world  # noqa: F401 - the fixture

pytestmark = pytest.mark.integration


def renewals(world):
    return [p for p in world.sandbox.store.all("payment") if p["paymentMethod"]["paymentType"] == "SUBSCRIPTION"]


def reservations(world):
    with world.c.uow() as uow:
        return [k for k in uow.execute(select(fraud_event.c.dedupe_key)).scalars() if k and k.startswith("order:")]


def test_a_customer_without_any_payment_method_is_a_failed_attempt_that_holds_no_quota_slot(world):
    co = subscribed(world, plan=NSFW)
    for instrument in world.sandbox.instruments("user_a"):
        world.sandbox.store.put("instrument", instrument["token"], {**instrument, "deleted": True})
    month_passes(world)
    before = len(world.sandbox.store.all("payment"))
    assert run_renewals(world.c)["outcomes"] == {"failed": 1}
    assert len(world.sandbox.store.all("payment")) == before  # nothing was sent to charge
    invoice = renewal_invoice(world, co)
    with world.c.uow() as uow:
        processor = uow.locks.read("user_a")["nsfw_processor"]
    row = rows(world)[-1]
    assert tuple(row[f] for f in FIELDS) == ("failed", "no_payment_method", 1, "nsfw", processor,
                                             invoice["amount_due"], None)
    assert row["invoice_id"] == invoice["id"] and processor
    assert row["next_attempt_at"] == world.c.clock.now() + timedelta(hours=world.c.settings.renewal_retry_hours[0])
    assert reservations(world) == []  # the slot reserved for the attempt was released


def test_a_renewal_charge_carries_the_whole_metadata_and_an_sfw_one_no_merchant_account(world):
    nsfw = subscribed(world, plan=NSFW)
    sfw = subscribed(world, plan=PRO)  # the same user, both lanes: the NSFW lock has a merchant account
    month_passes(world)
    assert run_renewals(world.c)["outcomes"] == {"succeeded": 2}
    with world.c.uow() as uow:
        lock = uow.locks.read("user_a")
    by_lane = {p["metadata"]["lane"]: p["metadata"] for p in renewals(world)}
    assert by_lane["nsfw"] == {"psp": lock["nsfw_processor"], "lane": "nsfw", "user_id": "user_a",
                               "subscription_id": nsfw["subscription_id"], "item_price_id": NSFW,
                               "merchant_initiated": True, "processor_merchant_id": lock["nsfw_processor_mid"]}
    assert by_lane["sfw"] == {"psp": lock["sfw_processor"], "lane": "sfw", "user_id": "user_a",
                              "subscription_id": sfw["subscription_id"], "item_price_id": PRO,
                              "merchant_initiated": True}
    assert lock["nsfw_processor_mid"]


def test_an_invoice_of_a_subscription_we_do_not_hold_active_is_not_a_renewal_but_non_renewing_is(world):
    co = subscribed(world)
    month_passes(world)
    world.sandbox.renew_due()
    invoice = renewal_invoice(world, co)
    unknown = {**invoice, "subscription_id": "sub_unknown"}
    assert attempt_invoice(world.c, unknown) == "not_a_renewal"
    with world.c.uow() as uow:
        uow.subscriptions.set(co["subscription_id"], status="future")
        uow.commit()
    assert attempt_invoice(world.c, invoice) == "not_a_renewal"
    assert renewals(world) == []
    with world.c.uow() as uow:
        uow.subscriptions.set(co["subscription_id"], status="non_renewing")  # still owes its current term
        uow.commit()
    assert attempt_invoice(world.c, invoice) == "succeeded"


def test_a_dry_run_names_a_charge_in_flight_without_reading_or_recording_how_it_ended(world):
    subscribed(world, plan=NSFW)
    month_passes(world)
    world.sandbox.async_charges("PENDING")
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    pending = rows(world)[-1]
    world.sandbox.finish_payment(pending["payment_id"], settle=False, drop_webhook=True)  # declined, unreported
    before = len(rows(world))
    assert run_renewals(world.c, dry_run=True)["outcomes"] == {"in_flight": 1}
    assert len(rows(world)) == before
    assert run_renewals(world.c)["outcomes"] == {"declined": 1}
