"""A refund reaches its final state at the processor later, SETTLED or FAILED, and its PAYMENT.REFUND
notification says which (Primer's "Payment Refund" webhook: the latest REFUND transaction's
processorStatus). Decision 174: credits follow only a settled refund; a refused one is named by one chat
alert and goes back to a person, and asking again is a new refund, not a replay of the refused one."""

import pytest
from sqlalchemy import select

from billingctl.adapters.db.tables import alert_outbox
from billingctl.services import orphans
from billingctl.services.payments import REFUND_FAILED_TEXT, refund_by_operator
from billingctl.services.reconcile import reconcile
from tests.integration.test_orphans import orphan, row
from tests.integration.test_orphans import world as world  # noqa: F401 - the fixture

pytestmark = pytest.mark.integration


def chat(world, payment_id):
    with world.c.uow() as uow:
        return [(key, payload["text"]) for key, payload in uow.execute(
            select(alert_outbox.c.dedupe_key, alert_outbox.c.payload).where(
                alert_outbox.c.sink == "chat", alert_outbox.c.dedupe_key.like(f"refund-failed:{payment_id}:%"))
            .order_by(alert_outbox.c.id))]


def refunds_at_the_orchestrator(world, payment_id):
    payment = world.sandbox.store.get("payment", payment_id)
    return ([(t["amount"], t["processorStatus"]) for t in payment.get("transactions", [])],
            payment["processor"]["amountRefunded"])


def held_metric(world):
    return world.c.metrics.registry.get_sample_value("billing_payments_held_total", {"reason": "refund_failed"})


def the_processor_decides(world):
    """The sandbox's time moves: each pending refund reaches its final state and is notified."""
    world.advance(60)


def test_a_duplicate_refund_the_processor_refuses_goes_back_to_a_person_with_one_alert_each_time(world):
    """Before, the row ended `duplicate_refunded` for good and the refused refund's notification changed
    nothing: the customer stayed charged twice, and nobody was told."""
    world.sandbox.pay(world.checkout("user_d")["order_id"])  # the plan is held
    _, payment = orphan(world, "user_d")  # a second payment of it: a same-plan duplicate
    pid = payment["id"]
    world.sandbox.async_refunds("FAILED")
    assert orphans.run_orphans(world.c)["outcomes"]["duplicate_refunded"] == 1
    assert refunds_at_the_orchestrator(world, pid) == ([(payment["amount"], "PENDING")], 0)
    the_processor_decides(world)
    state = row(world, pid)
    assert (state["status"], state["resolution"]) == ("needs_review", None)
    assert state["last_error"] == "refund failed at the processor (1 refused)"
    assert chat(world, pid) == [(f"refund-failed:{pid}:1", REFUND_FAILED_TEXT.format(payment_id=pid))]
    assert held_metric(world) == 1
    # A person refunds it again: a new refund (the first key would replay the refused one), refused again.
    orphans.resolve(world.c, pid, "refund", "customer charged twice", "ops")
    the_processor_decides(world)
    assert row(world, pid)["status"] == "needs_review"
    assert [key for key, _ in chat(world, pid)] == [f"refund-failed:{pid}:1", f"refund-failed:{pid}:2"]
    world.sandbox.async_refunds(None)  # the processor takes the third
    orphans.resolve(world.c, pid, "refund", "customer charged twice", "ops")
    assert refunds_at_the_orchestrator(world, pid) == (
        [(payment["amount"], "FAILED"), (payment["amount"], "FAILED"), (payment["amount"], "SETTLED")],
        payment["amount"])
    state = row(world, pid)
    assert (state["status"], state["resolution"], state["resolved_by"]) == ("resolved", "refunded", "ops")
    assert len(chat(world, pid)) == 2 and world.purchases(pid) == 0
    world.advance(2 * 3600)
    assert reconcile(world.c, full=True)["violations"] == []


@pytest.mark.parametrize("outcome", ["SETTLED", "FAILED"])
def test_an_operators_refund_takes_the_credits_back_only_when_the_processor_settles_it(world, outcome):
    payment = world.sandbox.pay(world.checkout("user_o")["order_id"])
    pid = payment["id"]
    assert world.credits("user_o") == 2000
    world.sandbox.async_refunds(outcome)
    answer = refund_by_operator(world.c, pid, "customer asked", "ops")
    assert (answer["outcome"], answer["refunded"], answer["credits_reversed"]) == ("refund_pending", 0, 0)
    assert world.credits("user_o") == 2000  # nothing went back yet
    assert refund_by_operator(world.c, pid, "customer asked", "ops")["outcome"] == "refund_pending"
    assert refunds_at_the_orchestrator(world, pid) == ([(payment["amount"], "PENDING")], 0)  # asked once
    the_processor_decides(world)
    if outcome == "SETTLED":
        assert world.credits("user_o") == 0 and chat(world, pid) == []
    else:
        assert world.credits("user_o") == 2000  # the money stayed with us, and so did the credits
        assert chat(world, pid) == [(f"refund-failed:{pid}:1", REFUND_FAILED_TEXT.format(payment_id=pid))]
        world.sandbox.async_refunds(None)
        assert refund_by_operator(world.c, pid, "customer asked", "ops")["outcome"] == "refunded"
        assert world.credits("user_o") == 0
    world.advance(2 * 3600)
    assert reconcile(world.c, full=True)["violations"] == []


def test_a_credited_orphans_purchase_closes_when_its_pending_refund_settles(world):
    """Decision 173 closes the purchase of a row ended refunded once its credits are back; with the refund
    pending, they come back with its notification, which closes it then."""
    from tests.integration.test_orphan_operations import _closed, _credited_orphan

    pid = _credited_orphan(world, "user_k")
    world.sandbox.async_refunds("SETTLED")
    orphans.resolve(world.c, pid, "refund", "fraud confirmed", "ops")
    assert world.credits("user_k") == 2000 and _closed(world, pid) == (None, None)
    the_processor_decides(world)
    assert world.credits("user_k") == 0 and _closed(world, pid) == ("refunded", None)
    world.advance(2 * 3600)
    assert reconcile(world.c, full=True)["violations"] == []


def test_two_refunds_in_flight_that_end_in_either_order_each_count_and_the_refused_one_is_alerted(world):
    """Found by the exploration (2026-11-27): a refund refused while a later one was still pending was
    never alerted: its notification's most recent REFUND transaction (the pending one) was not FAILED, the
    only one Primer's reference says to check."""
    payment = world.sandbox.pay(world.checkout("user_t")["order_id"])
    pid = payment["id"]
    world.sandbox.async_refunds("FAILED")
    world.sandbox.refund(pid, 500)
    world.sandbox.async_refunds("SETTLED")
    world.sandbox.refund(pid, 500)
    the_processor_decides(world)  # the refused one ends first, then the settled one
    assert refunds_at_the_orchestrator(world, pid) == ([(500, "FAILED"), (500, "SETTLED")], 500)
    assert chat(world, pid) == [(f"refund-failed:{pid}:1", REFUND_FAILED_TEXT.format(payment_id=pid))]
    assert world.credits("user_t") == 2000 - 2000 * 500 // payment["amount"]
    assert held_metric(world) == 1


def test_a_duplicate_whose_refund_was_refused_unheard_is_not_recorded_by_the_next_scan(world):
    """Decision 238's scan reads a row ended refunded again when its payment is listed: a refund the
    processor refused since, its notification not yet heard (nothing back, nothing pending), is left to
    the refusal's notification, which hands it to a person; nothing is credited meanwhile. (Held before
    the guard too, by recording, which finds the duplicate's subscription cancelled: the guard keeps the
    scan from asking.)"""
    world.sandbox.pay(world.checkout("user_d")["order_id"])  # the plan is held
    _, payment = orphan(world, "user_d")  # a second payment of it: a same-plan duplicate
    pid = payment["id"]
    world.sandbox.async_refunds("FAILED")
    assert orphans.run_orphans(world.c)["outcomes"]["duplicate_refunded"] == 1
    credits = world.credits("user_d")
    world.sandbox.hold_webhooks()  # the refusal's notification is not heard yet
    the_processor_decides(world)
    assert refunds_at_the_orchestrator(world, pid) == ([(payment["amount"], "FAILED")], 0)
    assert orphans.run_orphans(world.c)["outcomes"] == {"duplicate_refunded": 1}  # listed again, left as it is
    assert world.credits("user_d") == credits and world.purchases(pid) == 0
    assert row(world, pid)["status"] == "duplicate_refunded"
    world.sandbox.release_webhooks()  # the refusal, heard: back to a person
    assert row(world, pid)["status"] == "needs_review"
    assert world.credits("user_d") == credits and world.purchases(pid) == 0
