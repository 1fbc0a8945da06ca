"""Issue 35: the subscription lifecycle against the real provider (Chargebee-shaped): customers and
subscriptions collected offline, operator actions while a charge is in flight, provider-side payments,
event order, clocks. Each test failed before its fix, on SQLite and PostgreSQL."""

from datetime import UTC, datetime

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


# ---- defect 1: one live subscription per customer and plan ------------------------------------------------

def test_a_second_tab_gets_the_pending_checkout_back_and_a_held_plan_is_refused(world):
    from billingctl.domain import errors as e

    first = world.checkout("user_tabs", PRO)
    second = world.checkout("user_tabs", PRO)  # the second browser tab
    assert second["order_id"] == first["order_id"] and second["client_token"] == first["client_token"]
    assert len(world.sandbox.store.all("subscription")) == 1
    world.sandbox.pay(first["order_id"])
    with pytest.raises(e.AlreadySubscribed):
        world.checkout("user_tabs", PRO)
    assert len(world.sandbox.store.all("subscription")) == 1
    other = world.checkout("user_tabs", "credits-basic-USD-monthly")  # another plan is another checkout
    assert other["order_id"] != first["order_id"]


def test_two_paid_checkouts_of_one_plan_leave_one_live_subscription_and_refund_the_second(world):
    """The first tab's session expired, a second tab made a new checkout, and the customer then paid both
    (the orchestrator takes a late payment of an expired session): the second payment takes the same-plan
    duplicate path (refund + one alert) instead of starting a second live subscription."""
    from sqlalchemy import select, update

    from billingctl.adapters.db.tables import alert_outbox, checkout_session
    from billingctl.services.orphans import DUPLICATE_TEXT, run_orphans
    from tests.conftest import advance_with_sandbox

    first = world.checkout("user_2t", PRO)
    with world.c.uow() as uow:
        uow.execute(update(checkout_session).where(checkout_session.c.order_id == first["order_id"])
                    .values(expires_at=world.c.clock.now()))
        uow.commit()
    second = world.checkout("user_2t", PRO)
    assert second["order_id"] != first["order_id"]
    world.sandbox.pay(first["order_id"])
    paid_twice = world.sandbox.pay(second["order_id"])
    advance_with_sandbox(world.c, 60)
    run_orphans(world.c)
    assert world.sandbox.store.get("payment", paid_twice["id"])["processor"]["amountRefunded"] == paid_twice["amount"]
    assert world.credits("user_2t") == 2000
    live = [s["id"] for s in world.sandbox.store.all("subscription") if s["status"] in ("active", "non_renewing")]
    assert live == [first["subscription_id"]]
    with world.c.uow() as uow:
        texts = [p["text"] for p in uow.execute(select(alert_outbox.c.payload)
                                                .where(alert_outbox.c.sink == "chat")).scalars()]
    assert sum(DUPLICATE_TEXT in t for t in texts) == 1


def test_a_plan_paid_and_waiting_for_its_activation_is_held(world):
    """Decision 178, found by the exploration: the first checkout was paid and recorded while the provider
    was down, so its subscription waited for activation (status future); a second checkout of the plan was
    then answered with a new subscription, paid, and both went live. A paid subscription waiting for its
    activation holds the plan: checkout refuses the plan, and a second payment of the plan from an older
    checkout is the same-plan duplicate, refunded with its alert."""
    from sqlalchemy import update

    from billingctl.adapters.db.tables import checkout_session
    from billingctl.domain import errors as e
    from billingctl.services.orphans import run_orphans
    from billingctl.services.payments import retry_pending
    from tests.conftest import advance_with_sandbox

    first = world.checkout("user_wait", PRO)
    with world.c.uow() as uow:  # the first tab's session expires; a second tab makes another checkout
        uow.execute(update(checkout_session).where(checkout_session.c.order_id == first["order_id"])
                    .values(expires_at=world.c.clock.now()))
        uow.commit()
    second = world.checkout("user_wait", PRO)
    world.sandbox.store.add_fault("provider", "503", path="update_for_items", count=-1)  # activation fails
    world.sandbox.pay(first["order_id"])
    with world.c.uow() as uow:
        assert uow.subscriptions.status(first["subscription_id"]) == "future"  # paid, waiting for activation
    with pytest.raises(e.AlreadySubscribed):
        world.checkout("user_wait", PRO)
    paid_twice = world.sandbox.pay(second["order_id"])
    world.sandbox.store.clear_faults()
    advance_with_sandbox(world.c, 60)
    run_orphans(world.c)
    retry_pending(world.c)
    assert world.sandbox.store.get("payment", paid_twice["id"])["processor"]["amountRefunded"] == paid_twice["amount"]
    live = [s["id"] for s in world.sandbox.store.all("subscription") if s["status"] in ("active", "non_renewing")]
    assert live == [first["subscription_id"]] and world.credits("user_wait") == 2000


def test_one_payment_form_paid_twice_credits_one_term_and_refunds_the_second(world):
    """Two tabs share one checkout (the same payment form): paid in both, the second payment is a same-plan
    duplicate, refunded with one alert; the provider's invoice carries the first payment only."""
    from billingctl.services.orphans import run_orphans
    from tests.conftest import advance_with_sandbox

    co = world.checkout("user_pf", PRO)
    assert world.checkout("user_pf", PRO)["order_id"] == co["order_id"]
    first = world.sandbox.pay(co["order_id"])
    second = world.sandbox.pay(co["order_id"])
    advance_with_sandbox(world.c, 60)
    run_orphans(world.c)
    assert world.credits("user_pf") == 2000
    assert world.sandbox.store.get("payment", second["id"])["processor"]["amountRefunded"] == second["amount"]
    assert provider_invoices_holding(world, first["id"]) != [] and provider_invoices_holding(world, second["id"]) == []
    assert world.purchases(second["id"]) == 0


# ---- defect 7: provider copies are applied in the provider's order (resource_version) ---------------------

def test_two_provider_copies_of_one_second_are_ordered_by_resource_version(world):
    from billingctl.services.sync import apply_remote_subscription

    co = subscribed(world)
    remote = world.sandbox.subscription(co["subscription_id"])
    second = remote["updated_at"] + 5
    active = {**remote, "status": "active", "updated_at": second, "resource_version": second * 1000 + 100}
    cancelled = {**remote, "status": "cancelled", "updated_at": second, "resource_version": second * 1000 + 900}
    assert apply_remote_subscription(world.c, cancelled, "webhook") == "updated"
    assert apply_remote_subscription(world.c, active, "webhook") == "older_ignored"  # delivered late
    with world.c.uow() as uow:
        assert uow.subscriptions.status(co["subscription_id"]) == "cancelled"
    newer = {**active, "resource_version": second * 1000 + 950}
    assert apply_remote_subscription(world.c, newer, "webhook") == "updated"


# ---- defect 5: payments entered at the provider (a cheque, a wire) --------------------------------------

def test_a_term_paid_at_the_provider_in_two_parts_is_credited_once_and_never_posted_back(world):
    """A 1-cent cheque, then a wire for the rest, entered by finance at the provider: the term's credits
    once, when the invoice is paid in full; nothing recorded at the provider a second time."""
    from billingctl.services.events import poll

    co = subscribed(world)
    month_passes(world)
    invoice = world.sandbox.renew_due()[0]
    before = world.sandbox.store.count_requests("provider", "POST", "record_payment")
    world.sandbox.record_payment(invoice["id"], 1, "CHEQUE-0001", payment_method="check")
    world.sandbox.record_payment(invoice["id"], invoice["total"] - 1, "WIRE-0002", payment_method="bank_transfer")
    poll(world.c)
    poll(world.c)
    assert world.credits() == 2000 + 2000  # the checkout's term and this one, once
    assert world.sandbox.invoice(invoice["id"])["amount_paid"] == invoice["total"]  # not paid twice
    assert world.sandbox.store.count_requests("provider", "POST", "record_payment") == before
    from billingctl.services.payments import pending_activations

    assert pending_activations(world.c) == []  # no follow-up left that would post them back
    assert co["subscription_id"]


def test_a_cheque_on_the_invoice_of_a_subscription_support_paused_is_credited_and_activates_nothing(world):
    """Decision 193, found by the exploration: support paused a subscription whose renewal invoice was
    unpaid, and finance entered the customer's cheque on that invoice. The cheque was credited, and the
    subscription was marked for activation because it was not active: the activation refused a paused
    subscription ("cannot be activated"), every activations run asked the provider again, and reconcile
    named it `paid_not_active` every day. A paused subscription is a started one: its payment takes the
    provider's copy (paused) and leaves nothing pending."""
    from billingctl.services.events import poll
    from billingctl.services.payments import pending_activations, retry_pending
    from billingctl.services.reconcile import reconcile
    from tests.conftest import advance_with_sandbox

    co = subscribed(world)
    month_passes(world)
    invoice = world.sandbox.renew_due()[0]
    world.sandbox.pause(co["subscription_id"])
    world.sandbox.record_payment(invoice["id"], invoice["amount_due"], "cheque 0077", payment_method="check")
    poll(world.c)
    retry_pending(world.c)
    assert world.credits() == 2000 + 2000  # the checkout's term and the cheque's, once
    assert pending_activations(world.c) == []
    with world.c.uow() as uow:
        assert uow.subscriptions.get(co["subscription_id"])["status"] == "paused"
    reads = world.sandbox.store.count_requests("provider", "GET", "/subscriptions/")
    retry_pending(world.c)
    assert world.sandbox.store.count_requests("provider", "GET", "/subscriptions/") == reads  # asks no more
    advance_with_sandbox(world.c, 3600)
    poll(world.c)
    assert reconcile(world.c)["violations"] == []


def test_what_a_cheque_for_part_of_a_renewal_invoice_leaves_due_is_charged_once(world):
    """Decision 195, found while reading decision 194's crossing: finance entered a cheque for a quarter of a
    renewal invoice. The cheque is a purchase for the books that credits nothing (the term is not paid,
    decision 112), and the renewal job answered `already_paid` for any purchase on the invoice: the rest
    was never charged, the invoice stayed payment_due for ever and nothing named it (reconcile reads the
    terms granted). A purchase that paid no term does not pay the invoice: the renewal job charges what
    is due, once, and that charge credits the term."""
    from billingctl.services.events import poll
    from billingctl.services.reconcile import reconcile
    from billingctl.services.renewals import run_renewals
    from tests.conftest import advance_with_sandbox

    co = subscribed(world)
    month_passes(world)
    invoice = world.sandbox.renew_due()[0]
    quarter = invoice["amount_due"] // 4
    world.sandbox.record_payment(invoice["id"], quarter, "cheque 0080", payment_method="check")
    poll(world.c)
    assert world.credits() == 2000  # the cheque paid no term yet
    assert run_renewals(world.c)["outcomes"] == {"succeeded": 1}
    charges = [p for p in world.sandbox.store.all("payment") if p["orderId"] == invoice["id"]]
    assert [p["amount"] for p in charges] == [invoice["amount_due"] - quarter]  # what is due, not the total
    assert world.sandbox.invoice(invoice["id"])["status"] == "paid"
    assert world.credits() == 2000 + 2000  # the term, once
    advance_with_sandbox(world.c, 3600)
    poll(world.c)
    assert run_renewals(world.c)["outcomes"] == {}  # nothing due: never charged twice
    assert reconcile(world.c)["violations"] == []
    assert not [k for k in _chat_keys(world) if k.startswith("payment-removed:")]  # before: a false one
    assert co["subscription_id"]


def card_payment_waiting_for_its_record(world) -> tuple[dict, dict]:
    """A checkout paid by card and credited while the provider refused every record: (the orchestrator's
    payment, its provider invoice, payable); the provider is back."""
    co = world.checkout("user_chq", PRO)
    world.sandbox.store.add_fault("provider", "503", path="record_payment", count=-1)
    card = world.sandbox.pay(co["order_id"])
    assert world.credits("user_chq") == 2000
    world.sandbox.store.clear_faults()
    [invoice] = [i for i in world.sandbox.store.all("invoice") if i["subscription_id"] == co["subscription_id"]]
    return card, invoice


@pytest.mark.parametrize("first", ["event poll", "follow-up"])
def test_a_card_payment_whose_invoice_a_cheque_paid_meanwhile_is_refunded_once_with_its_alert(world, first):
    """Decision 179, found by the exploration: the card payment was recorded and credited while the provider
    was down, so its record on the invoice waited; finance then entered the customer's cheque on the same
    invoice. Our record was refused (the invoice is paid) and taken for the workflow's own record of our
    payment: the purchase was marked recorded, and the customer had paid the period twice, credited twice.
    The invoice's payments are now read: paid by another payment, ours is refunded and reversed, its
    purchase closed, with one alert; the cheque pays the period."""
    from sqlalchemy import select

    from billingctl.adapters.db.tables import alert_outbox, purchase
    from billingctl.services.events import poll
    from billingctl.services.payments import retry_pending
    from billingctl.services.reconcile import reconcile
    from tests.conftest import advance_with_sandbox

    card, invoice = card_payment_waiting_for_its_record(world)
    world.sandbox.record_payment(invoice["id"], invoice["amount_due"], "cheque 0042", payment_method="check")
    advance_with_sandbox(world.c, 60)
    for job in ((poll, retry_pending) if first == "event poll" else (retry_pending, poll)) * 2:
        job(world.c)
    paid = world.sandbox.store.get("payment", card["id"])
    assert paid["processor"]["amountRefunded"] == paid["amount"]
    assert world.credits("user_chq") == 2000  # the cheque's period, once
    with world.c.uow() as uow:
        closed = uow.execute(select(purchase.c.closed_reason).where(
            purchase.c.transaction_id == card["id"])).scalar_one()
        keys = list(uow.execute(select(alert_outbox.c.dedupe_key).where(alert_outbox.c.sink == "chat")).scalars())
    assert closed == "invoice_paid_elsewhere" and keys == [f"invoice-paid-elsewhere:{card['id']}"]
    advance_with_sandbox(world.c, 3600)
    assert reconcile(world.c)["violations"] == []


@pytest.mark.parametrize("outcome", ["SETTLED", "FAILED", "undecided for a week"])
def test_a_closed_purchase_whose_refund_the_processor_has_not_decided_is_named_only_if_it_refuses(world, outcome):
    """Left open by the session of 2026-11-29 (decision 233): the card payment of decision 179 is refunded
    and its purchase closed at once, but Primer's refund stays PENDING until the processor decides ("could
    take days"), and the credits follow the money: they are reversed only when the refund settles. While it
    was pending, every reconcile named the purchase `closed_purchase_not_reversed` (exit 5, a page) for
    money on its way back. A closed purchase whose unreversed part a pending refund covers is not named; it
    is once the processor refuses the refund (the money is still with us), and not once the refund settles
    and the credits are reversed. Undecided for longer than a week, it is named again."""
    from billingctl.services.events import poll
    from billingctl.services.payments import retry_pending
    from billingctl.services.reconcile import reconcile
    from tests.conftest import advance_with_sandbox

    card, invoice = card_payment_waiting_for_its_record(world)
    world.sandbox.record_payment(invoice["id"], invoice["amount_due"], "cheque 0042", payment_method="check")
    advance_with_sandbox(world.c, 60)
    world.sandbox.async_refunds("SETTLED" if outcome.startswith("undecided") else outcome)
    for job in (poll, retry_pending) * 2:
        job(world.c)
    refunds = [t["processorStatus"] for t in world.sandbox.store.get("payment", card["id"])["transactions"]
               if t["transactionType"] == "REFUND"]
    assert refunds == ["PENDING"]
    world.c.clock.advance(2 * 3600)  # past every grace of ours; the processor has not decided
    assert reconcile(world.c, full=True)["violations"] == []
    if outcome.startswith("undecided"):
        world.c.clock.advance(7 * 86400)
        named = [(v["check"], v.get("payment_id")) for v in reconcile(world.c, full=True)["violations"]]
        assert ("closed_purchase_not_reversed", card["id"]) in named
        return
    advance_with_sandbox(world.c, 60)  # the processor decides; PAYMENT.REFUND reports it
    world.sandbox.async_refunds(None)
    named = [(v["check"], v.get("payment_id")) for v in reconcile(world.c, full=True)["violations"]]
    if outcome == "SETTLED":
        assert named == [] and world.credits("user_chq") == 2000
    else:
        assert ("closed_purchase_not_reversed", card["id"]) in named


@pytest.mark.parametrize("first", ["event poll", "follow-up"])
def test_a_card_payment_whose_invoice_a_cheque_paid_in_part_meanwhile_pays_the_rest_and_returns_the_excess(world,
                                                                                                           first):
    """Decision 180: the card payment was recorded and credited while the provider was down, so its record on
    the invoice waited; finance then entered the customer's cheque for part of the invoice. The provider
    refuses a payment above the amount due, so our record was refused for ever: the purchase stayed pending,
    retried on every activations run, and the customer had paid the cheque's part twice. The card payment
    now pays the rest of the invoice, and what the cheque paid is refunded on the card, once, with one alert;
    the period is paid once, and its credits stand."""
    from sqlalchemy import select

    from billingctl.adapters.db.tables import alert_outbox, purchase
    from billingctl.services.events import poll
    from billingctl.services.payments import retry_pending
    from billingctl.services.reconcile import reconcile
    from tests.conftest import advance_with_sandbox

    card, invoice = card_payment_waiting_for_its_record(world)
    part = invoice["amount_due"] // 4
    cheque = world.sandbox.record_payment(invoice["id"], part, "cheque 0042", payment_method="check")["transaction"]
    advance_with_sandbox(world.c, 60)
    for job in ((poll, retry_pending) if first == "event poll" else (retry_pending, poll)) * 2:
        job(world.c)
    paid = world.sandbox.store.get("payment", card["id"])
    assert paid["processor"]["amountRefunded"] == part  # what the cheque paid, given back on the card
    document = world.sandbox.invoice(invoice["id"])
    assert (document["status"], document["amount_due"]) == ("paid", 0)
    on_it = {p["txn_id"]: p["applied_amount"] for p in document["linked_payments"]}
    assert on_it.pop(cheque["id"]) == part and list(on_it.values()) == [invoice["amount_due"] - part]
    assert world.sandbox.store.get("transaction", next(iter(on_it)))["reference_number"] == card["id"]
    assert world.credits("user_chq") == 2000  # the period, once: the excess takes back no credits
    with world.c.uow() as uow:
        row = uow.execute(select(purchase).where(purchase.c.transaction_id == card["id"])).mappings().one()
        keys = list(uow.execute(select(alert_outbox.c.dedupe_key).where(alert_outbox.c.sink == "chat")).scalars())
    assert (row["closed_reason"], row["returned_excess"]) == (None, part) and row["provider_recorded_at"]
    assert keys == [f"invoice-part-paid:{card['id']}"]
    assert retry_pending(world.c) == {"completed": 0, "failed": 0}  # nothing left to do, nothing done twice
    advance_with_sandbox(world.c, 3600)
    assert reconcile(world.c)["violations"] == []


def test_a_card_payment_whose_invoice_finance_credited_in_part_meanwhile_pays_the_rest_and_returns_the_excess(
        world):
    """Decision 204 with decision 180: finance credited part of the invoice (an adjustment credit note) while
    the card payment's record waited; the provider takes no more than the amount due, so the card payment
    pays the rest and the credited part is refunded on the card, once, with one alert; the period's credits
    stand."""
    from billingctl.services.events import poll
    from billingctl.services.payments import retry_pending
    from billingctl.services.reconcile import reconcile
    from tests.conftest import advance_with_sandbox

    card, invoice = card_payment_waiting_for_its_record(world)
    part = invoice["amount_due"] // 3
    world.sandbox.create_credit_note(invoice["id"], part)
    advance_with_sandbox(world.c, 60)
    for job in (retry_pending, poll) * 2:
        job(world.c)
    assert world.sandbox.store.get("payment", card["id"])["processor"]["amountRefunded"] == part
    document = world.sandbox.invoice(invoice["id"])
    assert (document["status"], document["amount_due"], document["amount_adjusted"]) == ("paid", 0, part)
    assert [p["applied_amount"] for p in document["linked_payments"]] == [invoice["amount_due"] - part]
    assert world.credits("user_chq") == 2000
    assert _chat_keys(world) == {f"invoice-part-paid:{card['id']}"}
    advance_with_sandbox(world.c, 3600)
    assert reconcile(world.c)["violations"] == []


def test_a_refund_after_an_excess_was_counted_takes_back_its_share(world):
    """Found by the exploration (2026-12-06, decision 265): a third of a card payment was refunded at the
    orchestrator's console while its record waited (its share of the credits taken back); finance then
    credited a third of the invoice, so the payment paid the rest and the refund already made counted as the
    excess (decision 180). A second third refunded later takes back its share of what paid the term: the
    ledger's key for a reversal named the share, and this one's (its total less the excess) was the first
    one's, so it was taken for a second report of the first and nothing was taken back."""
    from billingctl.domain.refunds import credits_to_reverse
    from billingctl.services.events import poll
    from billingctl.services.payments import retry_pending
    from tests.conftest import advance_with_sandbox

    card, invoice = card_payment_waiting_for_its_record(world)
    third = card["amount"] // 3
    world.sandbox.refund(card["id"], third)
    advance_with_sandbox(world.c, 60)
    poll(world.c)
    after_first = world.credits("user_chq")
    assert after_first == 2000 - credits_to_reverse(2000, card["amount"], 0, third)
    world.sandbox.create_credit_note(invoice["id"], invoice["amount_due"] - (card["amount"] - third))
    advance_with_sandbox(world.c, 60)
    for job in (retry_pending, poll) * 2:
        job(world.c)
    assert world.sandbox.store.get("payment", card["id"])["processor"]["amountRefunded"] == third  # no more
    world.sandbox.refund(card["id"], third)
    advance_with_sandbox(world.c, 60)
    poll(world.c)
    owed = credits_to_reverse(2000, card["amount"], third, 2 * third)  # half of what paid the term
    assert owed > 2000 - after_first
    assert world.credits("user_chq") == 2000 - owed


def test_an_excess_refund_the_processor_refused_before_the_rest_was_recorded_is_asked_for_again(world):
    """Decision 180 with decision 174: the excess's refund was asked for, the record of the rest failed, and
    the processor then refused the refund. The next run asks for it again under a new key (the old one
    would replay the refused refund), and only then records the rest."""
    from billingctl.services.payments import retry_pending
    from tests.conftest import advance_with_sandbox

    card, invoice = card_payment_waiting_for_its_record(world)
    part = invoice["amount_due"] // 4
    world.sandbox.record_payment(invoice["id"], part, "cheque 0042", payment_method="check")
    world.sandbox.async_refunds("FAILED")
    # The first record (refused for its amount) goes through; the record of the rest fails.
    world.sandbox.store.add_fault("provider", "503", path="record_payment", skip=1, count=-1)
    retry_pending(world.c)
    advance_with_sandbox(world.c, 60)  # the processor refuses the refund
    world.sandbox.async_refunds(None)
    world.sandbox.store.clear_faults()
    assert world.sandbox.store.get("payment", card["id"])["processor"].get("amountRefunded", 0) == 0
    retry_pending(world.c)
    assert world.sandbox.store.get("payment", card["id"])["processor"]["amountRefunded"] == part
    assert world.sandbox.invoice(invoice["id"])["status"] == "paid"
    assert world.credits("user_chq") == 2000


@pytest.mark.parametrize("reference", ["CHEQUE-0003", "cheque 0003"])
def test_a_payment_entered_at_the_provider_and_read_hours_later_is_no_false_alarm_for_reconcile(world, reference):
    """The cheque's transaction is dated when finance entered it; we read its event hours later, after a
    daily reconcile. The purchase was marked recorded at the provider with our time, six hours after the
    provider's record; reconcile finds a recorded purchase's transaction by that time (the same mark after a
    record retried past a crash was a false alarm, tests/reliability/test_crashes.py). The mark carries the
    provider's time (the transaction's date), as the confirmations and our own records now do. A reference
    typed as free text ("cheque 0003") is no id of ours: the payment is the provider's transaction, and
    reconcile found it by the text (found by the exploration, 2026-11-27)."""
    from sqlalchemy import select

    from billingctl.adapters.db.tables import purchase
    from billingctl.services.events import poll
    from billingctl.services.reconcile import reconcile
    from tests.conftest import advance_with_sandbox

    subscribed(world)
    month_passes(world)
    invoice = world.sandbox.renew_due()[0]
    paid = world.sandbox.record_payment(invoice["id"], invoice["total"], reference, payment_method="check")
    payment_id = reference if reference == "CHEQUE-0003" else paid["transaction"]["id"]
    advance_with_sandbox(world.c, 3 * 3600)
    reconcile(world.c)  # the daily run, before the poll reads the cheque
    advance_with_sandbox(world.c, 3 * 3600)
    poll(world.c)
    assert world.credits() == 2000 + 2000
    with world.c.uow() as uow:
        marked = uow.execute(select(purchase.c.provider_recorded_at).where(
            purchase.c.transaction_id == payment_id)).scalar_one()
    assert abs(marked.timestamp() - paid["transaction"]["date"]) < 60
    advance_with_sandbox(world.c, 3600)
    assert "recorded_not_on_provider_invoice" not in {v["check"] for v in reconcile(world.c)["violations"]}


# ---- defect 3: a freeze that voids the invoice a renewal charge is paying ---------------------------------

def test_a_renewal_settling_on_an_invoice_voided_by_a_freeze_is_refunded_once_and_ends_its_follow_up(world):
    from billingctl.services import orphans, users
    from billingctl.services.payments import retry_pending
    from billingctl.services.renewals import run_renewals
    from tests.conftest import advance_with_sandbox

    co = subscribed(world)
    month_passes(world)
    world.sandbox.async_charges("PENDING")
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    [charge] = [p for p in world.sandbox.store.all("payment") if p["orderId"] != co["order_id"]]
    frozen = users.freeze(world.c, "user_a", "chargeback suspected", "ops", void_invoices=True)
    assert frozen["voided"] == [charge["orderId"]]
    world.sandbox.finish_payment(charge["id"], settle=True)
    advance_with_sandbox(world.c, 60)
    users.unfreeze(world.c, "user_a", "cleared", "ops")
    orphans.retry(world.c, charge["id"], "ops")
    for _ in range(3):
        advance_with_sandbox(world.c, 60)
        assert retry_pending(world.c).outcome.failed == 0  # no follow-up fails every minute for ever
        orphans.run_orphans(world.c)
        run_renewals(world.c)
    assert world.sandbox.store.get("invoice", charge["orderId"])["status"] == "voided"
    refunded = world.sandbox.store.get("payment", charge["id"])["processor"]["amountRefunded"]
    assert refunded == charge["amount"]  # the payment went back to the customer, once
    assert world.credits() == 2000  # the first term only: the voided period was never credited
    [row] = orphans.list_orphans(world.c)
    assert (row["payment_id"], row["status"], row["resolution"]) == (charge["id"], "resolved", "refunded")
    with world.c.uow() as uow:  # its purchase is kept, closed: no follow-up waits on a void invoice
        assert uow.purchases.by_payment_id(charge["id"])["closed_reason"] == "invoice_voided"
    from billingctl.services.reconcile import reconcile

    assert reconcile(world.c)["violations"] == []


def test_a_renewal_settling_on_an_invoice_finance_deleted_meanwhile_is_refunded_once(world):
    """Decision 201: finance deleted a renewal invoice at the provider's console while its charge hung at the
    processor, which then settled it (before our next tick could cancel it). The provider no longer finds
    the invoice, and our record of the payment on it was retried every minute for ever, the customer charged
    for a term nobody invoices. The deletion is the decision that the term is not collected: the payment is
    refunded once, its credits reversed, its purchase closed, one alert."""
    from billingctl.services import events, orphans
    from billingctl.services.payments import retry_pending
    from billingctl.services.reconcile import reconcile
    from billingctl.services.renewals import run_renewals
    from tests.conftest import advance_with_sandbox

    co = subscribed(world)
    month_passes(world)
    world.sandbox.async_charges("PENDING")
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    [charge] = [p for p in world.sandbox.store.all("payment") if p["orderId"] != co["order_id"]]
    world.sandbox.delete_invoice(charge["orderId"])
    world.sandbox.finish_payment(charge["id"], settle=True)  # recorded from its notification, at once
    events.poll(world.c)
    advance_with_sandbox(world.c, 15 * 60)  # its wait for the workflow's record at the provider
    for _ in range(3):
        advance_with_sandbox(world.c, 60)
        assert retry_pending(world.c).outcome.failed == 0
        orphans.run_orphans(world.c)
        run_renewals(world.c)
    refunded = world.sandbox.store.get("payment", charge["id"])["processor"]["amountRefunded"]
    assert refunded == charge["amount"]  # the payment went back to the customer, once
    assert world.credits() == 2000  # the first term only
    with world.c.uow() as uow:
        assert uow.purchases.by_payment_id(charge["id"])["closed_reason"] == "invoice_deleted"
        assert uow.invoices.get(charge["orderId"])["deleted_at"] is not None
    assert [k for k in _chat_keys(world) if k.startswith("deleted-invoice:")] == [f"deleted-invoice:{charge['id']}"]
    advance_with_sandbox(world.c, 3600)
    assert reconcile(world.c)["violations"] == []


# ---- defect 4: activation starts by the provider's clock ---------------------------------------------------

# Behind by 4 minutes, not 5: the orchestrator's webhook must still be inside its 5-minute signature
# window by our clock (at exactly 5 minutes, the seconds the run takes pushed it out: a flaky CI run).
@pytest.mark.parametrize("our_clock_off_by", [5, 120, -5, -240], ids=["ahead-5s", "ahead-2min", "behind-5s",
                                                                       "behind-4min"])
@pytest.mark.parametrize("clock_known", ["first-contact", "clock-known", "clock-stepped-since"])
def test_a_paid_checkout_activates_at_once_whichever_way_our_clock_is_off(world, our_clock_off_by, clock_known):
    """Ahead: the provider kept the subscription future and every retry moved its start again. Behind by
    more than a request's own delay: the provider refuses a start in the past (backdating is off).
    Stepped since: the offset learned from an earlier answer is stale (our clock was stepped, or the
    process slept): the start's own answer teaches the clock again (a killed recorder's restart showed it)."""
    from billingctl.domain.clock import ManualClock
    from billingctl.services.payments import pending_activations

    co = world.checkout()
    stepped = clock_known == "clock-stepped-since"
    world.c.clock = ManualClock(datetime.fromtimestamp(world.sandbox.store.now() + (0 if stepped else our_clock_off_by),
                                                       UTC))
    if clock_known == "first-contact":
        world.c.provider.http.server_offset = None  # a new process: the start is its first provider call
    else:
        world.c.provider.get_subscription(co["subscription_id"])  # any answer names the provider's time
    if stepped:
        world.c.clock.advance(our_clock_off_by)  # our clock stepped after the answer that taught the offset
    result = world.sandbox.pay(co["order_id"])
    assert result["status"] == "SETTLED"
    remote = world.sandbox.subscription(co["subscription_id"])
    assert remote["status"] == "active" and pending_activations(world.c) == []
    assert abs(remote["start_date"] - world.sandbox.store.now()) < 5  # started now, by the provider's clock
    assert world.credits() == 2000


def test_the_provider_refuses_a_start_date_in_the_past_unless_backdating_is_enabled(world):
    from billingctl.domain import errors as e

    co = world.checkout()
    long_ago = int(world.sandbox.store.now()) - 3600
    with pytest.raises(e.ExternalInvalidRequest) as refused:
        world.c.provider.start_subscription(co["subscription_id"], long_ago)
    assert (refused.value.details["api_error_code"], refused.value.details["param"]) == ("param_wrong_value",
                                                                                        "start_date")
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "future"
    world.sandbox.store.set_meta("backdating", True)
    assert world.c.provider.start_subscription(co["subscription_id"], long_ago).subscription.status == "active"


def test_the_client_reads_the_providers_time_from_its_date_header(world):
    world.sandbox.store.advance_clock(-42)  # the provider's clock 42 s behind the machine's
    from billingctl.domain.clock import ManualClock

    world.c.clock = ManualClock(datetime.fromtimestamp(world.sandbox.store.now() + 42, UTC))
    list(world.c.provider.list_invoices())
    assert -44 <= world.c.provider.http.server_offset <= -41
    provider_now = world.c.provider.now(world.c.clock.now())
    assert provider_now.microsecond == 0 and provider_now.timestamp() <= world.sandbox.store.now()


def test_a_start_kept_future_by_an_answer_dated_at_that_start_is_sent_a_second_earlier(world):
    """CI found it (a slow host): our clock a second ahead of the provider's, the provider read its clock
    in second T and kept the start T+1 `future`, and its answer left after the turn of the second, dated
    T+1. The offset that answer taught names the same start again, so the retry was skipped ("never twice
    the same start") and the activation failed. The provider's clock has reached the kept start: the
    start is sent a second earlier, which is its "now" (decision 241), and the subscription starts."""
    import time

    from billingctl.services.payments import activate_subscription
    from tests.conftest import clock_to_sandbox

    co = world.checkout()
    sub = co["subscription_id"]
    world.sandbox.store.add_fault("provider", "503", path="update_for_items", count=-1)
    world.sandbox.pay(co["order_id"])  # recorded; its activation failed and is retried below
    world.sandbox.store.clear_faults()
    time.sleep(1.05 - world.sandbox.store.now() % 1)  # just after the turn of a second: what follows takes ms
    clock_to_sandbox(world.c)
    world.c.provider.get_subscription(sub)  # an answer names the provider's time: our clocks agree
    world.c.clock.advance(1)  # and now ours is a second ahead
    world.sandbox.store.add_fault("provider", "slow_answer", path="update_for_items", delay=1.0)
    starts = world.sandbox.store.count_requests("provider", "POST", "update_for_items")
    assert activate_subscription(world.c, sub) == {"subscription_id": sub, "outcome": "activated",
                                                    "status": "active"}
    assert world.sandbox.store.count_requests("provider", "POST", "update_for_items") == starts + 2
    remote = world.sandbox.subscription(sub)
    assert remote["status"] == "active" and remote["start_date"] <= world.sandbox.store.now()


# ---- the subscription and the invoice as transition tables (decision 117) --------------------------------

def _local_invoice(world, invoice_id):
    with world.c.uow() as uow:
        return uow.invoices.get(invoice_id)


def _chat_keys(world):
    from sqlalchemy import select

    from billingctl.adapters.db.tables import alert_outbox

    with world.c.uow() as uow:
        return set(uow.execute(select(alert_outbox.c.dedupe_key).where(alert_outbox.c.sink == "chat")).scalars())


def _chat_count(world, key):
    from sqlalchemy import func, select

    from billingctl.adapters.db.tables import alert_outbox

    with world.c.uow() as uow:
        return uow.execute(select(func.count()).select_from(alert_outbox).where(
            alert_outbox.c.sink == "chat", alert_outbox.c.dedupe_key == key)).scalar_one()


def _illegal(world, machine):
    return world.c.metrics.sample("billing_lifecycle_illegal_transitions_total", {"lifecycle": machine}) or 0


def test_the_local_invoices_are_the_providers_copies_after_a_checkout_and_a_renewal(world):
    """Judged from the provider's books: each invoice we hold says what the provider's says, at its
    resource_version. Before, the first term's invoice was written "paid" before the payment was recorded
    on it, and no row held a version."""
    co, invoice, payment = world.renewal_charged_unseen()
    from billingctl.services.payments import record_payment

    assert record_payment(world.c, payment, "settled_poller")["outcome"] == "recorded"
    from billingctl.services import events

    events.poll(world.c)  # the provider's copies, from its events (issue 39: no read-back of our own)
    remote = [i for i in world.sandbox.store.all("invoice") if i["subscription_id"] == co["subscription_id"]]
    assert len(remote) == 2
    for copy in remote:
        local = _local_invoice(world, copy["id"])
        assert (local["status"], local["provider_resource_version"]) == ("paid", copy["resource_version"])
    assert _illegal(world, "invoice") == 0


def test_an_older_invoice_copy_delivered_late_never_overwrites_a_newer_one(world):
    """Webhooks arrive in any order: the invoice_generated copy (payment_due) delivered after the payment's
    copy (paid) left the local invoice payment_due while the provider held it paid."""
    from billingctl.services.provider_events import handle_event

    co, invoice, payment = world.renewal_charged_unseen()
    events = [ev for ev in world.sandbox.store.all("event")
              if (ev["content"].get("invoice") or {}).get("id") == invoice["id"]]
    assert [ev["event_type"] for ev in events][:1] == ["invoice_generated"] and len(events) >= 2
    for event in reversed(events):  # the newest first
        handle_event(world.c, event, via="webhook")
    assert _local_invoice(world, invoice["id"])["status"] == world.sandbox.invoice(invoice["id"])["status"] == "paid"
    assert _illegal(world, "invoice") == 0


def test_a_provider_status_outside_the_table_is_written_and_alerted_an_undocumented_one_refused(world):
    """The provider is authoritative: a documented status our table does not allow from ours (a voided
    invoice reported paid) is its word, written, and counted and alerted once; a status it does not
    document is refused (nothing written) and alerted."""
    from billingctl.services.invoices import apply_copy
    from billingctl.services.sync import apply_remote_subscription

    co = world.checkout()
    inv = {"id": "inv_t1", "subscription_id": co["subscription_id"], "customer_id": "user_a", "total": 1999,
           "currency_code": "USD", "status": "voided", "resource_version": 1}
    assert apply_copy(world.c, inv) == "applied"
    assert apply_copy(world.c, {**inv, "status": "paid", "resource_version": 2}) == "applied"
    assert _local_invoice(world, "inv_t1")["status"] == "paid"
    assert _illegal(world, "invoice") == 1 and "illegal:invoice:inv_t1:voided:paid" in _chat_keys(world)
    assert apply_copy(world.c, {**inv, "status": "archived", "resource_version": 3}) == "refused"
    assert _local_invoice(world, "inv_t1")["status"] == "paid"
    assert _illegal(world, "invoice") == 2 and "illegal:invoice:inv_t1:paid:archived" in _chat_keys(world)

    remote = world.sandbox.subscription(co["subscription_id"])  # future
    assert apply_remote_subscription(world.c, {**remote, "status": "active",
                                               "resource_version": remote["resource_version"] + 1}) == "updated"
    assert apply_remote_subscription(world.c, {**remote, "status": "future",  # no step leads back to future
                                               "resource_version": remote["resource_version"] + 2}) == "updated"
    with world.c.uow() as uow:
        assert uow.subscriptions.status(co["subscription_id"]) == "future"
    assert _illegal(world, "subscription") == 1
    assert f"illegal:subscription:{co['subscription_id']}:active:future" in _chat_keys(world)
    assert apply_remote_subscription(world.c, {**remote, "status": "expired",
                                               "resource_version": remote["resource_version"] + 3}) == "refused"
    with world.c.uow() as uow:
        assert uow.subscriptions.status(co["subscription_id"]) == "future"
    assert _illegal(world, "subscription") == 2


@pytest.mark.parametrize("read_by", ["activation", "sync"])
def test_a_copy_read_after_steps_we_have_not_read_yet_is_applied_without_an_alarm(world, read_by):
    """Found by the exploration (decision 225): support reactivated a cancelled subscription and paused it
    before the event poll read either step, and an operator's activation (or sync) read the subscription:
    paused, over our cancelled copy. Each step was allowed at the provider; our copy had not read them yet.
    The read was counted and alerted as a step outside the table ("manual review required"), and the
    poll's copies of the two steps then came as older news: a person was paged for nothing. A copy whose
    status the table's steps reach from ours is applied, nothing counted; the older copies are dropped."""
    from billingctl.services.events import poll
    from billingctl.services.payments import activate_subscription
    from billingctl.services.sync import cancel_subscription, sync_subscription

    co = world.checkout()
    world.sandbox.pay(co["order_id"])
    sub = co["subscription_id"]
    poll(world.c)
    cancel_subscription(world.c, sub, "customer asked", "operator")
    poll(world.c)
    with world.c.uow() as uow:
        assert uow.subscriptions.status(sub) == "cancelled"
    world.sandbox.reactivate(sub)  # support, at the provider's console; nothing read yet
    world.sandbox.pause(sub)
    if read_by == "sync":
        sync_subscription(world.c, sub)
    else:
        activate_subscription(world.c, sub)
    with world.c.uow() as uow:
        assert uow.subscriptions.status(sub) == "paused"
    poll(world.c)  # the reactivation's and the pause's own copies: older than the one read
    with world.c.uow() as uow:
        assert uow.subscriptions.status(sub) == "paused"
    assert _illegal(world, "subscription") == 0
    assert not [k for k in _chat_keys(world) if k.startswith("illegal:")]


def test_an_older_subscription_copy_is_dropped_before_the_table_is_consulted(world):
    """A copy behind the one held (by resource_version) is stale: nothing written, nothing alerted."""
    from billingctl.services.sync import apply_remote_subscription

    co = world.checkout()
    world.sandbox.pay(co["order_id"])
    remote = world.sandbox.subscription(co["subscription_id"])
    assert remote["status"] == "active"
    older = {**remote, "status": "future", "resource_version": remote["resource_version"] - 1}
    assert apply_remote_subscription(world.c, older, source="event") == "older_ignored"
    with world.c.uow() as uow:
        assert uow.subscriptions.status(co["subscription_id"]) == "active"
    assert _illegal(world, "subscription") == 0


# ---- issue 37 item 3: one event's identifier never poisons the jobs --------------------------------------

def test_a_payment_entered_at_the_provider_with_a_free_text_reference_is_credited_and_poisons_nothing(world):
    """Finance typed a cheque number with non-ASCII characters as the reference: it is no orchestrator id,
    so the payment is known by the provider's own transaction id. Before, the reference became our payment
    id and every later provider call that named it raised UnicodeEncodeError."""
    from billingctl.services.events import poll
    from billingctl.services.payments import pending_activations, retry_pending

    subscribed(world)
    month_passes(world)
    invoice = world.sandbox.renew_due()[0]
    paid = world.sandbox.record_payment(invoice["id"], invoice["total"], "Chèque n°12", payment_method="check")
    poll(world.c)
    assert world.credits() == 2000 + 2000
    with world.c.uow() as uow:
        assert uow.purchases.exists_for_payment(paid["transaction"]["id"])
        assert not uow.purchases.exists_for_payment("Chèque n°12")
    assert pending_activations(world.c) == []
    assert dict(retry_pending(world.c)) == {"completed": 0, "failed": 0}


def test_the_activations_job_isolates_a_row_that_crashes_and_completes_the_others(world, caplog):
    """A purchase left by the old code with a reference no header can carry: its follow-up crashes
    (UnicodeEncodeError, not one of our errors); the job counts and logs it with its traceback, and the
    other customers' activations complete. Before, the job exited on it every run."""
    from billingctl.services.payments import pending_activations, retry_pending

    world.sandbox.store.add_fault("provider", "503", path="update_for_items", count=-1)
    co = world.checkout("user_b")
    world.sandbox.pay(co["order_id"])
    assert [r["id"] for r in pending_activations(world.c)] == [co["subscription_id"]]
    poisoned = world.checkout("user_c")
    with world.c.uow() as uow:
        uow.users.ensure("user_c", world.c.clock.now())
        uow.purchases.add({"invoice_id": "inv_poison", "transaction_id": "Chèque n°12",
                           "subscription_id": poisoned["subscription_id"], "user_id": "user_c",
                           "item_price_id": "credits-pro-USD-monthly", "amount": 1999, "currency_code": "USD",
                           "credits": 2000, "processor": None, "recorded_via": "event_poller",
                           "settled_at": world.c.clock.now(), "created_at": world.c.clock.now(),
                           "provider_recorded_at": None})
        uow.commit()
    world.sandbox.store.clear_faults()
    result = retry_pending(world.c)
    assert (result["completed"], result["failed"]) == (1, 1)
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "active"
    assert any(r.levelname == "ERROR" and r.exc_info and r.getMessage() == "pending activation crashed"
               for r in caplog.records)


def test_a_subscription_paused_at_the_provider_holds_its_plan(world):
    """Support paused the customer's subscription at the provider's console (a holiday); the customer then
    checked out the plan again. A paused subscription did not hold its plan: the checkout made and billed a
    second subscription, and once the first resumed, both were billed every term (reconcile counted paused
    ones as not billed, so it said nothing until then). A paused subscription holds its plan now: the
    checkout is refused, and reconcile names a paused and a live one of one plan."""
    from billingctl.domain import errors as e
    from billingctl.services.events import poll
    from billingctl.services.reconcile import reconcile
    from tests.conftest import advance_with_sandbox

    co = subscribed(world)
    world.sandbox.pause(co["subscription_id"])
    poll(world.c)
    with world.c.uow() as uow:
        assert uow.subscriptions.status(co["subscription_id"]) == "paused"
    with pytest.raises(e.AlreadySubscribed):
        world.checkout("user_a", PRO)
    world.sandbox.resume(co["subscription_id"])
    poll(world.c)
    live = [s["id"] for s in world.sandbox.store.all("subscription") if s["status"] in ("active", "paused")]
    assert live == [co["subscription_id"]]
    # A second one made at the provider's console while the first is paused is named before it bills twice.
    world.sandbox.pause(co["subscription_id"])
    other = world.sandbox.create_subscription_for_items("user_a", PRO, None)["subscription"]
    advance_with_sandbox(world.c, 3600)
    [found] = [v for v in reconcile(world.c)["violations"] if v["check"] == "two_live_subscriptions"]
    assert sorted(found["subscription_ids"]) == sorted([co["subscription_id"], other["id"]])


def test_a_payment_finance_removes_from_its_invoice_is_named_at_once_never_charged_again_and_clears_when_applied(
        world):
    """Decision 184: finance removes our recorded payment from its renewal invoice at the provider (its
    remove-payment: no money moves, the amount goes to the customer's excess payments) and the invoice owes
    again. Before, nothing said so until reconcile's daily run, and the renewal job skipped the invoice as
    "already_paid". Now its copy names it to a person at once, once, and renewals count it apart, charging
    nothing; once finance applies the payment again, the invoice is paid and the books agree."""
    from billingctl.services import events
    from billingctl.services.payments import record_payment
    from billingctl.services.reconcile import reconcile
    from billingctl.services.renewals import run_renewals

    co, invoice, payment = world.renewal_charged_unseen()
    assert record_payment(world.c, payment, "settled_poller")["outcome"] == "recorded"
    events.poll(world.c)
    txn = world.sandbox.store.get("transaction_by_ref", payment["id"])["id"]
    key = f"payment-removed:{payment['id']}:{invoice['id']}"
    assert key not in _chat_keys(world)

    removed = world.sandbox.remove_payment(invoice["id"], txn)["invoice"]
    assert (removed["status"], removed["amount_due"]) == ("payment_due", invoice["total"])
    assert world.sandbox.customer("user_a")["excess_payments"] == invoice["total"]
    events.poll(world.c)
    events.poll(world.c)  # a second read of the same news alerts nothing more
    assert _local_invoice(world, invoice["id"])["status"] == "payment_due"
    assert key in _chat_keys(world) and _illegal(world, "invoice") == 0
    charges = len(world.sandbox.store.all("payment"))
    assert run_renewals(world.c)["outcomes"] == {"payment_removed": 1}
    assert len(world.sandbox.store.all("payment")) == charges  # the customer is not charged twice
    world.advance(2 * 3600)
    assert "purchase_on_unpaid_invoice" in {v["check"] for v in reconcile(world.c)["violations"]}

    world.sandbox.apply_payments(invoice["id"], txn)  # finance puts it back
    events.poll(world.c)
    assert _local_invoice(world, invoice["id"])["status"] == world.sandbox.invoice(invoice["id"])["status"] == "paid"
    assert world.sandbox.customer("user_a")["excess_payments"] == 0
    assert "payment_removed" not in run_renewals(world.c)["outcomes"]
    world.advance(2 * 3600)
    assert reconcile(world.c, full=True)["violations"] == []


def test_a_payment_removed_from_its_invoice_refunded_and_its_invoice_voided_leaves_the_books_agreeing(world):
    """Decision 184, the other remedy: the term is not owed. The operator refunds the payment (the
    provider's mirror of the refund draws on the customer's excess payments, with no credit note) and
    finance voids the invoice: nothing is charged, the credits are back, reconcile names nothing."""
    from billingctl.services import events
    from billingctl.services.payments import record_payment, refund_by_operator
    from billingctl.services.reconcile import reconcile
    from billingctl.services.renewals import run_renewals

    co, invoice, payment = world.renewal_charged_unseen()
    assert record_payment(world.c, payment, "settled_poller")["outcome"] == "recorded"
    before = world.credits()
    world.sandbox.remove_payment(invoice["id"], world.sandbox.store.get("transaction_by_ref", payment["id"])["id"])
    events.poll(world.c)
    assert refund_by_operator(world.c, payment["id"], "term not owed", "ops")["outcome"] == "refunded"
    assert world.sandbox.customer("user_a")["excess_payments"] == 0
    assert world.credits() == before - 2000
    world.sandbox.void_invoice(invoice["id"])
    events.poll(world.c)
    charges = len(world.sandbox.store.all("payment"))
    assert "payment_removed" not in run_renewals(world.c)["outcomes"]
    assert len(world.sandbox.store.all("payment")) == charges
    world.advance(2 * 3600)
    assert reconcile(world.c, full=True)["violations"] == []


def test_a_cheque_for_part_of_an_invoice_a_removal_left_owing_is_never_named_removed(world):
    """Decision 196, found by the exploration: finance removed our payment from its invoice, then entered a
    cheque for a quarter of what it owed. The renewal job's alert for the removal named every purchase
    recorded on the invoice, the cheque too: a person was told a cheque still on the invoice had been
    removed. A cheque for part of an invoice pays no term (decision 195) and is never named so."""
    from billingctl.services import events
    from billingctl.services.payments import record_payment
    from billingctl.services.renewals import run_renewals

    co, invoice, payment = world.renewal_charged_unseen()
    assert record_payment(world.c, payment, "settled_poller")["outcome"] == "recorded"
    world.sandbox.remove_payment(invoice["id"], world.sandbox.store.get("transaction_by_ref", payment["id"])["id"])
    due = world.sandbox.invoice(invoice["id"])["amount_due"]
    world.sandbox.record_payment(invoice["id"], due // 4, "cheque 0081", payment_method="check")
    events.poll(world.c)
    assert run_renewals(world.c)["outcomes"] == {"payment_removed": 1}
    assert [k for k in _chat_keys(world) if k.startswith("payment-removed:")] == [
        f"payment-removed:{payment['id']}:{invoice['id']}"]


def test_a_payment_removed_before_its_paid_copy_reached_us_is_named_by_the_renewal_job(world):
    """Decision 184, webhooks out of order: the removal's copy (payment_due, newer) arrives before the
    payment's own event, whose paid copy is then older and dropped, so no paid-to-payable step is ever seen
    here. The payment is recorded from its event and confirmed by it, and as our newer copy owes again the
    one alert is raised then (decision 260; before it, by the renewal job's next tick); the renewal job finds
    the invoice owing again under a purchase of ours, counts it apart, charges nothing and raises no other."""
    from billingctl.services.provider_events import handle_event
    from billingctl.services.renewals import run_renewals

    co, invoice, payment = world.renewal_charged_unseen()
    world.sandbox.remove_payment(invoice["id"], world.sandbox.store.get("transaction_by_ref", payment["id"])["id"])
    news = [ev for ev in world.sandbox.store.all("event")
            if ev["event_type"] in ("payment_succeeded", "invoice_updated")
            and (ev["content"].get("invoice") or {}).get("id") == invoice["id"]]
    assert [ev["event_type"] for ev in news] == ["payment_succeeded", "invoice_updated"]
    for event in reversed(news):  # the newest first
        handle_event(world.c, event, via="webhook")
    assert world.purchases(payment["id"]) == 1 and _local_invoice(world, invoice["id"])["status"] == "payment_due"
    key = f"payment-removed:{payment['id']}:{invoice['id']}"
    assert _chat_count(world, key) == 1
    charges = len(world.sandbox.store.all("payment"))
    assert run_renewals(world.c)["outcomes"] == {"payment_removed": 1}
    assert run_renewals(world.c)["outcomes"] == {"payment_removed": 1}
    assert len(world.sandbox.store.all("payment")) == charges
    assert _chat_count(world, key) == 1


@pytest.mark.parametrize("then", ["the follow-up runs first", "the renewal job runs first"])
def test_a_renewal_payment_removed_before_we_read_its_record_is_never_recorded_twice(world, then):
    """Decision 246 (found by a hand-written exploration history): the orchestrator's workflow records a
    renewal payment on its invoice, and finance removes it from the invoice at the provider before our
    event poll reads either (the poll is behind). Past the quarter-hour the renewal's purchase waits for the
    provider's confirmation, our follow-up recorded the payment again: the provider then held it twice
    (once as the customer's excess payments, once on the invoice), the removal was never told to a person
    and reconcile was clean. The follow-up now asks the provider for its transaction of the payment first:
    one held there but not on the invoice is the removal, named once, and nothing is recorded again."""
    from billingctl.services import events
    from billingctl.services.payments import retry_pending
    from billingctl.services.renewals import run_renewals
    from tests.conftest import advance_with_sandbox

    co = subscribed(world)
    month_passes(world)
    world.sandbox.decline_customer("user_a", False)
    assert run_renewals(world.c)["outcomes"] == {"succeeded": 1}
    [payment] = [p for p in world.sandbox.payments("SETTLED") if p["orderId"] != co["order_id"]]
    invoice_id = payment["orderId"]
    [txn] = [t for t in world.sandbox.store.all("transaction") if t.get("reference_number") == payment["id"]]
    world.sandbox.remove_payment(invoice_id, txn["id"])  # finance, before our poll read the record
    advance_with_sandbox(world.c, 3600)  # past the wait for the provider's confirmation; no poll ran
    charges = len(world.sandbox.store.all("payment"))
    if then == "the follow-up runs first":
        retry_pending(world.c)
    outcomes = run_renewals(world.c)["outcomes"]
    events.poll(world.c)
    retry_pending(world.c)
    assert run_renewals(world.c)["outcomes"] == {"payment_removed": 1}
    held = [t for t in world.sandbox.store.all("transaction") if t.get("reference_number") == payment["id"]
            and t["type"] == "payment"]
    assert [t["id"] for t in held] == [txn["id"]], outcomes  # the provider holds the payment once
    assert world.sandbox.invoice(invoice_id)["status"] == "payment_due"
    assert len(world.sandbox.store.all("payment")) == charges  # nothing charged again
    assert _chat_count(world, f"payment-removed:{payment['id']}:{invoice_id}") == 1
    assert world.credits() == 4000


def _removal_named_once_then_refunded(world, invoice, payment):
    """A payment removed from its voided invoice: named to a person once, never charged again; the person
    refunds it and the books agree."""
    from billingctl.services.payments import refund_by_operator
    from billingctl.services.reconcile import reconcile
    from billingctl.services.renewals import run_renewals

    assert _chat_count(world, f"payment-removed:{payment['id']}:{invoice['id']}") == 1
    charges = len(world.sandbox.store.all("payment"))
    run_renewals(world.c)
    assert len(world.sandbox.store.all("payment")) == charges
    assert refund_by_operator(world.c, payment["id"], "term not owed", "ops")["outcome"] == "refunded"
    assert world.sandbox.customer("user_a")["excess_payments"] == 0
    world.advance(2 * 3600)
    assert reconcile(world.c, full=True)["violations"] == []


def test_a_payment_removed_from_an_invoice_an_operator_voids_before_we_read_the_removal_is_named_once(world):
    """Decision 188 (found by the exploration): finance removes our recorded payment from its invoice and,
    before the event poll reads the removal, an operator freezes the customer with --void-invoices, which
    voids the invoice the provider now lists as unpaid. The void's copy is saved first; the removal's (older)
    is dropped, so the paid-to-payable step decision 184 named is never seen. Before, no alert was raised:
    the customer's money sat in their excess payments, named only by reconcile's daily run. Now any step
    from paid to a status that is not paid names each payment of ours recorded on it, once; the person
    refunds it, and the books agree."""
    from billingctl.services import events, users
    from billingctl.services.payments import record_payment

    co, invoice, payment = world.renewal_charged_unseen()
    assert record_payment(world.c, payment, "settled_poller")["outcome"] == "recorded"
    events.poll(world.c)
    assert _local_invoice(world, invoice["id"])["status"] == "paid"
    world.sandbox.remove_payment(invoice["id"], world.sandbox.store.get("transaction_by_ref", payment["id"])["id"])
    users.freeze(world.c, "user_a", "chargeback suspected", "ops", void_invoices=True)
    assert world.sandbox.invoice(invoice["id"])["status"] == "voided"
    events.poll(world.c)
    events.poll(world.c)
    assert _local_invoice(world, invoice["id"])["status"] == "voided"
    _removal_named_once_then_refunded(world, invoice, payment)


def test_a_workflow_record_read_after_its_removal_and_the_void_is_named_once(world):
    """Found by the embedded exploration (reconcile clean): the renewal charge settled and we recorded it; the
    orchestrator's workflow recorded it on the invoice at the provider, and before our event poll read that
    record finance removed the payment from the invoice and an operator's `users freeze --void-invoices`
    voided it. Our copy went from payment_due to voided (the void's answer), never paid, so decision 188's
    step was never seen; then the poll read the workflow's old `payment_succeeded` and marked the purchase
    recorded on an invoice our newer copy holds voided. Nobody was told, and no follow-up was left to find
    it: the customer's money sat in their excess payments. Now a record the provider reports on an invoice
    whose newer copy no longer holds it paid is the removal's news: each payment of ours recorded there is
    named to a person once."""
    from billingctl.services import events, users
    from billingctl.services.payments import record_payment, retry_pending

    co, invoice, payment = world.renewal_charged_unseen()
    assert record_payment(world.c, payment, "settled_poller")["outcome"] == "recorded"
    assert _local_invoice(world, invoice["id"])["status"] != "paid"  # the workflow's record not read yet
    world.sandbox.remove_payment(invoice["id"], world.sandbox.store.get("transaction_by_ref", payment["id"])["id"])
    users.freeze(world.c, "user_a", "chargeback suspected", "ops", void_invoices=True)
    assert _local_invoice(world, invoice["id"])["status"] == "voided"
    events.poll(world.c)
    events.poll(world.c)
    world.advance(2 * 3600)
    retry_pending(world.c)
    _removal_named_once_then_refunded(world, invoice, payment)


@pytest.mark.parametrize("forgiven", ["write_off", "credit_note"])
def test_a_renewal_settling_on_an_invoice_finance_wrote_off_meanwhile_is_refunded_once(world, forgiven):
    """Decision 185: finance writes off a renewal invoice at the provider while our charge for it is in
    flight at the orchestrator (a write-off needs no payment in progress at the provider, and ours is not
    there). The invoice is paid with nothing paid. Before, our record was refused (paid) and, the copy
    naming no payment, taken for the workflow's record of ours: marked recorded and credited, while the
    customer paid a forgiven term and no provider transaction carried it. Now, as for a void, the payment
    is refunded once with one alert, its credits reversed and its purchase closed. Decision 204: the same
    for an invoice finance credited in full (an adjustment credit note for all that was due)."""
    from billingctl.services.payments import retry_pending
    from billingctl.services.reconcile import reconcile
    from billingctl.services.renewals import run_renewals
    from tests.conftest import advance_with_sandbox

    co = subscribed(world)
    month_passes(world)
    world.sandbox.async_charges("PENDING")
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    [charge] = [p for p in world.sandbox.store.all("payment") if p["orderId"] != co["order_id"]]
    if forgiven == "write_off":
        written = world.sandbox.write_off(charge["orderId"])["invoice"]
        assert (written["status"], written["amount_paid"], written["write_off_amount"]) == \
            ("paid", 0, charge["amount"])
    else:
        credited = world.sandbox.create_credit_note(charge["orderId"], charge["amount"])["invoice"]
        assert (credited["status"], credited["amount_paid"], credited["amount_adjusted"]) == \
            ("paid", 0, charge["amount"])
    world.sandbox.finish_payment(charge["id"], settle=True)  # its webhook records it
    for _ in range(3):  # past the wait for the workflow's own record (which the paid invoice refused)
        advance_with_sandbox(world.c, 16 * 60)
        assert retry_pending(world.c).outcome.failed == 0
        run_renewals(world.c)
    paid = world.sandbox.store.get("payment", charge["id"])
    assert paid["processor"]["amountRefunded"] == charge["amount"]  # given back, once
    assert world.credits() == 2000  # the first term only: the written-off period is not credited
    with world.c.uow() as uow:
        assert uow.purchases.by_payment_id(charge["id"])["closed_reason"] == \
            {"write_off": "invoice_written_off", "credit_note": "invoice_credited"}[forgiven]
    assert f"{ {'write_off': 'written-off', 'credit_note': 'credited'}[forgiven]}-invoice:{charge['id']}" in \
        _chat_keys(world)
    advance_with_sandbox(world.c, 2 * 3600)
    assert reconcile(world.c, full=True)["violations"] == []


def test_an_invoice_written_off_unpaid_is_no_term_nobody_credited_for_reconcile(world):
    """Decision 185: a renewal the customer never paid, written off by finance, is paid at the provider with
    nothing paid: no term to credit. Reconcile named it `invoice_credits_not_one_term` every day."""
    from billingctl.services import events
    from billingctl.services.reconcile import reconcile
    from billingctl.services.renewals import run_renewals
    from tests.conftest import advance_with_sandbox

    subscribed(world)
    month_passes(world)
    world.sandbox.decline_customer("user_a")
    assert run_renewals(world.c)["outcomes"] == {"declined": 1}
    [invoice] = [i for i in world.sandbox.store.all("invoice") if i["status"] == "payment_due"]
    world.sandbox.write_off(invoice["id"])
    events.poll(world.c)
    assert _local_invoice(world, invoice["id"])["status"] == "paid" and world.credits() == 2000
    assert run_renewals(world.c)["outcomes"] == {}  # nothing due any more
    advance_with_sandbox(world.c, 2 * 3600)
    assert reconcile(world.c, full=True)["violations"] == []


def test_a_subscription_support_reactivates_beside_the_one_the_customer_bought_again_is_never_charged(world):
    """Decision 186: the customer cancelled, bought the plan again, and support then reactivated the old
    subscription at the provider's console (it is invoiced at once). Before, the renewal job charged the
    reactivated one's invoice too, and every term after: one plan billed twice. Now the subscription paid
    last holds the plan and renews; the other's invoices are not charged, with one alert to cancel one."""
    from billingctl.services import events
    from billingctl.services.renewals import run_renewals

    first = subscribed(world)
    world.sandbox.cancel(first["subscription_id"])
    events.poll(world.c)
    second = subscribed(world)
    assert second["subscription_id"] != first["subscription_id"]
    reactivated = world.sandbox.reactivate(first["subscription_id"])
    assert (reactivated["subscription"]["status"], reactivated["invoice"]["status"]) == ("active", "payment_due")
    events.poll(world.c)
    charges = len(world.sandbox.store.all("payment"))
    assert run_renewals(world.c)["outcomes"] == {"second_subscription": 1}
    assert len(world.sandbox.store.all("payment")) == charges
    assert f"second-subscription:{first['subscription_id']}" in _chat_keys(world)

    month_passes(world)  # both renew at the provider; the one paid last is charged, once
    outcomes = run_renewals(world.c)["outcomes"]
    assert outcomes.get("second_subscription") == 2 and sum(outcomes.values()) == 3, outcomes
    renewed = [p for p in world.sandbox.store.all("payment")[charges:]]
    assert [world.sandbox.invoice(p["orderId"])["subscription_id"] for p in renewed] == [second["subscription_id"]]


def _renewal_declined(world):
    """A subscription whose renewal was declined once: its checkout and the renewal invoice left due."""
    from billingctl.services.renewals import run_renewals

    co = subscribed(world)
    month_passes(world)
    world.sandbox.decline_customer("user_a", True)
    assert run_renewals(world.c)["outcomes"] == {"declined": 1}
    [old] = [i for i in world.sandbox.store.all("invoice") if i["status"] == "payment_due"]
    return co, old


def _renewal_days(world, days):
    """The renewal job's outcomes, summed over `days` days with a tick each."""
    from billingctl.services.renewals import run_renewals
    from tests.conftest import advance_with_sandbox

    outcomes = {}
    for _ in range(days):
        advance_with_sandbox(world.c, 86400)
        for outcome, n in run_renewals(world.c)["outcomes"].items():
            outcomes[outcome] = outcomes.get(outcome, 0) + n
    return outcomes


def test_a_term_cut_short_by_a_cancel_is_never_charged_beside_the_new_term_support_reactivated(world):
    """Decision 191: the renewal was declined, the customer cancelled, and support later reactivated the
    subscription at the provider's console: a new term from then, invoiced at once. The old term's invoice
    stays payment_due there (the provider does not collect unpaid invoices on a reactivation). Before, the
    renewal job charged both: the customer paid twice for the days the two terms share. Now an invoice
    whose term the subscription's current term overlaps without being it is not charged, with one alert
    asking a person to void or write it off; the new term's invoice is charged once."""
    from billingctl.services import events
    from billingctl.services.sync import cancel_subscription
    from tests.conftest import advance_with_sandbox

    co, old = _renewal_declined(world)
    cancel_subscription(world.c, co["subscription_id"], "customer asked", "ops")
    world.sandbox.decline_customer("user_a", False)
    advance_with_sandbox(world.c, 3 * 86400)
    new = world.sandbox.reactivate(co["subscription_id"])["invoice"]
    events.poll(world.c)
    reads = world.sandbox.store.count_requests("provider", "GET", f"/subscriptions/{co['subscription_id']}")
    outcomes = _renewal_days(world, 3)
    assert outcomes == {"succeeded": 1, "superseded_term": 3}, outcomes
    # the provider is asked once, not every tick
    assert world.sandbox.store.count_requests("provider", "GET", f"/subscriptions/{co['subscription_id']}") == \
        reads + 1
    charged = [p["orderId"] for p in world.sandbox.store.all("payment") if p["status"] == "SETTLED"]
    assert charged == [co["order_id"], new["id"]]
    assert world.sandbox.invoice(old["id"])["status"] == "payment_due"
    assert _chat_count(world, f"superseded-term:{old['id']}") == 1
    assert world.credits() == 4000


def _reactivated_inside_its_paid_term(world):
    """The checkout paid the first term; support cancelled the subscription at the provider's console
    mid-term and later reactivated it there: a new term from then, invoiced at once. The checkout, the paid
    invoice and the new one."""
    from billingctl.services import events
    from tests.conftest import advance_with_sandbox

    co = subscribed(world)
    [paid] = world.sandbox.store.all("invoice")
    advance_with_sandbox(world.c, 5 * 86400)
    world.sandbox.cancel(co["subscription_id"])  # support, at the provider's console
    events.poll(world.c)
    advance_with_sandbox(world.c, 5 * 86400)
    new = world.sandbox.reactivate(co["subscription_id"])["invoice"]
    events.poll(world.c)
    return co, paid, new


def test_a_new_term_support_reactivated_inside_a_paid_term_is_not_charged_for_the_days_already_paid(world):
    """Decision 204 (found by the exploration, reconcile clean): the provider's general reactivation starts a
    new term and invoices all of it (it computes no proration for it). Before, the renewal job charged that
    invoice: the customer paid twice for the days the paid term and the new one share. Now an invoice whose
    term overlaps a term a kept payment of the subscription paid is not charged, with one alert asking a
    person to void it and set the term end back (or to credit the shared days); once a person has, the next
    term renews from the paid term's end and is charged once."""
    from billingctl.services import events
    from billingctl.services.renewals import run_renewals
    from billingctl.services.sync import sync_subscription
    from tests.conftest import advance_with_sandbox

    co, paid, new = _reactivated_inside_its_paid_term(world)
    sub_id, paid_to = co["subscription_id"], paid["line_items"][0]["date_to"]
    assert run_renewals(world.c, dry_run=True)["outcomes"] == {"overlaps_paid_term": 1}
    assert _renewal_days(world, 3) == {"overlaps_paid_term": 3}
    charged = [p["orderId"] for p in world.sandbox.store.all("payment") if p["status"] == "SETTLED"]
    assert charged == [co["order_id"]]
    assert world.sandbox.invoice(new["id"])["status"] == "payment_due"
    assert _chat_count(world, f"overlaps-paid-term:{new['id']}") == 1
    assert world.credits() == 2000
    # A person voids the reactivation's invoice and sets the term end back to the paid term's end.
    world.sandbox.void_invoice(new["id"])
    world.sandbox.change_term_end(sub_id, paid_to)
    events.poll(world.c)
    sync_subscription(world.c, sub_id)
    advance_with_sandbox(world.c, paid_to - world.sandbox.now() + 3600)
    assert run_renewals(world.c)["outcomes"] == {"succeeded": 1}
    assert world.credits() == 4000
    renewal = [i for i in world.sandbox.store.all("invoice") if i["status"] == "paid" and i["id"] != paid["id"]]
    assert [i["line_items"][0]["date_from"] for i in renewal] == [paid_to]


def test_a_reactivated_term_whose_shared_days_a_person_credited_is_charged_the_rest_once(world):
    """Decision 204, the other repair: a person credits the days the paid term already covers on the new
    term's invoice (an adjustment credit note at the provider); the renewal job then charges what is left
    due, once, and the term is credited."""
    from billingctl.services import events
    from billingctl.services.renewals import run_renewals

    co, paid, new = _reactivated_inside_its_paid_term(world)
    assert run_renewals(world.c)["outcomes"] == {"overlaps_paid_term": 1}
    shared = paid["line_items"][0]["date_to"] - new["line_items"][0]["date_from"]
    credit = new["total"] * shared // (new["line_items"][0]["date_to"] - new["line_items"][0]["date_from"])
    world.sandbox.create_credit_note(new["id"], credit)
    events.poll(world.c)
    assert _renewal_days(world, 2) == {"succeeded": 1}
    charges = [p for p in world.sandbox.store.all("payment") if p["orderId"] == new["id"] and p["status"] == "SETTLED"]
    assert [p["amount"] for p in charges] == [new["total"] - credit]
    assert world.sandbox.invoice(new["id"])["status"] == "paid"
    assert world.credits() == 4000
    # Two paid terms share days, the shared ones credited by a person: not a term paid twice (decision 258).
    from billingctl.services.reconcile import reconcile

    assert "term_paid_twice" not in {v["check"] for v in reconcile(world.c, full=True)["violations"]}


def test_a_reactivated_term_credited_less_than_its_days_already_paid_is_not_charged_until_they_are(world):
    """Decision 248 (found by the embedded exploration, reconcile naming it too): finance credited a third
    of a reactivated term's invoice at the provider (a goodwill credit), where the days the paid term already
    covers were two thirds of it; decision 204 took any adjustment as a person's judgement of the overlap and
    charged the rest, so the customer paid twice for the days the credit did not cover. An adjustment ends
    the overlap only when it credits at least the days already paid; until then the invoice is not charged
    and a person is told how much that is, once for each adjustment."""
    from billingctl.services import events

    co, paid, new = _reactivated_inside_its_paid_term(world)
    line = new["line_items"][0]
    shared = paid["line_items"][0]["date_to"] - line["date_from"]
    owed_credit = new["total"] * shared // (line["date_to"] - line["date_from"])
    world.sandbox.create_credit_note(new["id"], new["total"] // 3)  # a goodwill credit, short of the days paid
    events.poll(world.c)
    assert _renewal_days(world, 2) == {"overlaps_paid_term": 2}
    assert [p["orderId"] for p in world.sandbox.payments("SETTLED")] == [co["order_id"]]
    assert world.sandbox.invoice(new["id"])["status"] == "payment_due"
    [key] = [k for k in _chat_keys(world) if k.startswith(f"overlaps-paid-term:{new['id']}")]
    assert _chat_count(world, key) == 1
    world.sandbox.create_credit_note(new["id"], owed_credit - new["total"] // 3)  # the rest of the days paid
    events.poll(world.c)
    assert _renewal_days(world, 2) == {"succeeded": 1}
    charges = [p for p in world.sandbox.payments("SETTLED") if p["orderId"] == new["id"]]
    assert [p["amount"] for p in charges] == [new["total"] - owed_credit]
    assert world.credits() == 4000


def test_a_subscription_the_provider_cancelled_for_non_payment_and_support_reactivated_in_term_is_charged_once(
        world):
    """Decision 191, the provider's in-term reactivation: the provider cancelled the subscription itself for
    non-payment and support reactivated it within its term. The term is kept and no invoice is made; the
    unpaid one is the current term's, so the renewal job charges it, once, and nothing else."""
    from billingctl.services import events
    from billingctl.services.renewals import run_renewals
    from tests.conftest import advance_with_sandbox

    co, old = _renewal_declined(world)
    world.sandbox.cancel(co["subscription_id"], cancel_reason="not_paid")
    events.poll(world.c)
    world.sandbox.decline_customer("user_a", False)
    advance_with_sandbox(world.c, 2 * 86400)
    assert run_renewals(world.c)["outcomes"] == {"not_a_renewal": 1}
    reactivated = world.sandbox.reactivate(co["subscription_id"])
    assert "invoice" not in reactivated
    events.poll(world.c)
    outcomes = _renewal_days(world, 3)
    assert outcomes == {"succeeded": 1}, outcomes
    assert world.sandbox.invoice(old["id"])["status"] == "paid" and len(world.sandbox.store.all("invoice")) == 2
    assert world.credits() == 4000


@pytest.mark.parametrize("then", ["the card works again", "the card is declined again"])
def test_a_renewal_invoice_the_providers_offline_dunning_marked_not_paid_is_retried_on_our_schedule(world, then):
    """Decision 244: a site may run the provider's dunning for offline payments (ours are, auto collection
    off); at its end it marks an unpaid invoice `not_paid` and may keep the subscription active. The renewal
    tick listed `payment_due` invoices only, so a schedule waiting on such an invoice never ran again: the
    customer kept the subscription unpaid, no attempt, no exhaustion, no alert. A `not_paid` invoice is
    still payable at the provider; the tick lists it too, and our schedule runs to its end: charged and
    recorded once (not_paid -> paid), or exhausted and the subscription cancelled."""
    from billingctl.services import events

    co, old = _renewal_declined(world)
    answer = world.sandbox.offline_dunning_ends(old["id"])
    assert answer["invoice"]["status"] == "not_paid" and "subscription" not in answer
    events.poll(world.c)
    assert _local_invoice(world, old["id"])["status"] == "not_paid"
    if then == "the card works again":
        world.sandbox.decline_customer("user_a", False)
    outcomes = _renewal_days(world, 12)
    if then == "the card works again":
        assert outcomes.get("succeeded") == 1, outcomes
        assert world.sandbox.invoice(old["id"])["status"] == "paid"
        assert len([p for p in world.sandbox.payments("SETTLED") if p["orderId"] == old["id"]]) == 1
        assert world.credits() == 4000
    else:
        assert outcomes.get("exhausted") == 1, outcomes
        assert world.sandbox.subscription(co["subscription_id"])["status"] == "cancelled"
        assert world.credits() == 2000


@pytest.mark.parametrize("seen_by", ["webhook", "the next tick"])
def test_a_renewal_charge_in_flight_when_the_providers_offline_dunning_ends_is_recorded_once(world, seen_by):
    """Decision 244: the provider's offline dunning ends while a renewal charge is in flight: the invoice
    not_paid and the subscription cancelled for non-payment. The charge then settles: the term it paid is
    honoured once (recorded on the not_paid invoice, which the provider holds as paid), the subscription
    stays cancelled and nothing goes to orphan recovery."""
    from billingctl.services import events
    from billingctl.services.orphans import list_orphans, run_orphans
    from billingctl.services.renewals import run_renewals
    from tests.conftest import advance_with_sandbox

    co = subscribed(world)
    month_passes(world)
    world.sandbox.async_charges("PENDING")
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    [charge] = [p for p in world.sandbox.store.all("payment") if p["orderId"] != co["order_id"]]
    answer = world.sandbox.offline_dunning_ends(charge["orderId"], cancel_subscription=True)
    assert answer["invoice"]["status"] == "not_paid" and answer["subscription"]["status"] == "cancelled"
    events.poll(world.c)
    world.sandbox.finish_payment(charge["id"], settle=True, drop_webhook=seen_by != "webhook")
    advance_with_sandbox(world.c, 3600)
    run_renewals(world.c)
    run_orphans(world.c)
    events.poll(world.c)
    assert provider_invoices_holding(world, charge["id"]) == [charge["orderId"]]
    assert world.sandbox.invoice(charge["orderId"])["status"] == "paid"
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "cancelled"
    assert world.credits() == 4000
    assert list_orphans(world.c) == []
    assert _local_invoice(world, charge["orderId"])["status"] == "paid"


def test_a_renewal_invoice_posted_under_payment_terms_is_charged_once_when_it_falls_due(world):
    """Decision 245: finance gives a customer payment terms (net D days) at the provider; their renewal
    invoice is `posted` until its due date, and the provider sends no event when it passes. The renewal job
    leaves it until the provider holds it payment_due, then charges it once; our copy follows the provider's
    (posted, then paid)."""
    from billingctl.services import events
    from billingctl.services.renewals import run_renewals
    from tests.conftest import advance_with_sandbox

    co = subscribed(world)
    world.sandbox.set_net_term_days("user_a", 15)
    month_passes(world)
    assert run_renewals(world.c)["outcomes"] == {}
    [posted] = [i for i in world.sandbox.store.all("invoice") if i["status"] == "posted"]
    assert posted["due_date"] == posted["date"] + 15 * 86400 and posted["subscription_id"] == co["subscription_id"]
    events.poll(world.c)
    assert _local_invoice(world, posted["id"])["status"] == "posted"
    assert _renewal_days(world, 14) == {}
    assert world.credits() == 2000
    assert _renewal_days(world, 2) == {"succeeded": 1}
    assert world.sandbox.invoice(posted["id"])["status"] == "paid"
    assert len([p for p in world.sandbox.payments("SETTLED") if p["orderId"] == posted["id"]]) == 1
    events.poll(world.c)
    assert _local_invoice(world, posted["id"])["status"] == "paid"
    assert world.credits() == 4000
    advance_with_sandbox(world.c, 86400)
    assert run_renewals(world.c)["outcomes"] == {}


def test_the_providers_offline_dunning_leaves_an_invoice_paid_in_part_as_it_is_and_may_cancel(world):
    """The provider's documented end of its offline dunning: an invoice paid in part cannot be marked
    not_paid, but the subscription is cancelled when the site says so; an invoice no dunning runs on (paid)
    is refused."""
    from billingctl.sandbox.model import SandboxError

    co, old = _renewal_declined(world)
    world.sandbox.record_payment(old["id"], old["amount_due"] // 4, "cheque 1")
    answer = world.sandbox.offline_dunning_ends(old["id"], cancel_subscription=True)
    assert answer["invoice"]["status"] == "payment_due"
    assert answer["subscription"]["status"] == "cancelled" and answer["subscription"]["cancel_reason"] == "not_paid"
    paid = next(i for i in world.sandbox.store.all("invoice") if i["status"] == "paid")
    with pytest.raises(SandboxError) as refused:
        world.sandbox.offline_dunning_ends(paid["id"])
    assert refused.value.api_error_code == "invalid_state_for_request"



def test_the_providers_offline_dunning_runs_on_a_posted_invoice_only_once_it_falls_due(world):
    """The provider's offline dunning reminds and acts on Payment Due invoices: an invoice posted under
    payment terms is not due yet, and its dunning cannot end before its due date (the sandbox took it,
    inventing a step the provider does not make); once the date has passed it is payment_due and may be
    marked not_paid, and our copy, still posted (no event marks the due date), steps to not_paid."""
    from billingctl.sandbox.model import SandboxError
    from billingctl.services import events
    from billingctl.services.renewals import run_renewals
    from tests.conftest import advance_with_sandbox

    subscribed(world)
    world.sandbox.set_net_term_days("user_a", 15)
    month_passes(world)
    assert run_renewals(world.c)["outcomes"] == {}
    [posted] = [i for i in world.sandbox.store.all("invoice") if i["status"] == "posted"]
    with pytest.raises(SandboxError) as refused:
        world.sandbox.offline_dunning_ends(posted["id"])
    assert refused.value.api_error_code == "invalid_state_for_request"
    assert world.sandbox.invoice(posted["id"])["status"] == "posted"
    events.poll(world.c)
    advance_with_sandbox(world.c, 15 * 86400 + 1)
    assert world.sandbox.offline_dunning_ends(posted["id"])["invoice"]["status"] == "not_paid"
    events.poll(world.c)
    assert _local_invoice(world, posted["id"])["status"] == "not_paid"

def _a_cheque_held_for_review(world) -> tuple[dict, str]:
    """Finance enters a cheque on a frozen customer's renewal invoice; the event poll reads it. The invoice
    and the cheque's transaction id."""
    from billingctl.services import events
    from billingctl.services.users import freeze

    subscribed(world)
    month_passes(world)
    [invoice] = world.sandbox.renew_due()
    freeze(world.c, "user_a", "chargeback suspected", "ops")
    txn = world.sandbox.record_payment(invoice["id"], invoice["amount_due"], "cheque 0042",
                                       payment_method="check")["transaction"]["id"]
    events.poll(world.c)
    return invoice, txn


def test_a_cheque_held_for_review_is_named_with_the_invoice_it_paid(world):
    """Decision 187 (found by the exploration): finance entered a cheque on a frozen customer's renewal
    invoice; the payment waits for a person (needs_review) and nothing is credited, so reconcile names the
    paid invoice nobody credited. It named no payment, so neither the person holding the cheque nor a
    runbook could tell what the invoice waits on; it now names the held payment."""
    from billingctl.services.reconcile import reconcile
    from tests.conftest import advance_with_sandbox

    invoice, txn = _a_cheque_held_for_review(world)
    with world.c.uow() as uow:
        assert uow.orphans.status(txn) == "needs_review"
    advance_with_sandbox(world.c, 2 * 3600)
    [named] = [v for v in reconcile(world.c, full=True)["violations"] if v["check"] == "invoice_credits_not_one_term"]
    assert named["invoice_id"] == invoice["id"] and named["payment_ids"] == [txn]
    assert named["detail"].endswith(f"its payment {txn} is held for review")


def test_a_cheque_a_person_marked_handled_is_no_longer_named_held(world):
    """Decision 198, found by the exploration: the person who held decision 187's cheque marked it handled
    (`orphans resolve T --mark-handled --reason R`, audited). Reconcile still named the paid invoice every
    day, saying the cheque "is held for review": a queue nobody held it in any more, and a violation nobody
    could end. A person's answer ends it, as it ends a purchase parked with a person (decision 129); a
    cheque still waiting is named as before."""
    from billingctl.services import orphans
    from billingctl.services.reconcile import reconcile
    from tests.conftest import advance_with_sandbox

    _, txn = _a_cheque_held_for_review(world)
    orphans.resolve(world.c, txn, "mark-handled", "returned the cheque to the customer", "ops")
    advance_with_sandbox(world.c, 2 * 3600)
    assert reconcile(world.c, full=True)["violations"] == []
    with world.c.uow() as uow:
        assert uow.orphans.status(txn) == "resolved"


# ---- decision 215: a subscription support deletes at the provider ------------------------------------------

def test_a_subscription_support_deletes_at_the_provider_is_cancelled_here_and_frees_its_plan(world):
    """Support deleted the customer's subscription at the provider's console ("Delete Subscription"; its
    invoices and transactions are deleted with it). The event poll applied the `subscription_deleted`
    copy as any other: our copy stayed active for good (no job re-reads it: sync-all is an operator's
    command, and reconcile's daily pass lists what changed, which a deleted subscription no longer is), and
    the customer could never buy the plan again. Now it is cancelled here, the customer may check out the
    plan again, and a person is told once that our payment is no longer in the provider's books."""
    from sqlalchemy import select

    from billingctl.adapters.db.tables import alert_outbox
    from billingctl.services.events import poll
    from billingctl.services.reconcile import reconcile
    from tests.conftest import advance_with_sandbox

    co = subscribed(world)
    paid = world.sandbox.store.all("payment")[0]
    world.sandbox.delete_subscription(co["subscription_id"])
    poll(world.c)
    with world.c.uow() as uow:
        assert uow.subscriptions.status(co["subscription_id"]) == "cancelled"
        keys = uow.execute(select(alert_outbox.c.dedupe_key).where(alert_outbox.c.sink == "chat")).scalars().all()
    assert keys.count(f"subscription-deleted:{co['subscription_id']}") == 1
    assert world.credits() == 2000  # paid for: the customer keeps them unless a person refunds
    again = world.checkout("user_a", PRO)  # the plan is free to buy again
    world.sandbox.pay(again["order_id"])
    assert world.credits() == 4000
    assert world.sandbox.subscription(again["subscription_id"])["status"] == "active"
    # The provider's books lost the payment we recorded: reconcile names it, the runbook's person answers.
    advance_with_sandbox(world.c, 2 * 3600)
    named = {(v["check"], v.get("payment_id")) for v in reconcile(world.c)["violations"]}
    assert named == {("recorded_not_on_provider_invoice", paid["id"])}
    poll(world.c)
    with world.c.uow() as uow:
        assert uow.subscriptions.status(co["subscription_id"]) == "cancelled"


@pytest.mark.parametrize("first", ["event poll", "follow-up"])
def test_a_card_payment_still_to_record_when_support_deletes_its_subscription_is_refunded_once(world, first):
    """Found by the exploration (8edf9e0, after 115 histories): the card payment was credited while the
    provider refused every record, and support then deleted the subscription at the provider's console (its
    invoices deleted with it; no `invoice_deleted` event comes for them). Our record was retried against
    the deleted invoice for ever, and reconcile named it every day. The deletion reached the provider before
    our payment did: nobody owes that invoice (decision 201's rule), so the payment is refunded once, its
    credits reversed, its purchase closed, one alert for it and none telling a person to refund it again."""
    from billingctl.services.events import poll
    from billingctl.services.payments import retry_pending
    from billingctl.services.reconcile import reconcile
    from tests.conftest import advance_with_sandbox

    card, invoice = card_payment_waiting_for_its_record(world)
    world.sandbox.delete_subscription(invoice["subscription_id"])
    advance_with_sandbox(world.c, 60)
    for job in ((poll, retry_pending) if first == "event poll" else (retry_pending, poll)) * 2:
        job(world.c)
    paid = world.sandbox.store.get("payment", card["id"])
    assert paid["processor"]["amountRefunded"] == paid["amount"]  # given back, once
    assert world.credits("user_chq") == 0
    with world.c.uow() as uow:
        assert uow.purchases.by_payment_id(card["id"])["closed_reason"] == "invoice_deleted"
        assert uow.invoices.get(invoice["id"])["deleted_at"] is not None
        assert uow.subscriptions.status(invoice["subscription_id"]) == "cancelled"
    assert _chat_keys(world) == {f"deleted-invoice:{card['id']}"}  # not also "refund it" for a person
    assert retry_pending(world.c).outcome.failed == 0
    advance_with_sandbox(world.c, 3600)
    assert reconcile(world.c)["violations"] == []


@pytest.mark.parametrize("poll_between", [False, True])
def test_a_cheque_on_a_cancelled_subscription_support_then_deletes_leaves_no_activation_pending(world, poll_between):
    """Found by the exploration at 423f45d (decision 222): an operator cancelled a subscription whose renewal
    invoice was unpaid, finance entered the customer's cheque on that invoice, and support deleted the
    subscription. The cheque's record marked the cancelled subscription for activation; its activation asked
    the provider, which no longer holds it (not found): the activations job failed on it at every run and
    reconcile named it `paid_not_active` every day. A subscription the provider no longer holds is handled
    as a cancelled one: nothing to activate, its copy cancelled, a checkout's payment to orphan recovery."""
    from billingctl.services.events import poll
    from billingctl.services.payments import pending_activations, retry_pending
    from billingctl.services.reconcile import reconcile
    from billingctl.services.sync import cancel_subscription
    from tests.conftest import advance_with_sandbox

    co = subscribed(world)
    month_passes(world)
    invoice = world.sandbox.renew_due()[0]
    cancel_subscription(world.c, co["subscription_id"], "customer asked", "ops")
    world.sandbox.record_payment(invoice["id"], invoice["amount_due"], "cheque 0091", payment_method="check")
    if poll_between:
        poll(world.c)
    world.sandbox.delete_subscription(co["subscription_id"])
    advance_with_sandbox(world.c, 60)
    poll(world.c)
    assert retry_pending(world.c).outcome.failed == 0
    assert pending_activations(world.c) == []
    assert world.credits() == 2000 + 2000  # the checkout's term and the cheque's, once
    with world.c.uow() as uow:
        assert uow.subscriptions.status(co["subscription_id"]) == "cancelled"
    advance_with_sandbox(world.c, 3600)
    assert "paid_not_active" not in {v["check"] for v in reconcile(world.c)["violations"]}


@pytest.mark.parametrize("read_by", ["sync", "activation"])
def test_a_subscription_found_deleted_before_its_events_are_read_takes_none_of_its_older_copies(world, read_by):
    """Found by the exploration at f995b9e (decision 223): support deleted a pending checkout's subscription
    at the provider, and we learnt it from a read the provider answered "not found" (an operator's sync; the
    activation of the old checkout's payment, decision 222) before the event poll read its events. The
    poll then applied the subscription's creation copy, no older than the version we held, over our
    cancelled copy: future again, an illegal step counted and alerted for a person at every such poll. A
    subscription the provider deleted has no newer copy: its copies are older news."""
    from billingctl.services.events import poll
    from billingctl.services.sync import sync_subscription

    co = world.checkout("user_a", PRO)
    sub = co["subscription_id"]
    world.sandbox.delete_subscription(sub)
    if read_by == "sync":
        sync_subscription(world.c, sub)
    else:
        world.sandbox.pay(co["order_id"])  # the old form paid: its activation finds the subscription gone
    with world.c.uow() as uow:
        assert uow.subscriptions.status(sub) == "cancelled"
    before = _illegal(world, "subscription")
    poll(world.c)
    poll(world.c)
    with world.c.uow() as uow:
        assert uow.subscriptions.status(sub) == "cancelled"
    assert _illegal(world, "subscription") == before
    assert not [k for k in _chat_keys(world) if k.startswith("illegal:")]  # nobody told of a contradiction




@pytest.mark.parametrize("charge", ["failed", "declined in flight", "settled in flight"])
def test_a_checkout_payment_laid_on_a_reactivated_term_the_renewal_job_tried_ends_that_terms_dunning(world, charge):
    """Decision 250, found by the production exploration of 2026-12-04 (reconcile's `dunning_unfinished`,
    "renewal attempts end on failed, the invoice is paid", every day): support cancelled a checkout's
    subscription before it started, the customer paid it anyway (left to orphan recovery), and support
    then reactivated it at the provider, invoiced at once. The renewal job tried that invoice and failed
    (no processor locked for the customer yet); orphan recovery then recorded the checkout's payment, the
    subscription being active again, and its activation laid it on the same invoice, which it paid. The
    dunning was left on `failed` with nobody owing the invoice: it now ends `succeeded`, by the checkout's
    payment, and nothing is charged. Passing before as after: a charge still in flight then (the customer
    has a processor locked by another plan) ends the dunning by its own end, declined (by the checkout's
    payment, decision 193) or settled (the invoice paid twice: the charge is refunded in full)."""
    from sqlalchemy import select

    from billingctl.adapters.db.tables import dunning_attempt
    from billingctl.services import events
    from billingctl.services.orphans import run_orphans
    from billingctl.services.payments import retry_pending
    from billingctl.services.reconcile import reconcile
    from billingctl.services.renewals import run_renewals
    from tests.conftest import advance_with_sandbox

    if charge != "failed":
        subscribed(world, plan="credits-basic-USD-monthly")
    co = world.checkout("user_a", PRO)
    world.sandbox.cancel(co["subscription_id"])  # support, before the customer pays
    events.poll(world.c)
    world.sandbox.pay(co["order_id"])  # settled for a cancelled subscription: left to orphan recovery
    [paid] = [p for p in world.sandbox.store.all("payment") if p["orderId"] == co["order_id"]]
    invoice = world.sandbox.reactivate(co["subscription_id"])["invoice"]
    assert invoice["status"] == "payment_due"
    events.poll(world.c)
    if charge != "failed":
        world.sandbox.async_charges("PENDING")
    assert run_renewals(world.c)["outcomes"] == ({"failed": 1} if charge == "failed" else {"pending": 1})
    advance_with_sandbox(world.c, 61)
    assert run_orphans(world.c)["outcomes"] == {"recorded": 1 if charge == "failed" else 2}
    retry_pending(world.c)
    events.poll(world.c)
    renewal = [p["id"] for p in world.sandbox.store.all("payment") if p["orderId"] == invoice["id"]]
    if charge != "failed":
        world.sandbox.finish_payment(renewal[0], settle=charge == "settled in flight")
        advance_with_sandbox(world.c, 61)
        run_renewals(world.c)
        retry_pending(world.c)
    with world.c.uow() as uow:
        steps = uow.execute(select(dunning_attempt.c.status, dunning_attempt.c.payment_id)
                            .where(dunning_attempt.c.invoice_id == invoice["id"]).order_by(dunning_attempt.c.id)).all()
    assert world.sandbox.invoice(invoice["id"])["status"] == "paid"
    if charge == "failed":
        assert [tuple(s) for s in steps] == [("failed", None), ("succeeded", paid["id"])]
        assert renewal == [] and world.credits() == 2000
    elif charge == "declined in flight":
        assert [s.status for s in steps] == ["pending", "declined", "succeeded"] and steps[-1].payment_id == paid["id"]
        assert world.credits() == 1000 + 2000
    else:
        assert [s.status for s in steps] == ["pending", "succeeded"]
        refunds = [t for t in world.sandbox.store.get("payment", renewal[0])["transactions"]
                   if t["transactionType"] == "REFUND"]
        assert [r["amount"] for r in refunds] == [invoice["total"]] and world.credits() == 1000 + 2000
    advance_with_sandbox(world.c, 3600)
    assert reconcile(world.c)["violations"] == []
    charges_made = len(world.sandbox.store.all("payment"))
    advance_with_sandbox(world.c, 2 * 86400)
    assert run_renewals(world.c)["outcomes"] == {} and len(world.sandbox.store.all("payment")) == charges_made


@pytest.mark.parametrize("end", ["settles", "declines"])
def test_a_reactivated_term_is_not_charged_while_the_old_terms_renewal_charge_is_in_flight(world, end):
    """Found by the embedded exploration (reconcile clean): the renewal job charged a term's invoice and the
    processor left the charge in flight; support then cancelled and reactivated the subscription at the
    provider's console, a new term from then invoiced at once. The next tick charged the new term too, as no
    kept payment paid the old one yet (decision 204 looks for paid terms only), and both charges settled:
    the customer paid twice for the days the two terms share. Now an invoice whose term overlaps another
    invoice of the subscription with a charge in flight is not charged until that charge has ended: settled,
    the new term overlaps a paid one (decision 204's alert, a person's); declined, the new term is charged
    once."""
    from billingctl.services import events
    from billingctl.services.renewals import run_renewals
    from tests.conftest import advance_with_sandbox

    co = subscribed(world)
    month_passes(world)
    world.sandbox.async_charges("PENDING")
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    [charge] = [p for p in world.sandbox.store.all("payment") if p["orderId"] != co["order_id"]]
    world.sandbox.async_charges(None)
    advance_with_sandbox(world.c, 3600)
    world.sandbox.cancel(co["subscription_id"])  # support, at the provider's console
    new = world.sandbox.reactivate(co["subscription_id"])["invoice"]
    events.poll(world.c)
    outcomes = run_renewals(world.c)["outcomes"]
    assert [p["id"] for p in world.sandbox.store.all("payment") if p["orderId"] == new["id"]] == [], outcomes
    world.sandbox.finish_payment(charge["id"], settle=end == "settles")
    advance_with_sandbox(world.c, 60)
    events.poll(world.c)
    _renewal_days(world, 3)
    settled = [p["orderId"] for p in world.sandbox.payments("SETTLED")]
    if end == "settles":
        assert settled == [co["order_id"], charge["orderId"]]
        assert world.sandbox.invoice(new["id"])["status"] == "payment_due"
        assert _chat_count(world, f"overlaps-paid-term:{new['id']}") == 1
    else:
        assert settled == [co["order_id"], new["id"]]
    assert world.credits() == 4000
    from billingctl.services.reconcile import reconcile

    assert "term_paid_twice" not in {v["check"] for v in reconcile(world.c, full=True)["violations"]}
