"""Refunds recorded at the provider (decision 212). Finance may give money back outside the orchestrator (a
wire, a cheque) and record it on the invoice at the provider (its record_refund): a refundable credit note
and a refund transaction naming the payment. The spec's event poll "detects refunds": such a refund takes
back its share of the payment's credits, once, like a refund at the orchestrator; one the orchestrator also
made (its workflow mirrors each of its refunds to the provider) is not taken back twice."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from billingctl.adapters.db.tables import event_inbox
from tests.integration.test_renewals import month_passes, subscribed
from tests.integration.test_renewals import world as world  # noqa: F401 - the fixture


def _invoice_paid_by(world, reference: str) -> dict:
    sandbox = world.sandbox
    return next(i for i in sandbox.store.all("invoice") if any(
        sandbox.store.get("transaction", link["txn_id"])["reference_number"] == reference
        for link in i.get("linked_payments") or []))


def _wire_back(world, invoice: dict, amount: int | None, method: str = "bank_transfer") -> dict:
    return world.sandbox.record_refund(invoice["id"], amount, method, world.sandbox.now(), "WIRE-0042")


def _inbox_failures(world) -> list[tuple[str, str]]:
    with world.c.uow() as uow:
        return [(r.event_type, r.status) for r in uow.execute(select(event_inbox.c.event_type, event_inbox.c.status)
                                                              .where(event_inbox.c.last_error.is_not(None)))]


def _checkout_payment(world) -> tuple[dict, dict]:
    co = subscribed(world)
    payment = next(p for p in world.sandbox.store.all("payment") if p["orderId"] == co["order_id"])
    return payment, _invoice_paid_by(world, payment["id"])


def test_a_refund_finance_records_at_the_provider_takes_back_its_share_of_a_card_payments_credits_once(world):
    """The customer was paid back by wire and finance recorded it on the invoice: the orchestrator knows
    nothing of it. Before, the poll read the orchestrator's refunded amount (none) and took nothing back:
    the customer kept the credits of money returned, and reconcile said nothing."""
    from billingctl.services.events import poll
    from billingctl.services.reconcile import reconcile

    payment, invoice = _checkout_payment(world)
    assert (payment["amount"], world.credits()) == (1999, 2000)
    _wire_back(world, invoice, 999)
    poll(world.c)
    assert world.credits() == 2000 - 2000 * 999 // 1999  # its share: 999 of 1999
    poll(world.c)
    assert world.credits() == 1001  # once
    _wire_back(world, invoice, None)  # the rest
    poll(world.c)
    assert world.credits() == 0
    assert world.sandbox.store.get("payment", payment["id"])["processor"].get("amountRefunded", 0) == 0
    assert _inbox_failures(world) == []
    world.advance(3600)
    assert reconcile(world.c)["violations"] == []


def test_a_cheque_entered_and_refunded_at_the_provider_takes_its_credits_back_without_failing(world):
    """A payment entered at the provider is unknown to the orchestrator. Before, its refund's events asked
    the orchestrator for it, failed at every poll and were parked: the credits stood."""
    from billingctl.services.events import poll

    subscribed(world)
    month_passes(world)
    invoice = world.sandbox.renew_due()[0]
    world.sandbox.record_payment(invoice["id"], invoice["total"], "CHEQUE-0009", payment_method="check")
    poll(world.c)
    assert world.credits() == 2000 + 2000
    _wire_back(world, world.sandbox.invoice(invoice["id"]), invoice["total"] // 2, method="check")
    poll(world.c)
    assert world.credits() == 2000 + 2000 - 2000 * (invoice["total"] // 2) // invoice["total"]
    assert _inbox_failures(world) == []


@pytest.mark.parametrize("order", ["orchestrator first", "provider first"])
def test_a_refund_at_the_orchestrator_and_one_recorded_at_the_provider_are_taken_back_together_once(world, order):
    """Part refunded at the orchestrator (its workflow mirrors it to the provider), part paid back by wire:
    the two are taken back once each, whichever is read first; the mirrored part is not taken twice."""
    from billingctl.services.events import poll

    payment, invoice = _checkout_payment(world)
    if order == "orchestrator first":
        world.sandbox.refund(payment["id"], 500)
        poll(world.c)
        assert world.credits() == 2000 - 2000 * 500 // 1999
    _wire_back(world, world.sandbox.invoice(invoice["id"]), 1000)
    if order == "provider first":
        poll(world.c)
        assert world.credits() == 2000 - 2000 * 1000 // 1999
        world.sandbox.refund(payment["id"], 500)
    poll(world.c)
    assert world.credits() == 2000 - 2000 * 1500 // 1999
    poll(world.c)
    assert world.credits() == 2000 - 2000 * 1500 // 1999
    assert _inbox_failures(world) == []


def test_reconcile_names_a_refund_recorded_at_the_provider_whose_credits_stand(world):
    """From the provider's books: a refund it holds whose share of credits nobody took back (its events not
    yet read here) is named `refund_not_reversed` once past the grace; read, it is no longer named."""
    from billingctl.services.events import poll
    from billingctl.services.reconcile import reconcile

    payment, invoice = _checkout_payment(world)
    _wire_back(world, invoice, 999)
    world.advance(2 * 3600)
    named = [v for v in reconcile(world.c, full=True)["violations"] if v["check"] == "refund_not_reversed"]
    assert [(v["payment_id"], v["detail"]) for v in named] == [
        (payment["id"], "refunded 999 of 1999 at the provider: 0 of 999 credits reversed")]
    poll(world.c)
    assert reconcile(world.c, full=True)["violations"] == []


@pytest.mark.parametrize("order", ["orchestrator first", "provider first", "mirror lost"])
def test_reconcile_names_a_payment_refunded_at_both_consoles_until_a_person_acknowledges_it(world, order):
    """A refund at the orchestrator and one finance recorded at the provider for the same payment: a split
    made on purpose, a duplicate record of the orchestrator's refund, or the customer paid back twice by
    mistake (2,999 given back of a 1,999 payment). The provider's books hold the workflow's mirror and the
    refunds made outside alike, so nothing here can tell which (and a mirror that never landed hides the
    card refund there); the credits follow the larger book, and reconcile said nothing. It now names
    `refunded_at_both_consoles` for a person, who acknowledges it once checked."""
    from billingctl.services.events import poll
    from billingctl.services.reconcile import reconcile
    from billingctl.services.reconcile.acks import acknowledge

    payment, invoice = _checkout_payment(world)
    if order == "orchestrator first":
        world.sandbox.refund(payment["id"], 500)  # mirrored: 1,499 left refundable at the provider
        _wire_back(world, world.sandbox.invoice(invoice["id"]), None)
        detail = "refunded 500 at the orchestrator and 1999 at the provider"
    else:
        _wire_back(world, invoice, 1000)
        if order == "mirror lost":  # the workflow's step failed: the provider never hears of the card refund
            world.sandbox.store.set_meta("workflow_reports", False)
        world.sandbox.refund(payment["id"], 1999)  # the processor gives it all back; the workflow mirrors it
        detail = "refunded 1999 at the orchestrator and " + ("1000" if order == "mirror lost" else "2999") + \
            " at the provider"
    poll(world.c)
    assert world.credits() == 0
    world.advance(2 * 3600)
    named = [v for v in reconcile(world.c, full=True)["violations"] if v["check"] == "refunded_at_both_consoles"]
    assert [(v["payment_id"], v["detail"].split(" (")[0]) for v in named] == [(payment["id"], detail)]
    assert reconcile(world.c)["violations"] == named  # the daily run names it too, and nothing else
    acknowledge(world.c, "refunded_at_both_consoles", payment["id"], "split on purpose: ticket 42", "ops")
    assert reconcile(world.c, full=True)["violations"] == []


def test_a_refund_at_the_orchestrator_mirrored_to_the_provider_is_no_refund_at_both_consoles(world):
    """The workflow's mirror of a refund at the orchestrator is the provider's copy of the same refund: not
    named (no false alarm)."""
    from billingctl.services.events import poll
    from billingctl.services.reconcile import reconcile

    payment, _ = _checkout_payment(world)
    world.sandbox.refund(payment["id"], 700)
    poll(world.c)
    world.advance(2 * 3600)
    assert reconcile(world.c, full=True)["violations"] == []


def test_a_wire_refund_whose_subscription_support_deleted_before_we_read_it_takes_its_credits_back(world):
    """Found by the exploration (662ac69, after 193 histories): finance paid a customer back by wire and
    recorded it at the provider; support then deleted the subscription, its transactions with it, before
    the poll read the refund. The refund's event names the payment's transaction, which the provider no
    longer finds: the event failed at every poll and was parked, the customer kept the credits of money
    paid back. A deleted transaction is still listed with `include_deleted`: it is read so (decision 220)."""
    from billingctl.services.events import poll

    payment, invoice = _checkout_payment(world)
    _wire_back(world, invoice, 999)
    world.sandbox.delete_subscription(invoice["subscription_id"])
    for _ in range(6):
        poll(world.c)
        world.advance(61)
    assert world.credits() == 2000 - 2000 * 999 // 1999  # its share taken back, once
    assert _inbox_failures(world) == []


def test_a_payment_removed_from_its_invoice_and_paid_back_by_wire_takes_its_credits_back(world):
    """Finance removed our payment from its invoice (the customer's excess payments hold it, decision 184),
    then paid it back by wire and recorded that on the transaction: its credits are taken back."""
    from billingctl.services.events import poll

    payment, invoice = _checkout_payment(world)
    txn = world.sandbox.store.get("transaction_by_ref", payment["id"])["id"]
    world.sandbox.remove_payment(invoice["id"], txn)
    poll(world.c)
    assert world.credits() == 2000
    world.sandbox.record_transaction_refund(txn, None, "bank_transfer", world.sandbox.now())
    poll(world.c)
    assert world.credits() == 0
    assert _inbox_failures(world) == []


def test_a_refund_whose_events_meet_a_long_orchestrator_outage_is_taken_back_when_it_ends(world):
    """Decision 216, found by the exploration: finance recorded a refund at the provider while the
    orchestrator was down for longer than five polls' re-drives. Its events failed at each one (the poll
    reads the payment at the orchestrator) and were parked after five attempts, as if they were broken:
    nothing re-drove them when the outage ended, the customer kept the credits of money paid back, and once
    the refund was older than reconcile's window nothing named it either. An outage (a server error, an
    unreachable system, a rate limit, an open breaker, an answer lost) is not the event's fault: it keeps
    the event pending (paged like any event waiting over 15 minutes) and the poll re-drives it until it
    goes through; only a failure of the event's own (a refusal, a bug) counts toward parking."""
    from billingctl.services.events import poll

    payment, invoice = _checkout_payment(world)
    world.sandbox.store.add_fault("orchestrator", "503", count=-1)  # the orchestrator is down for hours
    _wire_back(world, invoice, None)
    for _ in range(8):
        poll(world.c)
        world.advance(3 * 3600)
    assert world.credits() == 2000  # not taken back yet: the orchestrator cannot be read
    assert [status for _, status in _inbox_failures(world)] == ["pending", "pending"]
    world.sandbox.store.clear_faults()
    world.advance(600)
    poll(world.c)
    assert world.credits() == 0
    assert _inbox_failures(world) == [] or {s for _, s in _inbox_failures(world)} == {"processed"}
