"""Issue 34: the orchestrator's payment lifecycle, walked through every status and notification Primer
documents: partial settles, authorizations never captured, charges pending for ever, amounts that do
not match their order, disputes to their decision, dunning rows that end whichever path saw the end.
Each test failed before its fix, on SQLite and PostgreSQL."""

from datetime import timedelta

import pytest
from sqlalchemy import select

from billingctl.adapters.db.tables import alert_outbox, dispute, dunning_attempt, orphan_recovery, purchase
from billingctl.services.renewals import list_attempts, run_renewals
from tests.integration.test_renewals import NSFW, PRO, month_passes, subscribed
from tests.integration.test_renewals import world as world  # noqa: F401 - the fixture

pytestmark = pytest.mark.integration


def attempts(world, user="user_a"):
    return [(a["status"], a["decline_code"]) for a in reversed(list_attempts(world.c, user_id=user))]


def renewal_charges(world):
    return [p for p in world.sandbox.store.all("payment")
            if (p.get("paymentMethod") or {}).get("paymentType") == "SUBSCRIPTION"]


def chat_keys(world):
    with world.c.uow() as uow:
        return uow.execute(select(alert_outbox.c.dedupe_key).where(alert_outbox.c.sink == "chat")).scalars().all()


def review_row(world, payment_id):
    with world.c.uow() as uow:
        row = uow.execute(select(orphan_recovery).where(orphan_recovery.c.payment_id == payment_id)).mappings().first()
    return dict(row) if row else None


def purchases_of(world, payment_id):
    with world.c.uow() as uow:
        return uow.execute(select(purchase.c.id).where(purchase.c.transaction_id == payment_id)).all()


def due_invoice(world, co):
    world.sandbox.renew_due()
    return [i for i in world.sandbox.store.all("invoice")
            if i["subscription_id"] == co["subscription_id"] and i["status"] != "paid"][0]


def renewal_answered(world, status):
    """A subscription a month on, its renewal invoice due and the processor answering its renewal charges
    `status` (PENDING, AUTHORIZED, SETTLING or PARTIALLY_SETTLED); returns (the checkout, the invoice)."""
    co = subscribed(world)
    month_passes(world)
    invoice = due_invoice(world, co)
    world.sandbox.async_charges(status)
    return co, invoice


# ---- defect 1: a partial settle is held, never charged again in full ------------------------------------

def test_a_partially_settled_renewal_is_held_for_review_and_never_charged_again(world):
    co, invoice = renewal_answered(world, "PARTIALLY_SETTLED")  # the processor captures half of the amount
    assert run_renewals(world.c)["outcomes"] == {"held": 1}
    [charge] = renewal_charges(world)
    assert charge["status"] == "PARTIALLY_SETTLED"
    for _ in range(3):  # later ticks: the invoice's dunning is held, nothing is charged again
        world.c.clock.advance(2 * 86400)
        world.sandbox.store.advance_clock(2 * 86400)
        assert run_renewals(world.c)["outcomes"] == {"closed": 1}
    assert len(renewal_charges(world)) == 1
    assert attempts(world) == [("held", None)]
    assert purchases_of(world, charge["id"]) == [] and world.credits() == 2000  # the checkout's credits only
    row = review_row(world, charge["id"])
    assert (row["status"], row["last_error"]) == (
        "needs_review", f"partially_settled: captured {invoice['total'] // 2} of {invoice['total']} USD")
    assert chat_keys(world).count(f"payment-mismatch:{charge['id']}") == 1
    assert world.c.metrics.sample("billing_payments_held_total", {"reason": "partially_settled"}) == 1
    assert world.sandbox.invoice(invoice["id"])["status"] != "paid"  # nothing recorded at the provider


def test_a_partially_settled_payment_held_for_review_can_be_refunded(world):
    """Found by the runbook tests (issue 38 item 8): the PaymentsHeldForReview runbook refunds what was
    captured, but the sandbox refused any refund of a PARTIALLY_SETTLED payment, where Primer's Payments API
    refunds what was captured of a partially captured payment. The refund returns the captured part."""
    from billingctl.services.orphans import resolve

    co, invoice = renewal_answered(world, "PARTIALLY_SETTLED")
    assert run_renewals(world.c)["outcomes"] == {"held": 1}
    [charge] = renewal_charges(world)
    resolve(world.c, charge["id"], "refund", "captured in part", "operator")
    payment = world.sandbox.store.get("payment", charge["id"])
    assert payment["processor"]["amountRefunded"] == invoice["total"] // 2 == payment["processor"]["amountCaptured"]
    assert review_row(world, charge["id"])["status"] == "resolved"
    assert world.credits() == 2000  # nothing was credited for it, nothing reversed


# ---- defect 2: an in-flight charge past its age limit is captured, cancelled or escalated ---------------

def test_an_authorization_left_uncaptured_is_captured_after_its_age_limit(world):
    co, invoice = renewal_answered(world, "AUTHORIZED")
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    assert run_renewals(world.c)["outcomes"] == {"in_flight": 1}  # within its limit: wait for the workflow
    world.c.clock.advance(world.c.settings.renewal_authorized_max_minutes * 60 + 1)
    assert run_renewals(world.c)["outcomes"] == {"succeeded": 1}
    [charge] = renewal_charges(world)
    assert world.sandbox.store.get("payment", charge["id"])["status"] == "SETTLED"
    assert world.sandbox.invoice(invoice["id"])["status"] == "paid"
    assert attempts(world) == [("pending", "AUTHORIZED"), ("succeeded", None)]
    assert world.credits() == 4000


def test_a_renewal_authorization_whose_capture_the_processor_refuses_moves_the_schedule_on(world):
    """Decision 261's renewal side: the tick captures its authorization past its limit and the processor
    refuses the capture: the attempt ends declined (the retry schedule moves on), nothing is credited."""
    co, invoice = renewal_answered(world, "AUTHORIZED")
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    [charge] = renewal_charges(world)
    world.sandbox.refuse_capture(charge["id"])
    world.c.clock.advance(world.c.settings.renewal_authorized_max_minutes * 60 + 1)
    assert run_renewals(world.c)["outcomes"] == {"declined": 1}
    assert world.sandbox.store.get("payment", charge["id"])["status"] == "DECLINED"
    assert world.sandbox.invoice(invoice["id"])["status"] == "payment_due"
    assert attempts(world) == [("pending", "AUTHORIZED"), ("declined", "DO_NOT_HONOR")]
    assert world.credits() == 2000


def test_a_charge_pending_past_its_age_limit_is_cancelled_and_the_schedule_moves_on(world):
    subscribed(world)
    month_passes(world)
    world.sandbox.async_charges("PENDING")
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    world.c.clock.advance(world.c.settings.renewal_in_flight_max_hours * 3600 + 1)
    assert run_renewals(world.c)["outcomes"] == {"declined": 1}
    [charge] = renewal_charges(world)
    assert world.sandbox.store.get("payment", charge["id"])["status"] == "CANCELLED"
    assert attempts(world) == [("pending", "PENDING"), ("declined", "CANCELLED")]


def test_a_charge_pending_past_its_age_limit_is_cancelled_although_its_subscription_was_cancelled_meanwhile(world):
    """Decision 189: an operator cancels the subscription while its renewal charge is PENDING and the
    charge's webhook never comes. The invoice still owes, so the tick lists it; before, it answered
    `not_a_renewal` before reading the charge in flight, and the sweep skips every invoice the tick listed:
    the charge stayed in flight for ever, free to settle a month later. A charge in flight is read first,
    whatever became of its subscription."""
    from billingctl.services.sync import cancel_subscription

    co = subscribed(world)
    month_passes(world)
    world.sandbox.async_charges("PENDING")
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    cancel_subscription(world.c, co["subscription_id"], "customer asked", "ops")
    world.c.clock.advance(world.c.settings.renewal_in_flight_max_hours * 3600 + 1)
    run_renewals(world.c)
    [charge] = renewal_charges(world)
    assert world.sandbox.store.get("payment", charge["id"])["status"] == "CANCELLED"
    assert attempts(world)[0] == ("pending", "PENDING") and attempts(world)[-1][0] != "pending"
    assert len(renewal_charges(world)) == 1  # and never a new charge for a cancelled subscription


@pytest.mark.parametrize("end", ["age limit", "processor declines"])
def test_a_charge_in_flight_that_ends_unpaid_after_a_cheque_paid_its_invoice_ends_the_dunning_paid(world, end):
    """Decision 193, found by the exploration: a renewal charge was PENDING when finance entered the
    customer's cheque on its invoice. Recording the cheque left the dunning to the charge in flight ("its
    own end will come"), and that end was a decline: the attempts ended on `declined`, the invoice paid,
    and reconcile named `dunning_unfinished` every day. An attempt that ends unpaid on an invoice a standing
    purchase pays now ends the dunning `succeeded`, by that purchase."""
    from billingctl.services.events import poll
    from billingctl.services.reconcile import reconcile
    from tests.conftest import advance_with_sandbox

    co, invoice = renewal_answered(world, "PENDING")
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    world.sandbox.record_payment(invoice["id"], invoice["amount_due"], "cheque 0078", payment_method="check")
    poll(world.c)
    [charge] = renewal_charges(world)
    if end == "age limit":
        advance_with_sandbox(world.c, int(world.c.settings.renewal_in_flight_max_hours * 3600) + 1)
        run_renewals(world.c)
    else:
        world.sandbox.finish_payment(charge["id"], settle=False)
        advance_with_sandbox(world.c, 61)
        run_renewals(world.c)  # its sweep reads how the charge ended
    assert world.sandbox.store.get("payment", charge["id"])["status"] in ("CANCELLED", "DECLINED")
    assert attempts(world)[-1][0] == "succeeded" and attempts(world)[-2][0] == "declined"
    assert world.credits() == 2000 + 2000  # the checkout's term and the cheque's, once
    advance_with_sandbox(world.c, 3600)
    assert reconcile(world.c)["violations"] == []
    assert len(renewal_charges(world)) == 1  # and never charged again


@pytest.mark.parametrize("hangs", ["PENDING", "AUTHORIZED"])
@pytest.mark.parametrize("settled_by", ["cheque", "void", "delete"])
def test_a_charge_in_flight_for_an_invoice_nobody_owes_any_more_is_cancelled_at_once(world, hangs, settled_by):
    """Decision 197, found by the exploration: a renewal charge hung in flight and finance entered the
    customer's cheque for the whole invoice (or voided it). The charge was left to its age limit (a day when
    PENDING), free to settle meanwhile and charge the term twice, and reconcile named `dunning_unfinished`
    (the invoice paid, the attempts ending on pending) until then. Nobody owes the invoice any more: the
    next tick voids the charge at once; the dunning ends paid by the cheque. A void at the console reaches
    us as the provider's `invoice_updated` (decision 200; before it the sandbox sent none, and the charge
    waited for its age limit), a deletion as `invoice_deleted` (decision 201)."""
    from billingctl.services.events import poll
    from billingctl.services.reconcile import reconcile
    from tests.conftest import advance_with_sandbox

    co, invoice = renewal_answered(world, hangs)
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    if settled_by == "cheque":
        world.sandbox.record_payment(invoice["id"], invoice["amount_due"], "cheque 0080", payment_method="check")
    elif settled_by == "void":  # at the provider's console: our copy learns it from its invoice_updated (decision 200)
        world.sandbox.void_invoice(invoice["id"])
    else:  # deleted at the console: its invoice_deleted (decision 201)
        world.sandbox.delete_invoice(invoice["id"])
    poll(world.c)
    advance_with_sandbox(world.c, 61)  # well within the charge's age limit
    run_renewals(world.c)
    [charge] = renewal_charges(world)
    assert world.sandbox.store.get("payment", charge["id"])["status"] == "CANCELLED"
    assert attempts(world)[1] == ("declined", "CANCELLED")
    assert attempts(world)[2:] == ([("succeeded", None)] if settled_by == "cheque" else [])
    assert world.credits() == 2000 + (2000 if settled_by == "cheque" else 0)  # the cheque's term, once
    advance_with_sandbox(world.c, 3600)
    assert reconcile(world.c)["violations"] == []
    assert len(renewal_charges(world)) == 1  # and never charged again


def test_a_charge_pending_past_its_age_limit_is_cancelled_although_a_cheque_paid_part_of_its_invoice(world):
    """Decision 194, found by the exploration: a renewal charge hung PENDING and finance entered a cheque for
    a quarter of its invoice at the provider. The invoice still owes, so the tick lists it, and answered
    `already_paid` (a purchase stands on the invoice: the cheque's, for the books) before reading the
    charge in flight; the sweep skips every invoice the tick listed, so the charge stayed in flight for
    ever, free to settle weeks later. A charge in flight is read before anything else about its invoice."""
    from billingctl.services.events import poll
    from tests.conftest import advance_with_sandbox

    co, invoice = renewal_answered(world, "PENDING")
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    world.sandbox.record_payment(invoice["id"], invoice["amount_due"] // 4, "cheque 0079", payment_method="check")
    poll(world.c)
    advance_with_sandbox(world.c, int(world.c.settings.renewal_in_flight_max_hours * 3600) + 1)
    run_renewals(world.c)
    [charge] = renewal_charges(world)
    assert world.sandbox.store.get("payment", charge["id"])["status"] == "CANCELLED"
    assert attempts(world)[:2] == [("pending", "PENDING"), ("declined", "CANCELLED")]


def test_a_charge_still_settling_past_its_age_limit_is_escalated_once_a_day(world):
    subscribed(world)
    month_passes(world)
    world.sandbox.async_charges("SETTLING")
    run_renewals(world.c)
    world.c.clock.advance(world.c.settings.renewal_in_flight_max_hours * 3600 + 1)
    assert run_renewals(world.c)["outcomes"] == {"in_flight": 1}
    assert run_renewals(world.c)["outcomes"] == {"in_flight": 1}
    [charge] = renewal_charges(world)
    assert [k for k in chat_keys(world) if k.startswith(f"renewal-stuck:{charge['id']}")] != []
    assert len([k for k in chat_keys(world) if k.startswith("renewal-stuck:")]) == 1
    assert world.c.metrics.sample("billing_renewal_charges_stuck_total") == 2
    assert len(renewal_charges(world)) == 1  # never a second charge


# ---- defect 3: renewals say they are merchant-initiated; the sandbox invents nothing ---------------------

def test_a_renewal_is_sent_as_a_subscription_payment_and_the_sandbox_keeps_only_what_was_sent(world):
    subscribed(world)
    checkout_payment = world.sandbox.store.all("payment")[0]
    assert checkout_payment["paymentMethod"]["paymentType"] == "FIRST_PAYMENT"  # our client session said so
    month_passes(world)
    run_renewals(world.c)
    assert [p["paymentMethod"]["paymentType"] for p in renewal_charges(world)] == ["SUBSCRIPTION"]
    token = world.sandbox.instruments("user_a")[0]["token"]
    bare = world.sandbox.charge({"paymentMethodToken": token, "amount": 100, "currencyCode": "USD",
                                 "orderId": "o_1", "customerId": "user_a", "metadata": {"psp": "SFW_STRIPE"}},
                                drop_webhook=True)
    assert bare["paymentMethod"]["paymentType"] is None


# ---- defect 4: a payment that does not match its order is held, not credited -----------------------------

@pytest.mark.parametrize(("field", "value", "reason"), [("amount", 100, "amount_mismatch"),
                                                         ("currencyCode", "EUR", "currency_mismatch")])
def test_a_checkout_payment_that_does_not_match_its_session_is_held_with_one_alert(world, field, value, reason):
    co = world.checkout("user_m", PRO)
    session = world.sandbox.store.get("client_session", co["order_id"])
    world.sandbox.store.put("client_session", co["order_id"], {**session, field: value})
    payment = world.sandbox.pay(co["order_id"])  # the webhook arrives, then the duplicate
    world.sandbox.send_webhook("PAYMENT.STATUS", payment)
    assert purchases_of(world, payment["id"]) == [] and world.credits("user_m") == 0
    assert review_row(world, payment["id"])["last_error"].startswith(reason)
    assert chat_keys(world).count(f"payment-mismatch:{payment['id']}") == 1
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "future"  # not activated


# ---- defect 6: the dunning row ends whichever path saw the charge end ------------------------------------

def test_a_renewal_settled_by_webhook_ends_its_pending_attempt(world):
    subscribed(world, plan=NSFW)
    month_passes(world)
    world.sandbox.async_charges("PENDING")
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    [charge] = renewal_charges(world)
    world.sandbox.finish_payment(charge["id"], settle=True)  # PAYMENT.STATUS SETTLED: recorded by the webhook
    assert attempts(world) == [("pending", "PENDING"), ("succeeded", None)]
    with world.c.uow() as uow:
        rows = uow.execute(select(dunning_attempt).order_by(dunning_attempt.c.id)).mappings().all()
    assert rows[0]["resolved_at"] is not None and rows[1]["payment_id"] == charge["id"]
    assert (rows[1]["attempt_no"], rows[1]["lane"], rows[1]["amount"]) == (1, "nsfw", charge["amount"])
    assert run_renewals(world.c)["outcomes"] == {}  # nothing due, nothing in flight


def test_a_renewal_whose_answer_is_lost_after_its_notification_ended_the_dunning_changes_nothing(world):
    """Found by the exploration (2026-11-29, production's container, once a renewal's answer could be lost):
    a retry of a renewal whose first attempt ended `error` was charged, its PAYMENT.STATUS SETTLED arrived
    and ended the invoice's dunning `succeeded` while the charge's own answer was lost (a 500 after the
    effect). The tick then wrote `error` over `succeeded`: outside the DUNNING table, counted and alerted
    ("manual review required") for a renewal that was paid. An answer lost after another path saw the
    dunning end is no news: nothing is written, and the tick reports the end it finds."""
    from tests.conftest import advance_with_sandbox

    subscribed(world)
    month_passes(world)
    world.sandbox.store.add_fault("orchestrator", "503", count=-1)
    assert run_renewals(world.c)["outcomes"] == {"error": 1}
    world.sandbox.store.clear_faults()
    advance_with_sandbox(world.c, 11 * 60)  # the first retry of an unanswered charge: ten minutes later
    world.sandbox.store.add_fault("orchestrator", "error_after_effect", method="POST", path="/payments")
    assert run_renewals(world.c)["outcomes"] == {"succeeded": 1}
    assert [status for status, _ in attempts(world)] == ["error", "succeeded"]
    assert world.c.metrics.sample("billing_lifecycle_illegal_transitions_total", {"lifecycle": "dunning"}) in (None, 0)
    assert not [key for key in chat_keys(world) if key.startswith("illegal:")]
    assert len(renewal_charges(world)) == 1
    advance_with_sandbox(world.c, 3600)
    assert run_renewals(world.c)["outcomes"] == {}  # paid: nothing is charged again


@pytest.mark.parametrize("first", ["declines", "is unreachable"])
def test_a_renewal_answered_in_flight_after_its_notification_ended_the_dunning_changes_nothing(world, first):
    """Left open by the session of 2026-11-29 (decision 232, decision 231's sibling): a retry of a renewal
    (its first attempt declined, or unanswered) is answered PENDING, but the processor settles it at once
    and Primer's PAYMENT.STATUS SETTLED ("delivery typically happens within seconds") reaches the web app,
    records the payment and ends the dunning `succeeded` before the tick writes that answer. The tick then
    asked for `succeeded -> pending`: counted and alerted as illegal for a renewal that was paid. An answer
    in flight about the very payment whose end was seen is no news: nothing is written, and the tick
    reports the end it finds."""
    from tests.conftest import advance_with_sandbox

    subscribed(world)
    month_passes(world)
    if first == "declines":
        world.sandbox.decline_customer("user_a")
    else:
        world.sandbox.store.add_fault("orchestrator", "503", count=-1)
    assert run_renewals(world.c)["outcomes"] == {"declined" if first == "declines" else "error": 1}
    world.sandbox.store.clear_faults()
    world.sandbox.decline_customer("user_a", False)
    advance_with_sandbox(world.c, 3600 + 60)  # the first retry: an hour after a decline, ten minutes after an error
    world.sandbox.async_charges("PENDING", settles_in_transit=True)
    assert run_renewals(world.c)["outcomes"] == {"succeeded": 1}
    [charge] = [c for c in renewal_charges(world) if c["status"] == "SETTLED"]
    assert [status for status, _ in attempts(world)][-1] == "succeeded"
    assert "pending" not in [status for status, _ in attempts(world)]
    assert world.c.metrics.sample("billing_lifecycle_illegal_transitions_total", {"lifecycle": "dunning"}) in (None, 0)
    assert not [key for key in chat_keys(world) if key.startswith("illegal:")]
    assert len(purchases_of(world, charge["id"])) == 1
    world.sandbox.async_charges(None)
    advance_with_sandbox(world.c, 3600)
    assert run_renewals(world.c)["outcomes"] == {}  # paid: nothing is charged again, nothing in flight


def test_a_charge_in_flight_on_an_invoice_another_payment_ended_is_still_illegal(world):
    """Decision 232's other half: an answer in flight is no news only about the payment that ended the
    dunning. A charge in flight on a renewal another payment paid is a second charge of a paid period: the
    step `succeeded -> pending` is counted and alerted, and nothing is written."""
    from billingctl.services.payments import dunning_step

    subscribed(world)
    month_passes(world)
    assert run_renewals(world.c)["outcomes"] == {"succeeded": 1}
    [charge] = renewal_charges(world)
    with world.c.uow() as uow:
        [row] = uow.execute(select(dunning_attempt)).mappings().all()
        invoice = {"id": row["invoice_id"], "subscription_id": row["subscription_id"], "customer_id": "user_a"}
        assert not dunning_step(world.c, uow, invoice, "pending", payment_id=charge["id"], attempt_no=2)
        assert not dunning_step(world.c, uow, invoice, "pending", payment_id="pay_another", attempt_no=2)
        uow.commit()
    assert attempts(world) == [("succeeded", None)]
    assert world.c.metrics.sample("billing_lifecycle_illegal_transitions_total", {"lifecycle": "dunning"}) == 1
    assert [key for key in chat_keys(world) if key.startswith("illegal:")] != []


@pytest.mark.parametrize("in_flight", ["PENDING", "AUTHORIZED", "SETTLING"])
def test_a_renewal_reported_in_flight_then_settled_takes_each_step_once(world, in_flight):
    """Primer sends PAYMENT.STATUS "when a payment's status has been updated ... PENDING, then AUTHORIZED,
    then SETTLED"; the sandbox reported a renewal charge only once it settled or declined, so the step from
    an in-flight row to its end ran nowhere. Now: the in-flight report opens the row, the settle moves it to
    `captured` (a step of the PAYMENT table), one purchase, one credit, one fraud count (NSFW)."""
    from billingctl.adapters.db.tables import fraud_event, transaction

    subscribed(world, plan=NSFW)
    month_passes(world)
    world.sandbox.async_charges(in_flight)
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    [charge] = renewal_charges(world)
    with world.c.uow() as uow:
        status = uow.execute(select(transaction.c.status).where(transaction.c.transaction_id == charge["id"]))
        assert status.scalar_one() == {"PENDING": "pending", "AUTHORIZED": "authorized",
                                       "SETTLING": "settling"}[in_flight]
    world.sandbox.finish_payment(charge["id"], settle=True)
    assert attempts(world) == [("pending", in_flight), ("succeeded", None)]
    with world.c.uow() as uow:
        assert uow.execute(select(transaction.c.status).where(
            transaction.c.transaction_id == charge["id"])).scalar_one() == "captured"
        counted = uow.execute(select(fraud_event.c.dedupe_key).where(
            fraud_event.c.dedupe_key == f"payment:{charge['id']}")).all()
    assert len(purchases_of(world, charge["id"])) == 1 and len(counted) == 1
    assert world.credits() == 2 * world.sandbox.item_price(NSFW)["metadata"]["credits"]


def test_a_renewal_charge_that_moves_through_each_status_in_flight_then_fails_is_counted_once(world):
    """A processor moves a charge on (PENDING, then AUTHORIZED, then SETTLING; each a PAYMENT.STATUS) and
    may end it FAILED, a processor error rather than the issuer's decision. The sandbox could only end a
    charge, never move it on, and the month's processor ended none FAILED: the exploration applied no
    PAYMENT step between two statuses in flight. The row follows every step; the attempt stays pending
    until the tick reads the end, which counts once as a decline, and a later tick charges again."""
    from billingctl.adapters.db.tables import transaction
    from billingctl.sandbox.model import SandboxError

    subscribed(world, plan=NSFW)
    month_passes(world)
    world.sandbox.async_charges("PENDING")
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    world.sandbox.async_charges(None)
    [charge] = renewal_charges(world)

    def status():
        with world.c.uow() as uow:
            return uow.execute(select(transaction.c.status).where(
                transaction.c.transaction_id == charge["id"])).scalar_one()

    for step, ours in (("AUTHORIZED", "authorized"), ("SETTLING", "settling")):
        world.sandbox.progress_payment(charge["id"], step)
        assert status() == ours and attempts(world) == [("pending", "PENDING")]
    with pytest.raises(SandboxError):  # never back to an earlier status
        world.sandbox.progress_payment(charge["id"], "AUTHORIZED")
    world.sandbox.finish_payment(charge["id"], settle=False, failed=True)
    assert status() == "failed" and attempts(world) == [("pending", "PENDING")]
    assert run_renewals(world.c)["outcomes"] == {"declined": 1}  # the tick reads the end: a counted failure
    assert attempts(world) == [("pending", "PENDING"), ("declined", "PROCESSOR_ERROR")]
    assert purchases_of(world, charge["id"]) == []
    world.c.clock.advance(3 * 86400)
    world.sandbox.store.advance_clock(3 * 86400)
    assert run_renewals(world.c)["outcomes"] == {"succeeded": 1}
    assert [a[0] for a in attempts(world)] == ["pending", "declined", "succeeded"]
    assert len(renewal_charges(world)) == 2


@pytest.mark.parametrize("user", ["user_a", "user_n"])
def test_a_checkout_the_workflow_authorizes_then_captures_is_reported_at_each_step_and_recorded_once(world, user):
    """Primer reports each status a payment takes ("PENDING, then AUTHORIZED, then SETTLED, depending on how
    your workflow is set up"); a checkout's workflow authorizes, then captures. The sandbox reported a
    checkout only once settled, so no history met a checkout's AUTHORIZED report before its capture. Now:
    the authorization opens the row and counts as the NSFW lane's authorization attempt (decision 72) but
    grants nothing (no purchase, no credit, no lock); the capture records it once and counts nothing
    more; a second AUTHORIZED copy after it changes nothing."""
    from billingctl.adapters.db.tables import fraud_event, transaction, user_credits

    plan = NSFW if user == "user_n" else PRO
    counted = 1 if user == "user_n" else 0
    co = world.checkout(user, plan)
    world.sandbox.hold_webhooks()
    payment = world.sandbox.pay(co["order_id"])
    held = world.sandbox.store.meta("held_webhooks", [])
    assert [h["payment"]["status"] for h in held] == ["AUTHORIZED", "SETTLED"]
    assert held[0]["payment"]["processor"]["amountCaptured"] == 0
    world.sandbox.store.set_meta("held_webhooks", held[1:])
    world.sandbox.store.set_meta("hold_webhooks", False)
    assert world.sandbox.send_webhook("PAYMENT.STATUS", held[0]["payment"]) == 200

    def rows():
        with world.c.uow() as uow:
            return (uow.execute(select(transaction.c.status, transaction.c.invoice_id, transaction.c.subscription_id)
                                .where(transaction.c.transaction_id == payment["id"])).all(),
                    len(uow.execute(select(fraud_event.c.id).where(
                        fraud_event.c.dedupe_key == f"payment:{payment['id']}")).all()),
                    uow.execute(select(user_credits.c.sfw_processor, user_credits.c.nsfw_processor).where(
                        user_credits.c.user_id == user)).first())
    # a checkout's order id is its subscription id, never an invoice's (decision 209)
    assert rows()[:2] == ([("authorized", None, co["subscription_id"])], counted) and not any(rows()[2] or ())
    assert world.purchases(payment["id"]) == 0 and world.credits(user) == 0
    assert world.sandbox.release_webhooks("in_order") == [200]
    assert world.sandbox.send_webhook("PAYMENT.STATUS", held[0]["payment"]) == 200  # a late copy
    [first] = [i["id"] for i in world.sandbox.store.all("invoice") if i["subscription_id"] == co["subscription_id"]]
    assert rows()[:2] == ([("captured", first, co["subscription_id"])], counted)  # activation named its invoice
    assert payment["processor"]["name"] in rows()[2]
    assert world.purchases(payment["id"]) == 1
    assert world.credits(user) == world.sandbox.item_price(plan)["metadata"]["credits"]


@pytest.mark.parametrize("meanwhile", ["nothing", "frozen", "cancelled"])
def test_a_checkout_authorization_the_workflow_never_captured_is_captured_past_its_limit_or_voided(world, meanwhile):
    """Decision 211: a checkout's workflow authorized the payment and its capture step failed. Nothing
    finished it: the renewal tick captures or voids only renewal charges, and the checkout clean-up, a day
    later, cancelled the subscription and left the customer's money held by the authorization (reconcile
    named `charge_in_flight_too_long` every day). The clean-up now captures it once past the authorization
    limit (the customer bought the plan; it is then recorded once), or voids it when the checkout is no
    longer owed (the customer frozen, the subscription cancelled): nothing held, nothing charged."""
    from billingctl.services.checkout import cleanup_expired
    from billingctl.services.sync import cancel_subscription
    from billingctl.services.users import freeze

    co = world.checkout()
    payment = world.sandbox.pay(co["order_id"], capture=False)  # the workflow's capture step failed
    assert world.sandbox.store.get("payment", payment["id"])["status"] == "AUTHORIZED"
    if meanwhile == "frozen":
        freeze(world.c, "user_a", "fraud review", "ops")
    elif meanwhile == "cancelled":
        cancel_subscription(world.c, co["subscription_id"], "the customer asked", "ops")
    cleanup_expired(world.c)  # within the limit: the workflow may still capture it
    assert world.sandbox.store.get("payment", payment["id"])["status"] == "AUTHORIZED"
    world.advance(61 * 60)
    done = cleanup_expired(world.c)
    at_orchestrator = world.sandbox.store.get("payment", payment["id"])
    if meanwhile == "nothing":
        assert at_orchestrator["status"] == "SETTLED" and done["captured"] == [payment["id"]]
        assert world.purchases(payment["id"]) == 1 and world.credits() == 2000
        assert world.sandbox.subscription(co["subscription_id"])["status"] == "active"
    else:
        assert at_orchestrator["status"] == "CANCELLED" and done["voided"] == [payment["id"]]
        assert world.purchases(payment["id"]) == 0 and world.credits() == 0
    again = cleanup_expired(world.c)
    assert again["captured"] == again["voided"] == []
    assert [p["status"] for p in world.sandbox.store.all("payment")] == [at_orchestrator["status"]]


@pytest.mark.parametrize("refusal", ["DECLINED", "FAILED"])
def test_a_checkout_authorization_whose_capture_the_processor_refuses_is_reported_so_not_as_captured(world, refusal):
    """Decision 261: the clean-up captures a checkout authorization past its limit (decision 211), and the
    processor refuses the capture (the issuer no longer honours the authorization, or a processor error):
    Primer answers the payment DECLINED or FAILED, no money moved. The job listed it under `captured` and
    left our transaction row `authorized` until the notification came: an operator read a capture that
    never happened. It is listed under `capture_refused`, the answer is written at once (the notification
    may be lost), nothing is credited, and the next run finds nothing to do."""
    from billingctl.adapters.db.tables import transaction
    from billingctl.services.checkout import cleanup_expired

    co = world.checkout()
    payment = world.sandbox.pay(co["order_id"], capture=False)  # the workflow's capture step failed
    world.sandbox.refuse_capture(payment["id"], refusal)
    world.sandbox.hold_webhooks()  # the capture's PAYMENT.STATUS is not delivered
    world.advance(61 * 60)
    done = cleanup_expired(world.c)
    assert world.sandbox.store.get("payment", payment["id"])["status"] == refusal
    assert done["captured"] == [] and done["capture_refused"] == [payment["id"]] and done["failed"] == []
    with world.c.uow() as uow:
        assert uow.execute(select(transaction.c.status).where(
            transaction.c.transaction_id == payment["id"])).scalar_one() == refusal.lower()
    assert world.purchases(payment["id"]) == 0 and world.credits() == 0
    again = cleanup_expired(world.c)
    assert again["captured"] == again["capture_refused"] == again["voided"] == []


def test_a_checkout_authorization_nobody_finished_for_a_month_is_voided_not_captured(world):
    """Found by the exploration (2026-11-28): the clean-up did not run for a month after a checkout's
    capture step failed. It listed the orchestrator's authorizations of the last 30 days only, so this one
    stayed AUTHORIZED for ever. It now lists every authorization (they are few: finished ones leave the
    status), and one older than a card authorization's life (a week) is voided, not captured: a capture
    that late is a late presentment the issuer may refuse or charge back."""
    from billingctl.services.checkout import cleanup_expired

    co = world.checkout()
    payment = world.sandbox.pay(co["order_id"], capture=False)
    world.advance(31 * 86400)
    done = cleanup_expired(world.c)
    assert world.sandbox.store.get("payment", payment["id"])["status"] == "CANCELLED"
    assert done["voided"] == [payment["id"]] and done["captured"] == []
    assert world.purchases(payment["id"]) == 0 and world.credits() == 0
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "cancelled"  # the day-old checkout


def test_reconcile_names_an_authorization_held_longer_than_its_refund_window(world):
    """The same history seen by reconcile: it listed the in-flight payments of its 35-day refund window, so
    an authorization nobody finished for longer was no longer named (a false clean). It lists every one."""
    from billingctl.services.reconcile import reconcile

    co = world.checkout()
    payment = world.sandbox.pay(co["order_id"], capture=False)
    world.advance(40 * 86400)
    named = [v["payment_id"] for v in reconcile(world.c)["violations"] if v["check"] == "charge_in_flight_too_long"]
    assert named == [payment["id"]]


def test_an_in_flight_row_whose_invoice_left_payment_due_is_swept_to_its_end(world):
    """The webhook recorded the payment before the tick wrote its in-flight row: the invoice is paid, so
    the tick no longer lists it; the sweep reads the charge and ends the row."""
    from billingctl.services.renewals import _record

    co, invoice = renewal_answered(world, "PENDING")
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    [charge] = renewal_charges(world)
    with world.c.uow() as uow:  # the race: the pending row is written after the settle was recorded
        uow.execute(dunning_attempt.delete())
        uow.commit()
    world.sandbox.finish_payment(charge["id"], settle=True)
    _record(world.c, invoice, "pending", attempt_no=1, lane="sfw", processor="SFW_STRIPE", amount=charge["amount"],
            payment_id=charge["id"], decline_code="PENDING")
    assert run_renewals(world.c)["outcomes"] == {"swept_succeeded": 1}
    assert attempts(world) == [("pending", "PENDING"), ("succeeded", None)]
    assert run_renewals(world.c)["outcomes"] == {}


# ---- defect 5: disputes to their decision ---------------------------------------------------------------

def dispute_row(world, dispute_id):
    with world.c.uow() as uow:
        return dict(uow.execute(select(dispute).where(dispute.c.dispute_id == dispute_id)).mappings().first())


def test_an_open_dispute_stops_renewals_and_a_won_one_resumes_them(world):
    co = subscribed(world)
    checkout_payment = world.sandbox.store.all("payment")[0]
    opened = world.sandbox.dispute_status(checkout_payment["id"], "OPEN", kind="RETRIEVAL")["dispute"]
    assert dispute_row(world, opened["processorDisputeId"])["state"] == "open"
    month_passes(world)
    assert run_renewals(world.c)["outcomes"] == {"skipped_disputed": 1}
    assert renewal_charges(world) == []
    world.sandbox.dispute_status(checkout_payment["id"], "CHALLENGED", kind="RETRIEVAL",
                                 dispute_id=opened["processorDisputeId"])
    assert run_renewals(world.c)["outcomes"] == {"skipped_disputed": 1}
    world.sandbox.dispute_status(checkout_payment["id"], "WON", dispute_id=opened["processorDisputeId"])
    row = dispute_row(world, opened["processorDisputeId"])
    assert (row["state"], row["kind"], row["status"]) == ("won", "DISPUTE", "WON") and row["decided_at"]
    assert run_renewals(world.c)["outcomes"] == {"succeeded": 1}
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "active"


def test_a_lost_dispute_reverses_the_payments_credits_once_and_cancels_its_subscription(world):
    co = subscribed(world)
    checkout_payment = world.sandbox.store.all("payment")[0]
    assert world.credits() == 2000
    opened = world.sandbox.dispute_status(checkout_payment["id"], "OPEN")["dispute"]
    lost = world.sandbox.dispute_status(checkout_payment["id"], "LOST", dispute_id=opened["processorDisputeId"])
    assert lost["delivered"] == 200
    assert world.credits() == 0
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "cancelled"
    world.sandbox.dispute_status(checkout_payment["id"], "LOST", dispute_id=opened["processorDisputeId"])
    assert world.credits() == 0  # a repeated decision changes nothing
    # A WON delivered after LOST is older news (a chargeback won, then lost in pre-arbitration): it changes
    # nothing and pages nobody.
    world.sandbox.dispute_status(checkout_payment["id"], "WON", dispute_id=opened["processorDisputeId"])
    assert dispute_row(world, opened["processorDisputeId"])["state"] == "lost" and world.credits() == 0
    assert [k for k in chat_keys(world) if k.startswith("dispute:")] == [
        f"dispute:{opened['processorDisputeId']}", f"dispute:{opened['processorDisputeId']}:lost"]
    from billingctl.services.reconcile import reconcile

    assert reconcile(world.c)["violations"] == []  # a lost dispute's reversal is books that balance
    month_passes(world)
    assert renewal_charges(world) == [] and run_renewals(world.c)["outcomes"].get("succeeded") is None


def test_a_decided_dispute_is_reopened_only_by_a_later_stage_never_by_older_news(world):
    """Decision 214: a won dispute may be taken to pre-arbitration, so the table lets `won` open again; it
    also let older news of the same stage reopen it. Primer's retry of a CHALLENGED notification whose first
    delivery failed arrived after the WON, or an operator replayed the stored OPEN (`events replay`): the
    dispute was open again for good (no notification would come), and every renewal of the customer was
    skipped for ever. A dispute opens again only with a later stage (retrieval, chargeback,
    pre-arbitration); a notification of its stage once decided, or of an earlier stage, changes nothing."""
    from billingctl.adapters.db.tables import event_inbox
    from billingctl.services.webhook_events import replay

    co = subscribed(world)
    paid = world.sandbox.store.all("payment")[0]
    opened = world.sandbox.dispute_status(paid["id"], "OPEN")["dispute"]
    dispute_id = opened["processorDisputeId"]
    reachable = world.sandbox.deliver
    world.sandbox.deliver = lambda path, body, headers: 503  # the CHALLENGED's first delivery fails
    try:
        world.sandbox.dispute_status(paid["id"], "CHALLENGED", dispute_id=dispute_id)
    finally:
        world.sandbox.deliver = reachable
    world.sandbox.dispute_status(paid["id"], "WON", dispute_id=dispute_id)
    assert dispute_row(world, dispute_id)["state"] == "won"
    world.advance(10)  # Primer's retry of the CHALLENGED, after the WON
    assert dispute_row(world, dispute_id)["state"] == "won"
    with world.c.uow() as uow:
        stored = {r["event_id"].split(":")[-1]: r["id"] for r in uow.execute(
            select(event_inbox.c.id, event_inbox.c.event_id).where(event_inbox.c.source == "orchestrator",
                                                                  event_inbox.c.event_type == "DISPUTE.STATUS"))
            .mappings()}
    replay(world.c, stored["OPEN"], "support asked", "on-call")
    row = dispute_row(world, dispute_id)
    assert (row["state"], row["kind"], row["status"]) == ("won", "DISPUTE", "WON")
    month_passes(world)
    assert run_renewals(world.c)["outcomes"] == {"succeeded": 1}
    # The issuer takes it to pre-arbitration: open again; the chargeback's WON replayed then changes nothing.
    world.sandbox.dispute_status(paid["id"], "OPEN", kind="PREARBITRATION", dispute_id=dispute_id)
    assert dispute_row(world, dispute_id)["state"] == "open"
    replay(world.c, stored["WON"], "support asked", "on-call")
    row = dispute_row(world, dispute_id)
    assert (row["state"], row["kind"], row["status"]) == ("open", "PREARBITRATION", "OPEN")
    month_passes(world)
    assert run_renewals(world.c)["outcomes"] == {"skipped_disputed": 1}
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "active"



@pytest.mark.parametrize("first", ["RETRIEVAL ACCEPTED", "DISPUTE WON"])
def test_a_later_stage_decided_before_its_opening_arrives_is_applied_and_its_money_moves(world, first):
    """Found by the exploration once a closed retrieval could become a chargeback: Primer sends a
    notification for each change, but deliveries are retried and arrive in any order. A retrieval accepted
    (closed), then the chargeback's LOST delivered before its OPEN: closed -> lost was outside the table,
    counted and alerted, and nothing moved: the customer had the money back and kept the credits; the late
    OPEN then reopened the dispute for good (every renewal skipped). A later stage's decision is applied
    from a decided state (closed -> lost or won, won -> closed); its late opening is older news."""
    co = subscribed(world)
    paid = world.sandbox.store.all("payment")[0]
    kind, status = first.split()
    opened = world.sandbox.dispute_status(paid["id"], "OPEN", kind=kind)["dispute"]
    dispute_id = opened["processorDisputeId"]
    world.sandbox.dispute_status(paid["id"], status, kind=kind, dispute_id=dispute_id)
    later = "DISPUTE" if kind == "RETRIEVAL" else "PREARBITRATION"
    decision = "LOST" if kind == "RETRIEVAL" else "CANCELLED"
    reachable = world.sandbox.deliver
    world.sandbox.deliver = lambda path, body, headers: 503  # the later stage's OPEN is not delivered yet
    try:
        world.sandbox.dispute_status(paid["id"], "OPEN", kind=later, dispute_id=dispute_id)
    finally:
        world.sandbox.deliver = reachable
    world.sandbox.dispute_status(paid["id"], decision, kind=later, dispute_id=dispute_id)
    row = dispute_row(world, dispute_id)
    expected = "lost" if decision == "LOST" else "closed"
    assert (row["state"], row["kind"], row["status"]) == (expected, later, decision)
    world.advance(10)  # Primer's retry of the OPEN, after the decision: older news
    assert dispute_row(world, dispute_id)["state"] == expected
    assert world.c.metrics.sample("billing_lifecycle_illegal_transitions_total", {"lifecycle": "dispute"}) in (None, 0)
    if expected == "lost":
        assert world.credits() == 0
        assert world.sandbox.subscription(co["subscription_id"])["status"] == "cancelled"
    else:
        assert world.credits() == 2000
        month_passes(world)
        assert run_renewals(world.c)["outcomes"] == {"succeeded": 1}  # the sale stands: renewals go on

def dispute_lost_while_the_database_was_away(world, make_settings):
    """A checkout paid, then a dispute opened and lost on it while every delivery and every retry Primer
    makes meets a database that is away: the two notifications end in the web app's spool."""
    from billingctl.bootstrap import Container
    from billingctl.domain.clock import ManualClock
    from billingctl.sandbox.delivery import WebhookDelivery
    from billingctl.sandbox.model import WEBHOOK_RETRIES
    from tests.servers import free_port

    co = subscribed(world)
    paid = world.sandbox.store.all("payment")[0]
    assert world.credits() == 2000
    down = Container(make_settings(database_url=f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/none",
                                   webhook_spool_dir=world.c.settings.webhook_spool_dir), clock=ManualClock())
    reachable, world.sandbox.deliver = world.sandbox.deliver, WebhookDelivery(down)
    try:  # the database is away: every delivery and every retry meets it
        opened = world.sandbox.dispute_status(paid["id"], "OPEN")["dispute"]
        world.sandbox.dispute_status(paid["id"], "LOST", dispute_id=opened["processorDisputeId"])
        for wait in WEBHOOK_RETRIES:
            world.sandbox.store.advance_clock(wait)
            world.sandbox.redeliver_due()
    finally:
        world.sandbox.deliver.close()
        world.sandbox.deliver = reachable
        down.close()
    assert world.sandbox.store.all("webhook_retry") == []  # Primer is done with them
    assert world.credits() == 2000
    return co, opened


def test_a_dispute_lost_while_the_database_was_away_longer_than_primers_retries_is_still_reversed(
        world, make_settings):
    """Decision 208: Primer retries a webhook five times over about 31 minutes, then drops it, and lists no
    disputes. A dispute decided during a longer database outage was lost for good: the customer had the
    money back through the bank and kept the credits. The web app now keeps each authenticated event it
    cannot store on disk (answered 202), and the next event poll dispatches it."""
    from billingctl.services.events import poll
    from billingctl.services.health import health_report

    co, opened = dispute_lost_while_the_database_was_away(world, make_settings)
    [shown] = [c for c in health_report(world.c)["checks"] if c["name"] == "webhook_spool"]
    assert shown["data"] == {"waiting": 2, "late": 0, "failed": 0} and shown["ok"]
    assert poll(world.c)["spool"] == {"dispatched": 2, "waiting": 0}
    assert dispute_row(world, opened["processorDisputeId"])["state"] == "lost" and world.credits() == 0
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "cancelled"
    assert poll(world.c)["spool"] == {"dispatched": 0, "waiting": 0}
    assert world.credits() == 0


def test_a_host_whose_poll_finds_the_lease_held_still_dispatches_its_own_spooled_webhooks(world, make_settings):
    """Decision 210: the spool is on the disk of the host whose web app took the webhook, and only the
    event poll holding the job's lease drained it: on a deployment of several hosts, the events a host
    spooled waited for that host to win the lease, maybe never. The poll of every host now drains its own
    spool, also when another host holds the lease (it still exits 75: the job ran elsewhere)."""
    from datetime import timedelta

    from billingctl.domain.errors import LeaseHeld
    from billingctl.services import spool
    from jobs.runner import run_once
    from jobs.schedule import BY_NAME

    co, opened = dispute_lost_while_the_database_was_away(world, make_settings)
    now = world.c.clock.now()
    with world.c.uow() as uow:  # the poll runs on another host
        assert uow.leases.create("poll", "elsewhere:1:x", now, now + timedelta(hours=1))
        uow.commit()
    with pytest.raises(LeaseHeld):
        run_once(world.c, BY_NAME["poll"])
    assert world.credits() == 0 and dispute_row(world, opened["processorDisputeId"])["state"] == "lost"
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "cancelled"
    assert spool.overdue(world.c.settings.webhook_spool_dir)["waiting"] == 0
    with pytest.raises(LeaseHeld):  # nothing left: the next run dispatches nothing again
        run_once(world.c, BY_NAME["poll"])
    assert world.credits() == 0


@pytest.mark.parametrize("status", ["LOST", "ACCEPTED"])
def test_a_payment_charged_back_before_it_was_recorded_is_never_credited(world, status):
    """Decision 203, found by the exploration: a checkout's settle notification was lost, then a chargeback
    was lost (or accepted) on the payment before any poller recorded it. The loss found no purchase and
    took back 0 credits; the settled-payments poller then recorded the payment and credited its term, for
    money the chargeback had returned, and reconcile was clean (the provider was down, so the loss had not
    yet cancelled the subscription). A payment charged back before it is recorded credits nothing: orphan
    recovery ends it `charged_back`."""
    from billingctl.services import orphans
    from billingctl.services.reconcile import reconcile
    from tests.conftest import advance_with_sandbox

    co = world.checkout("user_a", PRO)
    payment = world.sandbox.pay(co["order_id"], drop_webhook=True)
    kind = "DISPUTE" if status == "LOST" else "PREARBITRATION"
    world.sandbox.store.add_fault("provider", "503", count=6)  # the loss cannot cancel the subscription yet
    world.sandbox.dispute_status(payment["id"], status, kind=kind)
    world.sandbox.store.clear_faults()
    for _ in range(2):  # the settled-payments poller finds it, then recovery ends it
        advance_with_sandbox(world.c, 600)
        orphans.run_orphans(world.c)
    assert world.credits() == 0 and purchases_of(world, payment["id"]) == []
    row = review_row(world, payment["id"])
    assert (row["status"], row["resolution"]) == ("resolved", "charged_back")
    assert world.sandbox.store.get("payment", payment["id"]).get("refunds") in (None, [])  # nothing refunded
    advance_with_sandbox(world.c, 3600)
    assert reconcile(world.c)["violations"] == []


def test_an_unknown_dispute_or_payment_notification_is_alerted_not_silently_acknowledged(world):
    from billingctl.services.webhook_events import dispatch

    subscribed(world)
    payment = world.sandbox.store.all("payment")[0]
    before = world.c.metrics.sample("billing_lifecycle_illegal_transitions_total", {"lifecycle": "notification"})
    assert dispatch(world.c, "orchestrator", "DISPUTE.SOMETHING", {
        "paymentId": payment["id"], "processorDisputeId": "dp_x"})["outcome"] == "unknown_type"
    assert dispatch(world.c, "orchestrator", "PAYMENT.SOMETHING", {"payment": payment})["outcome"] == "unknown_type"
    assert world.c.metrics.sample("billing_lifecycle_illegal_transitions_total",
                                  {"lifecycle": "notification"}) == before + 2
    assert {"illegal:notification:dp_x:None:DISPUTE.SOMETHING",
            f"illegal:notification:{payment['id']}:None:PAYMENT.SOMETHING"} <= set(chat_keys(world))


def test_a_dispute_status_outside_primers_list_is_refused_and_alerted(world):
    subscribed(world)
    payment = world.sandbox.store.all("payment")[0]
    sent = world.sandbox.dispute_status(payment["id"], "MAYBE")["dispute"]
    with world.c.uow() as uow:
        assert uow.execute(select(dispute)).first() is None
    assert f"illegal:dispute:{sent['processorDisputeId']}:None:DISPUTE/MAYBE" in chat_keys(world)


def test_every_dispute_notification_of_one_dispute_is_its_own_inbox_event(world):
    from billingctl.adapters.db.tables import event_inbox

    subscribed(world)
    payment = world.sandbox.store.all("payment")[0]
    first = world.sandbox.dispute_status(payment["id"], "OPEN")["dispute"]
    world.sandbox.dispute_status(payment["id"], "CHALLENGED", dispute_id=first["processorDisputeId"])
    world.sandbox.dispute_status(payment["id"], "WON", dispute_id=first["processorDisputeId"])
    with world.c.uow() as uow:
        ids = uow.execute(select(event_inbox.c.event_id).where(event_inbox.c.source == "orchestrator",
                                                               event_inbox.c.event_type == "DISPUTE.STATUS")).all()
    assert len(ids) == 3
    assert dispute_row(world, first["processorDisputeId"])["state"] == "won"


@pytest.mark.parametrize("meanwhile", ["cancelled", "frozen"])
def test_an_authorization_left_uncaptured_is_cancelled_when_its_term_is_no_longer_owed(world, meanwhile):
    """Decision 190: the workflow left a renewal authorization uncaptured and, meanwhile, an operator
    cancelled the subscription or froze the customer. Capturing it would take money for a term nobody
    will serve (then refunded by hand, or held for review); an authorization is voided at no cost. Past its
    age limit it is cancelled at the orchestrator: nothing captured, nothing recorded, no credits."""
    from billingctl.services import users
    from billingctl.services.sync import cancel_subscription

    co = subscribed(world)
    month_passes(world)
    world.sandbox.async_charges("AUTHORIZED")
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    if meanwhile == "cancelled":
        cancel_subscription(world.c, co["subscription_id"], "customer asked", "ops")
    else:
        users.freeze(world.c, "user_a", "chargeback suspected", "ops")
    world.c.clock.advance(world.c.settings.renewal_authorized_max_minutes * 60 + 1)
    run_renewals(world.c)
    run_renewals(world.c)
    [charge] = renewal_charges(world)
    assert world.sandbox.store.get("payment", charge["id"])["status"] == "CANCELLED"
    assert world.purchases(charge["id"]) == 0 and world.credits() == 2000
    assert attempts(world)[-1][0] != "pending"


def test_an_aged_in_flight_charge_is_never_charged_twice_even_when_capture_fails(world):
    subscribed(world)
    month_passes(world)
    world.sandbox.async_charges("AUTHORIZED")
    run_renewals(world.c)
    world.c.clock.advance(timedelta(hours=2).total_seconds())
    world.sandbox.store.add_fault("orchestrator", "500", method="POST", path="/capture", count=-1)
    assert run_renewals(world.c)["outcomes"] == {"in_flight": 1}
    world.sandbox.store.clear_faults()
    assert run_renewals(world.c)["outcomes"] == {"succeeded": 1}
    assert len(renewal_charges(world)) == 1


# ---- defect 8: a payment listed late behind the cursor is still seen ------------------------------------

def test_a_checkout_payment_settled_after_a_younger_one_moved_the_cursor_is_still_recorded(world):
    """Its webhook lost, the settled-payments poller is its only fallback: it was SETTLING when a younger
    payment moved the cursor past its creation date, and was then listed as SETTLED."""
    from billingctl.services.orphans import run_orphans
    from tests.conftest import advance_with_sandbox

    late_co, young_co = world.checkout("user_late", PRO), world.checkout("user_young", PRO)
    late = world.sandbox.pay(late_co["order_id"], drop_webhook=True, report_to_provider=False)
    world.sandbox.store.put("payment", late["id"], {**late, "status": "SETTLING"})
    advance_with_sandbox(world.c, 30)
    young = world.sandbox.pay(young_co["order_id"], drop_webhook=True)
    advance_with_sandbox(world.c, 20)
    assert run_orphans(world.c)["outcomes"] == {"recorded": 1}  # the younger one; the cursor moves to it
    assert purchases_of(world, young["id"]) != []
    world.sandbox.store.put("payment", late["id"], {**late, "status": "SETTLED"})  # listed late, settled
    advance_with_sandbox(world.c, 30)
    # The younger one is read again at the cursor (whose date is inclusive, as before); the late one is new.
    assert run_orphans(world.c)["outcomes"] == {"recorded": 2}
    assert purchases_of(world, late["id"]) != [] and world.credits("user_late") == 2000


# ---- defect 9: a charge whose answer was lost is read back before any new charge --------------------------

def charge_posts(world):
    return world.sandbox.store.count_requests("orchestrator", "POST", "/payments")


@pytest.mark.parametrize("status", ["PENDING", "SETTLED", "DECLINED"])
def test_a_charge_whose_answer_was_lost_is_read_back_by_its_order_and_never_sent_again(world, status):
    subscribed(world)
    month_passes(world)
    if status == "PENDING":
        world.sandbox.async_charges("PENDING")
    if status == "DECLINED":
        world.sandbox.decline_customer("user_a")
    world.sandbox.hold_webhooks()  # the webhook is late too: only the read-back can tell
    world.sandbox.store.add_fault("orchestrator", "error_after_effect", method="POST", path="/payments", count=5)
    assert run_renewals(world.c)["outcomes"] == {"error": 1}
    assert charge_posts(world) == 1  # sent once: a charge that may still be running is never re-sent at once
    world.sandbox.store.advance_clock(600)
    world.c.clock.advance(600)
    if status == "SETTLED":  # the workflow paid the invoice: no longer due; the sweep reads it back (239)
        assert run_renewals(world.c)["outcomes"] == {"swept_read_back_succeeded": 1}
        world.sandbox.release_webhooks()  # the late webhook is a duplicate
        assert world.credits() == 4000
    else:
        expected = {"PENDING": "pending", "DECLINED": "declined"}[status]
        assert run_renewals(world.c)["outcomes"] == {expected: 1}
    assert charge_posts(world) == 1  # read back by the invoice's order id: no second charge request
    [charge] = renewal_charges(world)
    newest = list_attempts(world.c, user_id="user_a")[0]
    assert newest["payment_id"] == charge["id"]
    assert newest["status"] == {"PENDING": "pending", "SETTLED": "succeeded", "DECLINED": "declined"}[status]


def test_a_charge_waits_for_the_orchestrators_own_limit(world):
    """Primer answers within 90 s (504 after): a charge's timeout is above it, reads keep the short one."""
    http = world.c.orchestrator.http
    seen = []
    original = http.client.request

    def spy(method, path, **kw):
        seen.append((method, path, kw.get("timeout")))
        return original(method, path, **kw)

    http.client.request = spy
    subscribed(world)
    month_passes(world)
    run_renewals(world.c)
    timeouts = {(m, p): t for m, p, t in seen}
    assert timeouts[("POST", "/payments")] == world.c.settings.orchestrator_charge_timeout_seconds == 95
    assert timeouts[("GET", "/payment-instruments")] == world.c.settings.http_timeout_seconds


# ---- health and the live gauge show charges in flight by age --------------------------------------------

def test_health_and_the_scrape_show_a_charge_in_flight_past_its_limit(world):
    from billingctl.services.health import health_report
    from webhooks_app import create_internal_app

    subscribed(world)
    month_passes(world)
    world.sandbox.async_charges("SETTLING")
    run_renewals(world.c)
    [charge] = renewal_charges(world)

    def check():
        return next(c for c in health_report(world.c)["checks"] if c["name"] == "renewals_in_flight")

    assert check()["ok"] and check()["detail"].startswith("1 in flight, oldest 0.0 h")
    world.c.clock.advance(25 * 3600)
    assert not check()["ok"]
    assert check()["detail"] == f"1 in flight, oldest 25.0 h; 1 past the age limit: {charge['id']} (SETTLING)"
    scrape = create_internal_app(container=world.c).test_client().get(
        "/metrics", headers={"Authorization": f"Bearer {world.c.settings.secret('internal_token')}"})
    text = scrape.get_data(as_text=True)
    assert "billing_renewal_charges_in_flight 1.0" in text
    assert "billing_renewal_charge_in_flight_oldest_age_seconds 90000.0" in text


# ---- every (state, event) pair of the payment and dispute tables, on the database -------------------------

def test_every_payment_status_pair_is_taken_or_refused_by_the_conditional_update(world):
    """Each pair: the row starts in the first status; the second is applied only where the table allows
    it, and the row never moves otherwise (stale and illegal alike)."""
    from billingctl.domain import lifecycle as lc
    from billingctl.services.payments import save_transaction

    now = world.c.clock.now()
    statuses = list(lc.ORCHESTRATOR_STATUS)
    for n, (first, second) in enumerate((a, b) for a in statuses for b in statuses):
        payment_id = f"pay_pair_{n}"
        with world.c.uow() as uow:
            assert save_transaction(world.c, uow, payment_id, first, now, amount=100) == "apply"
            step = save_transaction(world.c, uow, payment_id, second, now, amount=100)
            held = uow.transactions.status(payment_id)
            uow.commit()
        source, target = lc.payment_status(first), lc.payment_status(second)
        assert step == lc.PAYMENT.step(source, target).value, (first, second)
        assert held == (target if step == "apply" else source), (first, second)


def test_every_dispute_state_pair_is_taken_or_refused_by_the_conditional_update(world):
    from billingctl.domain import lifecycle as lc

    now = world.c.clock.now()
    for n, (first, second) in enumerate((a, b) for a in lc.DISPUTE.states for b in lc.DISPUTE.states):
        with world.c.uow() as uow:
            assert uow.disputes.open({"dispute_id": f"dp_{n}", "payment_id": "pay_x", "state": first,
                                      "created_at": now, "updated_at": now})
            moved = uow.disputes.move(f"dp_{n}", second, lc.DISPUTE.sources(second), None, now)
            held = uow.disputes.get(f"dp_{n}")["state"]
            uow.commit()
        assert moved == lc.DISPUTE.allowed(first, second), (first, second)
        assert held == (second if moved else first), (first, second)



# ---- decision 226: a payment held as captured in part, captured in full afterwards --------------------------

def test_a_capture_that_was_not_final_leaves_the_rest_capturable_and_a_final_one_does_not(world):
    """Primer's capture: "indicates whether the capture request is the final capture request. After a final
    capture, no subsequent captures are allowed." The sandbox ignored `final`; now a capture in part that
    was not final may be followed by others up to the amount, and one that was final by none."""
    from billingctl.sandbox.model import SandboxError

    payments = []
    for final in (False, True):
        co = world.checkout(f"user_{'f' if final else 'o'}", PRO)
        payment = world.sandbox.pay(co["order_id"], capture=False)
        world.sandbox.capture(payment["id"], 500, final=final)
        payments.append(payment["id"])
    open_, closed = payments
    with pytest.raises(SandboxError) as refused:
        world.sandbox.capture(closed, 100)
    assert (refused.value.status, refused.value.api_error_code) == (400, "invalid_state_for_request")
    with pytest.raises(SandboxError) as refused:
        world.sandbox.capture(open_, 1500)  # more than is left
    assert (refused.value.status, refused.value.api_error_code) == (400, "invalid_request")
    assert world.sandbox.capture(open_, 400, final=False)["processor"]["amountCaptured"] == 900
    assert world.sandbox.capture(open_)["status"] == "SETTLED"  # no amount: what is left
    assert world.sandbox.store.get("payment", open_)["processor"]["amountCaptured"] == 1999
    with pytest.raises(SandboxError):
        world.sandbox.capture(open_, 1)


@pytest.mark.parametrize("kind", ["renewal", "checkout"])
def test_a_payment_held_as_captured_in_part_then_captured_in_full_is_recorded_once_and_its_review_closed(
        world, kind):
    """Found by widening the exploration to Primer's `final` capture: a payment held for review as captured
    in part (decision 102) whose rest was captured afterwards was recorded and credited when its SETTLED
    report came, but its review row stayed open ("held for manual review, nothing credited"), inviting a
    person to refund a payment already credited, and a renewal's dunning stayed `held` on an invoice paid.
    Now the row ends `recovered` by the system, one alert says so, and the dunning ends `succeeded`."""
    from billingctl.adapters.db.tables import transaction

    co = subscribed(world) if kind == "renewal" else world.checkout("user_a", PRO)
    if kind == "renewal":
        month_passes(world)
        total = due_invoice(world, co)["total"]
        world.sandbox.async_charges("AUTHORIZED")
        assert run_renewals(world.c)["outcomes"] == {"pending": 1}
        [charge] = renewal_charges(world)
    else:
        charge = world.sandbox.pay(co["order_id"], capture=False)
        total = charge["amount"]
    credits_before = world.credits()
    world.sandbox.capture(charge["id"], total // 2, final=False)  # the workflow captures a part, not its last
    if kind == "renewal":
        assert run_renewals(world.c)["outcomes"] == {"closed": 1}
    assert review_row(world, charge["id"])["status"] == "needs_review"
    assert purchases_of(world, charge["id"]) == [] and world.credits() == credits_before

    world.sandbox.capture(charge["id"])  # then the rest: SETTLED
    row = review_row(world, charge["id"])
    assert (row["status"], row["resolution"], row["resolved_by"]) == ("recovered", "recorded", "system")
    assert len(purchases_of(world, charge["id"])) == 1
    assert world.credits() == credits_before + world.sandbox.item_price(PRO)["metadata"]["credits"]
    assert chat_keys(world).count(f"payment-captured-in-full:{charge['id']}") == 1
    with world.c.uow() as uow:
        assert uow.execute(select(transaction.c.status).where(
            transaction.c.transaction_id == charge["id"])).scalar_one() == "captured"
    if kind == "renewal":
        assert attempts(world) == [("pending", "AUTHORIZED"), ("held", None), ("succeeded", None)]
        assert run_renewals(world.c)["outcomes"] == {}  # nothing is charged again
    assert world.sandbox.send_webhook("PAYMENT.STATUS", world.sandbox.store.get("payment", charge["id"])) == 200
    assert len(purchases_of(world, charge["id"])) == 1  # a repeated report changes nothing
    assert chat_keys(world).count(f"payment-captured-in-full:{charge['id']}") == 1
    from billingctl.services.reconcile import reconcile
    assert reconcile(world.c)["violations"] == []




def test_a_payment_captured_in_part_is_never_given_a_subscription_by_recovery_or_an_operator(world):
    """Found by the exploration (2026-11-29, after 191 histories): an operator ran `orphans retry` on a
    checkout payment held for review as captured in part. Recovery re-subscribed the customer at the
    provider, then recording held the payment again: a stray subscription, the row back in review with
    "re-subscribed ... but its subscription was not activated", and reconcile's "orphan past its schedule".
    A payment captured in part cannot pay a term: recovery leaves it with the person (no subscription made,
    no attempt counted), and `--create-subscription` is refused, naming the ways out."""
    from billingctl.domain import errors as e
    from billingctl.services import orphans

    co = world.checkout("user_a", PRO)
    charge = world.sandbox.pay(co["order_id"], capture=False)
    world.sandbox.capture(charge["id"], charge["amount"] // 2, final=False)
    subscriptions = len(world.sandbox.store.all("subscription"))
    reason = f"partially_settled: captured {charge['amount'] // 2} of {charge['amount']} USD"
    assert orphans.retry(world.c, charge["id"], "ops")["outcome"] == "needs_review"
    row = review_row(world, charge["id"])
    assert (row["status"], row["attempts"], row["last_error"]) == ("needs_review", 0, reason)
    with pytest.raises(e.Refused) as refused:
        orphans.resolve(world.c, charge["id"], "create-subscription", "customer asked", "ops")
    assert refused.value.message == (
        f"payment {charge['id']} is captured in part ({charge['amount'] // 2} of {charge['amount']}): it cannot pay a "
        f"term; refund what was captured (billingctl orphans resolve {charge['id']} --refund --reason R --yes), or "
        "wait until the rest is captured")
    assert len(world.sandbox.store.all("subscription")) == subscriptions
    assert purchases_of(world, charge["id"]) == [] and world.credits() == 0
    world.sandbox.capture(charge["id"])  # the rest: recorded on its own checkout (decision 226)
    assert review_row(world, charge["id"])["status"] == "recovered" and world.credits() == 2000

@pytest.mark.parametrize("meanwhile", ["cancelled", "frozen"])
def test_a_checkout_captured_in_full_after_it_was_held_goes_where_such_a_payment_goes(world, meanwhile):
    """Decision 226, the paths that do not credit: a checkout's payment held as captured in part, then, after
    the clean-up cancelled its checkout (or an operator froze its customer), captured in full. Recording
    handed it to orphan recovery (or held it for the freeze), but its row stayed in a person's queue for the
    partial capture: recovery never saw it, and its reason was no longer true. Now it goes back to recovery,
    which re-subscribes the customer (or, frozen, it waits for a person for that reason)."""
    from billingctl.services.checkout import cleanup_expired
    from billingctl.services.orphans import run_orphans
    from billingctl.services.users import freeze
    from tests.conftest import advance_with_sandbox

    co = world.checkout("user_a", PRO)
    charge = world.sandbox.pay(co["order_id"], capture=False)
    world.sandbox.capture(charge["id"], charge["amount"] // 2, final=False)
    if meanwhile == "cancelled":
        advance_with_sandbox(world.c, 2 * 86400)
        assert cleanup_expired(world.c)["cancelled"] == [co["subscription_id"]]
    else:
        freeze(world.c, "user_a", "fraud review", "operator")
    world.sandbox.capture(charge["id"])  # the rest
    row = review_row(world, charge["id"])
    if meanwhile == "frozen":
        assert (row["status"], row["last_error"]) == ("needs_review", "user is frozen")
        assert chat_keys(world).count(f"frozen-payment:{charge['id']}") == 1
        assert purchases_of(world, charge["id"]) == [] and world.credits() == 0
        return
    assert row["status"] == "retrying"
    assert chat_keys(world).count(f"payment-captured-in-full:{charge['id']}") == 1
    advance_with_sandbox(world.c, 600)
    assert run_orphans(world.c)["outcomes"] == {"recovered": 1}
    assert review_row(world, charge["id"])["status"] == "recovered"
    assert len(purchases_of(world, charge["id"])) == 1 and world.credits() == 2000


def test_a_checkout_captured_in_full_after_support_cancelled_its_subscription_goes_back_to_recovery(world):
    """Found by the exploration (2026-11-29, after 92 histories): a checkout's payment held as captured in
    part; support cancels its subscription, still future, at the provider's console; the workflow captures
    the rest before our event poll reads the cancel. Recording saw our copy still future and credited the
    payment, decision 226 ended its review row `recovered` (`recorded`), and the activation that followed
    found the subscription cancelled at the provider and handed the payment to orphan recovery, whose row
    existed already, ended: nothing happened. The customer kept the credits with no subscription, the
    payment was on no provider invoice, and `orphans resolve` refused it ("already recovered"). Now the
    hand-over sends that row back to recovery, which re-subscribes the customer with the same credits."""
    from billingctl.services.orphans import run_orphans
    from billingctl.services.reconcile import reconcile
    from tests.conftest import advance_with_sandbox

    co = world.checkout("user_a", PRO)
    charge = world.sandbox.pay(co["order_id"], capture=False)
    world.sandbox.capture(charge["id"], charge["amount"] // 2, final=False)
    world.sandbox.cancel(co["subscription_id"])  # support, at the provider's console; not yet polled
    world.sandbox.capture(charge["id"])  # the rest
    row = review_row(world, charge["id"])
    assert (row["status"], row["resolution"]) == ("retrying", None)
    assert world.credits() == 2000 and len(purchases_of(world, charge["id"])) == 1
    advance_with_sandbox(world.c, 600)
    assert run_orphans(world.c)["outcomes"] == {"recovered": 1}
    row = review_row(world, charge["id"])
    assert (row["status"], row["resolution"]) == ("recovered", "resubscribed")
    assert world.credits() == 2000 and len(purchases_of(world, charge["id"])) == 1
    live = [s for s in world.sandbox.store.all("subscription")
            if s["customer_id"] == "user_a" and s["status"] == "active"]
    assert len(live) == 1
    paid = [i for i in world.sandbox.store.all("invoice")
            if i["subscription_id"] == live[0]["id"] and i["status"] == "paid"]
    assert len(paid) == 1
    assert reconcile(world.c)["violations"] == []


@pytest.mark.parametrize("rest", [None, 500], ids=["the rest", "more in part"])
def test_the_rest_of_a_payment_captured_after_a_person_refunded_its_part_is_not_kept(world, rest):
    """Found by the exploration (2026-12-01, embedded, after 187 histories; decision 237): a checkout's
    payment captured in part by a capture that was not final is held for review; a person refunds what it
    captured (`orphans resolve --refund`); then the workflow captures the rest. The payment was recorded
    as paid in full (2,000 credits, the subscription activated) while 499 of its 1,999 went back, the
    review row still said refunded, and reconcile reported nothing. The person's refund stands: the rest
    is refunded too, nothing is credited, one alert says so. More captured and still in part (decision
    238) kept its notification's key (the status alone), so it was taken as a duplicate and kept too."""
    from billingctl.services import orphans
    from tests.conftest import advance_with_sandbox

    co = world.checkout("user_a", PRO)
    charge = world.sandbox.pay(co["order_id"], capture=False)
    world.sandbox.capture(charge["id"], 499, final=False)
    advance_with_sandbox(world.c, 60)
    orphans.resolve(world.c, charge["id"], "refund", "the customer asked", "oncall")
    world.sandbox.capture(charge["id"], rest, final=rest is None)  # the rest, or more of it and still in part
    advance_with_sandbox(world.c, 600)
    orphans.run_orphans(world.c)
    taken = world.sandbox.store.get("payment", charge["id"])["processor"]
    assert world.credits() == 0 and purchases_of(world, charge["id"]) == []
    assert taken["amountRefunded"] == taken["amountCaptured"] == (1999 if rest is None else 999)
    with world.c.uow() as uow:
        said = [r.payload["text"] for r in uow.execute(select(alert_outbox)) if "captured again" in r.payload["text"]]
    assert len(said) == 1 and charge["id"] in said[0]
    assert (review_row(world, charge["id"])["status"], review_row(world, charge["id"])["resolution"]) == \
        ("resolved", "refunded")


@pytest.mark.parametrize("rest", [None, 500], ids=["the rest", "more in part"])
def test_a_capture_after_a_refund_in_review_whose_notification_is_lost_is_still_refunded_or_named(world, rest):
    """Decision 238: as above, but the capture's notification never arrives. The rest, once all is captured
    (SETTLED), is found by the settled-payment scan, which refunds it as recording does; more still in part
    (PARTIALLY_SETTLED, which that scan does not list) is named by reconcile (`payment_kept_after_refund`)
    until an operator refunds what is left."""
    from billingctl.services import orphans
    from billingctl.services.payments import refund_by_operator
    from billingctl.services.reconcile import reconcile
    from tests.conftest import advance_with_sandbox

    co = world.checkout("user_a", PRO)
    charge = world.sandbox.pay(co["order_id"], capture=False)
    world.sandbox.capture(charge["id"], 499, final=False)
    advance_with_sandbox(world.c, 60)
    orphans.resolve(world.c, charge["id"], "refund", "the customer asked", "oncall")
    world.sandbox.hold_webhooks()  # the capture's notification is lost
    world.sandbox.capture(charge["id"], rest, final=rest is None)
    advance_with_sandbox(world.c, 600)
    orphans.run_orphans(world.c)
    taken = world.sandbox.store.get("payment", charge["id"])["processor"]
    assert world.credits() == 0 and purchases_of(world, charge["id"]) == []
    named = [v for v in reconcile(world.c, full=True)["violations"] if v["check"] == "payment_kept_after_refund"]
    if rest is None:
        assert taken["amountRefunded"] == taken["amountCaptured"] == 1999 and named == []
        return
    assert (taken["amountRefunded"], taken["amountCaptured"]) == (499, 999)
    assert [v["payment_id"] for v in named] == [charge["id"]] and "refunded 499 of 999" in named[0]["detail"]
    refund_by_operator(world.c, charge["id"], "the refund in review stands", "oncall")
    taken = world.sandbox.store.get("payment", charge["id"])["processor"]
    assert taken["amountRefunded"] == 999
    assert [v for v in reconcile(world.c, full=True)["violations"] if v["check"] == "payment_kept_after_refund"] == []
