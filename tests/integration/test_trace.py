"""`billingctl trace` (issue 38 item 12): one customer's timeline across the three sets of books, each
disagreement flagged with the reconcile check that names it, on both databases."""

import pytest
from sqlalchemy import update

from billingctl.adapters.db.tables import subscription, users
from billingctl.domain.errors import NotFound
from billingctl.services.trace import trace
from tests.integration.test_reconcile import paid as paid_and_later

pytestmark = pytest.mark.integration


def paid(world, user="user_t"):
    return paid_and_later(world, user)


def test_a_customer_whose_books_agree_has_one_timeline_from_all_three(one_try_world):
    world = one_try_world
    co, payment = paid(world)
    for asked in ("user_t", payment["id"], co["subscription_id"]):
        report = trace(world.c, asked)
        assert report["user_id"] == "user_t" and report["agree"] is True, report["disagreements"]
    sources = {line["source"] for line in report["timeline"]}
    assert sources == {"ours", "provider", "orchestrator"}
    times = [line["at"] for line in report["timeline"] if line["at"] is not None]
    assert times == sorted(times)
    assert any(payment["id"] in line["ids"] and line["source"] == "orchestrator" for line in report["timeline"])


def test_a_payment_nobody_recorded_is_flagged(one_try_world):
    """The "I paid and have no credits" case: settled at the orchestrator, its notification lost."""
    world = one_try_world
    co = world.checkout("user_t")
    lost = world.sandbox.pay(co["order_id"], drop_webhook=True)
    report = trace(world.c, lost["id"])
    assert [d["check"] for d in report["disagreements"]] == ["payment_unrecorded"]
    assert report["disagreements"][0]["payment"] == lost["id"]


def test_a_refund_not_reversed_and_a_subscription_that_differs_are_flagged(one_try_world):
    world = one_try_world
    co, payment = paid(world)
    world.sandbox.hold_webhooks()  # the refund's report is lost
    world.sandbox.refund(payment["id"])
    with world.c.uow() as uow:
        uow.execute(update(subscription).where(subscription.c.id == co["subscription_id"]).values(status="cancelled"))
        uow.execute(update(users).where(users.c.id == "user_t").values(credits=users.c.credits + 5))
        uow.commit()
    checks = {d["check"] for d in trace(world.c, "user_t")["disagreements"]}
    assert checks == {"refund_not_reversed", "subscription_differs", "credits_differ_from_ledger"}


def test_an_id_no_book_knows_is_not_found(one_try_world):
    world = one_try_world
    with pytest.raises(NotFound):
        trace(world.c, "pay_nobody_knows")


def test_a_refund_pending_and_one_refused_at_the_processor_are_on_the_timeline(one_try_world):
    """Decision 174: the customer asks where their refund is; the timeline says what the processor did."""
    world = one_try_world
    _, payment = paid(world)
    world.sandbox.async_refunds("FAILED")
    world.sandbox.refund(payment["id"], 500)
    texts = [line["what"] for line in trace(world.c, "user_t")["timeline"] if line["source"] == "orchestrator"]
    assert "refund of 500 pending at the processor" in texts
    world.sandbox.finish_refunds()
    texts = [line["what"] for line in trace(world.c, "user_t")["timeline"] if line["source"] == "orchestrator"]
    assert "1 refund(s) refused by the processor" in texts and not any("pending" in t for t in texts)


def test_an_excess_refunded_because_a_cheque_paid_part_of_the_invoice_is_no_disagreement(one_try_world):
    """Decision 180: a card payment that paid the rest of an invoice a cheque paid in part gets its excess
    refunded, which takes back no credits. The timeline judged a refund by the whole payment's share and
    flagged refund_not_reversed; it now says what was refunded as an excess, and agrees."""
    from billingctl.services.events import poll
    from billingctl.services.payments import retry_pending
    from tests.integration.test_subscription_lifecycle import card_payment_waiting_for_its_record

    world = one_try_world
    card, invoice = card_payment_waiting_for_its_record(world)
    world.sandbox.record_payment(invoice["id"], invoice["amount_due"] // 4, "cheque 0042", payment_method="check")
    retry_pending(world.c)
    poll(world.c)
    report = trace(world.c, card["id"])
    assert report["agree"] is True, report["disagreements"]
    excess = invoice["amount_due"] // 4
    assert [line["what"] for line in report["timeline"] if "excess" in line["what"]] == [
        f"payment recorded on the provider's invoice for the rest of it, {invoice['amount_due'] - excess}; "
        f"{excess} refunded as an excess"]


def test_a_refund_recorded_at_the_provider_is_on_the_timeline_and_flagged_until_its_credits_are_back(
        one_try_world):
    """Decision 212: finance paid the customer back by wire and recorded it at the provider. The timeline
    shows the provider's refund, flagged while its share of credits stands; once the poll took it back the
    books agree."""
    from billingctl.services.events import poll
    from tests.integration.test_provider_refunds import _invoice_paid_by

    world = one_try_world
    co, payment = paid(world)
    invoice = _invoice_paid_by(world, payment["id"])
    world.sandbox.record_refund(invoice["id"], 999, "bank_transfer", world.sandbox.now(), "WIRE-7")
    traced = trace(world.c, "user_t")
    assert [(d["check"], d["invoice"]) for d in traced["disagreements"]] == [("refund_not_reversed", invoice["id"])]
    assert [r["what"] for r in traced["timeline"] if r["what"].startswith("refund of")] == [
        f"refund of 999 USD recorded (credit note {world.sandbox.store.all('credit_note')[-1]['id']})"]
    poll(world.c)
    assert trace(world.c, "user_t")["agree"]


def test_a_payment_refunded_at_both_consoles_is_flagged_as_reconcile_names_it(one_try_world):
    """Decision 218: refunded by card at the orchestrator and by a wire finance recorded at the provider.
    Reconcile names `refunded_at_both_consoles`; the timeline the runbook sends the person to flagged
    nothing (each book's credits were taken back). It now flags the provider's last refund the same way."""
    from billingctl.services.events import poll
    from tests.integration.test_provider_refunds import _invoice_paid_by

    world = one_try_world
    _, payment = paid(world)
    invoice = _invoice_paid_by(world, payment["id"])
    world.sandbox.refund(payment["id"], 500)
    poll(world.c)
    assert trace(world.c, "user_t")["agree"]  # the workflow's mirror alone
    world.sandbox.record_refund(invoice["id"], 400, "bank_transfer", world.sandbox.now(), "WIRE-8")
    poll(world.c)
    traced = trace(world.c, "user_t")
    assert [(d["check"], d["invoice"]) for d in traced["disagreements"]] == [
        ("refunded_at_both_consoles", invoice["id"])]



def test_a_customer_with_more_rows_than_a_page_is_traced_whole_and_agrees(one_try_world):
    """The trace read at most 500 rows of each of our books: a customer with a longer ledger was told that
    their credits differ from it and that a refund was not reversed (exit 5 in the runbook's first command)
    while every book agreed (decision 235)."""
    from sqlalchemy import insert

    from billingctl.adapters.db.tables import credit_ledger

    world = one_try_world
    _, payment = paid(world)
    now = world.c.clock.now()
    with world.c.uow() as uow:  # years of small grants before the payment traced
        uow.execute(insert(credit_ledger), [
            {"user_id": "user_t", "amount": 1, "source_key": f"payment:pay_old_{i}", "reason": "payment",
             "payment_id": f"pay_old_{i}", "created_at": now} for i in range(600)])
        uow.execute(update(users).where(users.c.id == "user_t").values(credits=users.c.credits + 600))
        uow.commit()
    world.sandbox.refund(payment["id"])  # reported and reversed: the newest ledger row
    report = trace(world.c, "user_t")
    assert report["agree"] is True, report["disagreements"]
    assert sum(1 for line in report["timeline"] if line["what"].startswith("ledger ")) == 602
    with world.c.uow() as uow:  # the inbox only shows: a page of it, said to be one
        shown = uow.books.trace("user_t", shown=1)
    assert len(shown["inbox"]) == 1 and shown["not_shown"] == {"inbox": 1} and len(shown["ledger"]) == 602
