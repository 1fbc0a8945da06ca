"""Every dunning_attempt row a renewal writes, field by field (spec section 5), on each path: declines up
to exhaustion, errors backing off to their cap, refusals, in-flight charges, a cancel that fails at
exhaustion. Written against the survivors of `make mutation`."""

from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete, select

from billingctl.adapters.db.tables import alert_outbox, dunning_attempt
from billingctl.services.renewals import run_renewals
from tests.helpers import table_away
from tests.integration.test_renewals import NSFW, month_passes, subscribed
from tests.integration.test_renewals import world as world  # noqa: F401 - the fixture

pytestmark = pytest.mark.integration
FIELDS = ("status", "decline_code", "attempt_no", "lane", "processor", "amount", "payment_id")


def rows(world):
    with world.c.uow() as uow:
        return [dict(r) for r in uow.execute(select(dunning_attempt).order_by(dunning_attempt.c.id)).mappings()]


def outbox(world, sink):
    with world.c.uow() as uow:
        return [tuple(r) for r in uow.execute(select(alert_outbox.c.dedupe_key, alert_outbox.c.payload)
                                              .where(alert_outbox.c.sink == sink)).all()]


def renewal_invoice(world, co):
    return [i for i in world.sandbox.store.all("invoice")
            if i["subscription_id"] == co["subscription_id"] and i["status"] != "paid"][0]


def test_declines_are_scheduled_then_exhaust_cancel_and_notify_the_user(world):
    co = subscribed(world)
    world.sandbox.decline_customer("user_a")
    month_passes(world)
    schedule = world.c.settings.renewal_retry_hours
    starts = []
    for hours in schedule:
        starts.append(world.c.clock.now())
        run_renewals(world.c)
        world.c.clock.advance(hours * 3600)
    assert run_renewals(world.c)["outcomes"] == {"exhausted": 1}
    invoice = renewal_invoice(world, co)
    written = rows(world)
    declined = [p["id"] for p in world.sandbox.store.all("payment") if p["status"] == "DECLINED"]
    expected = [("declined", "DO_NOT_HONOR", n + 1, "sfw", "SFW_STRIPE", invoice["total"], declined[n])
                for n in range(len(schedule) + 1)] + [("exhausted", "retry_schedule_exhausted", 0, None, None,
                                                       None, None)]
    assert [tuple(r[f] for f in FIELDS) for r in written] == expected
    assert [r["next_attempt_at"] for r in written] == [
        start + timedelta(hours=h) for start, h in zip(starts, schedule, strict=True)] + [None, None]
    assert {(r["invoice_id"], r["subscription_id"], r["user_id"]) for r in written} == {
        (invoice["id"], co["subscription_id"], "user_a")}
    assert outbox(world, "notify") == [(f"dunning-exhausted:{co['subscription_id']}", {
        "user_id": "user_a", "message": "Your subscription was cancelled because the renewal payment failed. "
                                        "Add a card at checkout to subscribe again."})]
    with world.c.uow() as uow:
        assert uow.subscriptions.status(co["subscription_id"]) == "cancelled"


def test_a_cancel_that_fails_at_exhaustion_is_retried_without_a_second_attempt(world):
    co = subscribed(world)
    world.sandbox.decline_customer("user_a")
    month_passes(world)
    for hours in world.c.settings.renewal_retry_hours:
        run_renewals(world.c)
        world.c.clock.advance(hours * 3600)
    world.sandbox.store.add_fault("provider", "400", path="cancel", count=-1)
    assert run_renewals(world.c)["outcomes"] == {"exhausted_cancel_failed": 1}
    assert rows(world)[-1]["status"] == "declined" and outbox(world, "notify") == []
    world.sandbox.store.clear_faults()
    assert run_renewals(world.c)["outcomes"] == {"exhausted": 1}
    assert [r["status"] for r in rows(world)].count("exhausted") == 1
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "cancelled"


def test_errors_back_off_doubling_to_a_twelve_hour_cap_and_credentials_page_once_in_24_hours(world):
    subscribed(world)
    month_passes(world)
    world.sandbox.store.add_fault("orchestrator", "401", method="POST", path="/payments", count=-1)
    waits, ticks = [], []
    for _ in range(8):
        ticks.append(world.c.clock.now())
        assert run_renewals(world.c)["outcomes"] == {"error": 1}
        last = rows(world)[-1]
        assert (last["status"], last["decline_code"], last["attempt_no"], last["lane"], last["processor"]) == (
            "error", "external_auth_error", 1, "sfw", "SFW_STRIPE")
        assert last["amount"] > 0
        waits.append((last["next_attempt_at"] - world.c.clock.now()).total_seconds() / 60)
        world.c.clock.advance((last["next_attempt_at"] - world.c.clock.now()).total_seconds())
    assert waits == [10, 20, 40, 80, 160, 320, 640, 720]
    assert ticks[-1] - ticks[0] == timedelta(minutes=1270)
    pages = outbox(world, "chat")
    assert [key for key, _ in pages] == [f"renewals-auth:{ticks[0].isoformat()}"]  # 21 hours of ticks: one page
    assert pages[0][1]["text"] == ("Renewals cannot charge: the payment orchestrator refused our credentials "
                                   "(orchestrator: Sorry, authentication failed. Invalid api key)")


def test_a_refused_charge_is_a_failed_attempt_with_the_providers_code(world):
    subscribed(world)
    month_passes(world)
    world.sandbox.store.add_fault("orchestrator", "400", method="POST", path="/payments", count=1)
    assert run_renewals(world.c)["outcomes"] == {"failed": 1}
    last = rows(world)[-1]
    assert (last["status"], last["decline_code"], last["attempt_no"], last["lane"], last["processor"]) == (
        "failed", "RequestValidationError", 1, "sfw", "SFW_STRIPE")
    [sub] = world.sandbox.store.all("subscription")
    assert last["amount"] == renewal_invoice(world, {"subscription_id": sub["id"]})["total"]
    assert last["next_attempt_at"] == world.c.clock.now() + timedelta(hours=world.c.settings.renewal_retry_hours[0])


def test_an_in_flight_charge_is_read_back_until_final_and_recorded_with_its_attempt(world):
    subscribed(world, plan=NSFW)
    month_passes(world)
    world.sandbox.async_charges("PENDING")
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    pending = rows(world)[-1]
    assert (pending["status"], pending["attempt_no"], pending["lane"], pending["decline_code"]) == (
        "pending", 1, "nsfw", "PENDING")
    assert run_renewals(world.c)["outcomes"] == {"in_flight": 1}  # still PENDING at the orchestrator
    world.sandbox.store.add_fault("orchestrator", "500", method="GET", path="/payments/", count=-1)
    assert run_renewals(world.c)["outcomes"] == {"in_flight": 1}  # unreadable: next tick
    world.sandbox.store.clear_faults()
    world.sandbox.finish_payment(pending["payment_id"], settle=False, drop_webhook=True)
    assert run_renewals(world.c)["outcomes"] == {"declined": 1}
    done = rows(world)[-1]
    assert tuple(done[f] for f in FIELDS) == ("declined", "DO_NOT_HONOR", 1, "nsfw", pending["processor"],
                                              pending["amount"], pending["payment_id"])
    assert pending["processor"] == "NSFW_SEGPAY" and pending["amount"] > 0
    assert done["next_attempt_at"] == world.c.clock.now() + timedelta(hours=world.c.settings.renewal_retry_hours[0])


def test_a_settled_renewal_is_recorded_by_the_renewals_job_with_its_attempt_and_counts_once(world):
    """Its webhook held back: the job's own answer records it (path renewal), and the NSFW authorization
    counts once for the user the invoice names."""
    from billingctl.adapters.db.tables import fraud_event, purchase

    co = subscribed(world, plan=NSFW)
    month_passes(world)
    world.sandbox.hold_webhooks()
    assert run_renewals(world.c)["outcomes"] == {"succeeded": 1}
    renewal = [p for p in world.sandbox.store.all("payment") if p["paymentMethod"]["paymentType"] == "SUBSCRIPTION"]
    done = rows(world)[-1]
    assert tuple(done[f] for f in FIELDS) == ("succeeded", None, 1, "nsfw", "NSFW_SEGPAY", renewal[0]["amount"],
                                              renewal[0]["id"])
    with world.c.uow() as uow:
        via = uow.execute(select(purchase.c.recorded_via).where(
            purchase.c.transaction_id == renewal[0]["id"])).scalar()
        keys = uow.execute(select(fraud_event.c.dedupe_key, fraud_event.c.created_at).where(
            fraud_event.c.user_id == "user_a")).all()
    assert via == "renewal"
    assert f"payment:{renewal[0]['id']}" in [k for k, _ in keys] and len(keys) == 2
    assert all(at is not None for _, at in keys)
    world.sandbox.release_webhooks()
    assert world.credits() == 6000 and co["subscription_id"]


def test_a_declined_renewal_without_a_reason_code_is_recorded_with_its_status(world):
    subscribed(world)
    month_passes(world)
    world.sandbox.async_charges("PENDING")
    run_renewals(world.c)
    pending = rows(world)[-1]
    payment = world.sandbox.store.get("payment", pending["payment_id"])
    payment["status"] = "FAILED"  # no statusReason: the status itself is the code
    world.sandbox.store.put("payment", payment["id"], payment)
    assert run_renewals(world.c)["outcomes"] == {"declined": 1}
    assert rows(world)[-1]["decline_code"] == "FAILED"


def test_an_aborted_attempt_and_a_missing_lock_are_recorded_with_the_invoices_facts(world):

    co = subscribed(world, plan=NSFW)
    month_passes(world)
    with table_away(world.c.engine, "user_credits"):
        assert run_renewals(world.c)["outcomes"] == {"aborted": 1}
    invoice = renewal_invoice(world, co)
    assert tuple(rows(world)[-1][f] for f in FIELDS) == ("aborted", "lock_read_failed", 1, "nsfw", None,
                                                         invoice["amount_due"], None)
    with world.c.uow() as uow:  # the lane unlocked (a lock cleared by an operator)
        uow.locks.clear("user_a", "nsfw_processor", "NSFW_SEGPAY", {"nsfw_processor": None})
        uow.subscriptions.set(co["subscription_id"], lane=None)  # the lane then comes from the invoice's plan
        uow.commit()
    assert run_renewals(world.c)["outcomes"] == {"failed": 1}
    last = rows(world)[-1]
    assert tuple(last[f] for f in FIELDS) == ("failed", "no_locked_processor", 1, "nsfw", None,
                                              invoice["amount_due"], None)
    assert last["next_attempt_at"] == world.c.clock.now() + timedelta(hours=world.c.settings.renewal_retry_hours[0])


def test_invoices_that_are_not_renewals_or_already_paid_are_skipped_by_name(world):
    from billingctl.services.renewals import attempt_invoice

    co = subscribed(world)
    with world.c.uow() as uow:
        first = uow.purchases.first_of_subscription(co["subscription_id"])
    assert attempt_invoice(world.c, {"id": first.invoice_id, "subscription_id": co["subscription_id"],
                                     "customer_id": "user_a"}) == "not_a_renewal"  # the checkout's own invoice
    month_passes(world)
    world.sandbox.hold_webhooks()
    assert run_renewals(world.c)["outcomes"] == {"succeeded": 1}
    renewed = rows(world)[-1]["invoice_id"]
    assert attempt_invoice(world.c, {"id": renewed, "subscription_id": co["subscription_id"],
                                     "customer_id": "user_a"}) == "already_paid"


def test_a_renewal_charges_the_amount_due_and_reserves_its_quota_slot_with_the_invoices_facts(world):
    from billingctl.adapters.db.tables import fraud_event

    co = subscribed(world, plan=NSFW)
    month_passes(world)
    world.sandbox.renew_due()
    invoice = renewal_invoice(world, co)
    world.sandbox.store.put("invoice", invoice["id"], {**invoice, "amount_due": invoice["total"] - 100,
                                                       "currency_code": "EUR"})
    world.sandbox.hold_webhooks()
    assert run_renewals(world.c)["outcomes"] == {"succeeded": 1}
    renewal = [p for p in world.sandbox.store.all("payment") if p["paymentMethod"]["paymentType"] == "SUBSCRIPTION"]
    assert renewal[0]["amount"] == invoice["total"] - 100 == rows(world)[-1]["amount"]
    with world.c.uow() as uow:
        [meta] = [m for k, m in uow.execute(select(fraud_event.c.dedupe_key, fraud_event.c.metadata))
                  if k == f"payment:{renewal[0]['id']}"]
    assert (meta["amount"], meta["initiator"], meta["order_id"]) == (invoice["total"] - 100, "merchant", invoice["id"])
    with world.c.uow() as uow:
        mid = uow.locks.read("user_a")["nsfw_processor_mid"]
    assert mid and renewal[0]["metadata"]["processor_merchant_id"] == mid
    assert renewal[0]["currencyCode"] == "EUR"


def test_an_answer_lost_between_ticks_is_replayed_by_the_same_request_not_charged_again(world):
    subscribed(world, plan=NSFW)
    month_passes(world)
    world.sandbox.async_charges("PENDING")  # in flight: the provider's invoice stays unpaid
    world.sandbox.store.add_fault("orchestrator", "error_after_effect", method="POST", path="/payments",
                                  count=world.c.settings.http_max_attempts)
    assert run_renewals(world.c)["outcomes"] == {"error": 1}
    world.c.clock.advance(600)
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    renewals = [p for p in world.sandbox.store.all("payment") if p["paymentMethod"]["paymentType"] == "SUBSCRIPTION"]
    assert len(renewals) == 1 and rows(world)[-1]["payment_id"] == renewals[0]["id"]


def test_the_renewals_tick_documents_its_dry_run_and_its_failures(world, monkeypatch):
    from billingctl.services import renewals

    co = subscribed(world)
    month_passes(world)
    world.sandbox.renew_due()
    invoice = renewal_invoice(world, co)
    dry = run_renewals(world.c, dry_run=True)
    assert dict(dry) == {"dry_run": True, "outcomes": {"would_charge": 1}, "errors": [],
                         "invoices": [{"invoice_id": invoice["id"], "outcome": "would_charge"}]}
    assert (dry.outcome.done, dry.outcome.failed) == (1, 0)
    assert rows(world) == []  # a dry run writes nothing

    def broken(container, invoice, dry_run=False):
        raise RuntimeError("boom")

    monkeypatch.setattr(renewals, "attempt_invoice", broken)
    result = run_renewals(world.c)
    assert dict(result) == {"outcomes": {"error": 1},
                            "errors": [{"invoice_id": invoice["id"], "error": "boom"}]}
    assert (result.outcome.done, result.outcome.failed, result.outcome.errors) == (
        0, 1, ({"invoice_id": invoice["id"], "error": "boom"},))
    dry = run_renewals(world.c, dry_run=True)
    assert (dry["outcomes"], dry["invoices"], dry["errors"]) == (
        {"error": 1}, [], [{"invoice_id": invoice["id"], "error": "boom"}])
    assert (dry.outcome.done, dry.outcome.failed, dry.outcome.errors) == (
        0, 1, ({"invoice_id": invoice["id"], "error": "boom"},))


@pytest.mark.parametrize("answer", ["AUTHORIZED", "PENDING"])
def test_a_charge_whose_answer_was_lost_is_ended_when_its_invoice_leaves_payment_due(world, answer):
    """Found by the exploration (2026-12-02, production, after 228 histories; decision 239): a renewal
    charge is made but its answer is lost (the attempt ends `error`, no payment named), the processor
    leaves it in flight, and finance writes the invoice off at the provider before the next tick. The
    tick lists only invoices in payment_due and its sweep only charges it knew were in flight, so nothing
    read that order back again: the customer's card stayed authorized for a term nobody owed, for ever
    (reconcile named `charge_in_flight_too_long` daily). The sweep now reads back the lost charge of an
    invoice the tick did not list, and ends it the same way as any charge in flight: voided."""
    from billingctl.services import events
    from billingctl.services.reconcile import reconcile
    from tests.conftest import advance_with_sandbox

    subscribed(world)
    month_passes(world)
    world.sandbox.async_charges(answer)  # the processor never goes further
    world.sandbox.store.add_fault("orchestrator", "error_after_effect", method="POST", path="/payments")
    assert run_renewals(world.c)["outcomes"] == {"error": 1}  # a charge is sent once: its one answer lost
    [charge] = [p for p in world.sandbox.store.all("payment") if p["paymentMethod"]["paymentType"] == "SUBSCRIPTION"]
    assert (charge["status"], rows(world)[-1]["status"], rows(world)[-1]["payment_id"]) == (answer, "error", None)
    world.sandbox.write_off(charge["orderId"])
    events.poll(world.c)
    advance_with_sandbox(world.c, 25 * 3600)  # past both age limits
    run_renewals(world.c)
    assert world.sandbox.store.get("payment", charge["id"])["status"] == "CANCELLED"
    assert [(r["status"], r["payment_id"]) for r in rows(world)] == [("error", None), ("pending", charge["id"]),
                                                                           ("declined", charge["id"])]
    assert run_renewals(world.c)["outcomes"] == {}  # nothing left to read back
    advance_with_sandbox(world.c, 2 * 3600)
    assert reconcile(world.c, full=True)["violations"] == []


def test_a_lost_charge_read_back_once_and_found_never_made_is_not_read_again(world):
    """Decision 239: the sweep reads back the order of an `error` attempt whose invoice left payment_due;
    one the orchestrator holds no charge for was never made, and is not read again at every tick."""
    from billingctl.services import events

    subscribed(world)
    month_passes(world)
    world.sandbox.store.add_fault("orchestrator", "503", method="POST", path="/payments",
                                  count=world.c.settings.http_max_attempts)
    assert run_renewals(world.c)["outcomes"] == {"error": 1}
    [invoice] = [i for i in world.sandbox.store.all("invoice") if i["status"] == "payment_due"]
    assert [p for p in world.sandbox.store.all("payment") if p.get("orderId") == invoice["id"]] == []
    world.sandbox.write_off(invoice["id"])
    events.poll(world.c)
    assert run_renewals(world.c)["outcomes"] == {"swept_read_back_nothing_charged": 1}
    assert run_renewals(world.c)["outcomes"] == {}
    assert [(r["status"], r["resolved_at"] is not None) for r in rows(world)] == [("error", True)]


def test_a_lost_charge_is_read_back_after_an_aborted_attempt_even_when_the_invoice_is_not_charged_again(world):
    """Found by the exploration (2026-12-02, embedded, after 156 histories; decision 239): a charge's answer
    is lost (`error`) and the processor leaves it PENDING; the next tick cannot read the processor lock
    (`aborted`), so the tick after that saw an aborted attempt, not a lost one, and read nothing back; then
    support paused the subscription, and each tick answered `not_a_renewal` before any read-back. The
    invoice stayed in payment_due, so the sweep passed it by too: the charge stayed PENDING for ever and
    reconcile reported clean. A lost answer is now read back before anything else about its invoice, at
    the first tick that meets it, whatever rows followed it."""
    from billingctl.services import events, sync
    from billingctl.services.reconcile import reconcile
    from tests.conftest import advance_with_sandbox

    co = subscribed(world)
    month_passes(world)
    world.sandbox.async_charges("PENDING")  # the processor never goes further
    world.sandbox.store.add_fault("orchestrator", "error_after_effect", method="POST", path="/payments")
    assert run_renewals(world.c)["outcomes"] == {"error": 1}
    [charge] = [p for p in world.sandbox.store.all("payment") if p["paymentMethod"]["paymentType"] == "SUBSCRIPTION"]
    advance_with_sandbox(world.c, 3600)
    with table_away(world.c.engine, "user_credits"):  # the lock cannot be read: before, `aborted`
        assert run_renewals(world.c)["outcomes"] == {"pending": 1}  # read back first: the lost charge found
    world.sandbox.pause(co["subscription_id"])  # support, at the provider's console
    events.poll(world.c)
    sync.sync_subscription(world.c, co["subscription_id"])
    for _ in range(3):  # past both age limits
        advance_with_sandbox(world.c, 13 * 3600)
        run_renewals(world.c)
    assert world.sandbox.store.get("payment", charge["id"])["status"] == "CANCELLED"
    assert [(r["status"], r["payment_id"]) for r in rows(world)][-2:] == [("pending", charge["id"]),
                                                                           ("declined", charge["id"])]
    advance_with_sandbox(world.c, 2 * 3600)
    assert reconcile(world.c, full=True)["violations"] == []


STATUSES = ("pending", "succeeded", "held", "exhausted", "error", "declined", "aborted", "quota_blocked")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.tuples(st.sampled_from(STATUSES), st.booleans(), st.booleans()), max_size=6),
                min_size=1, max_size=3))
def test_the_tick_and_the_sweep_find_the_same_lost_answer(world, invoices):
    """Decision 239's rule is written twice: in Python for the tick, over the history it holds
    (`renewals._lost_answer`), and in one statement for the sweep (`uow.dunning.answers_lost`). Over any
    rows (each a status, whether it names a payment, whether it was read back; an `error` row never names
    one: its answer was lost), both name the same row of each invoice, or none."""
    from billingctl.services.renewals import _lost_answer

    now = world.c.clock.now()
    with world.c.uow() as uow:
        uow.execute(delete(dunning_attempt))
        for n, history in enumerate(invoices):
            for i, (status, names_payment, read) in enumerate(history):
                uow.dunning.add(invoice_id=f"inv_{n}", created_at=now + timedelta(seconds=i), status=status,
                                payment_id=f"pay_{n}_{i}" if names_payment and status != "error" else None,
                                resolved_at=now if read else None)
        uow.commit()
    with world.c.uow() as uow:
        by_sweep = {r["invoice_id"]: r["id"] for r in uow.dunning.answers_lost()}
        by_tick = {}
        for n in range(len(invoices)):
            lost = _lost_answer(uow.dunning.history(f"inv_{n}"))
            if lost is not None:
                by_tick[f"inv_{n}"] = lost["id"]
    assert by_sweep == by_tick
