"""What recording returns and writes, whole: the document of every outcome (scripts read them with
--json), the analytics events, the transaction, invoice and subscription rows. Written against the
survivors of `make mutation`."""

from datetime import timedelta

import pytest
from sqlalchemy import select

from billingctl.adapters.db.tables import alert_outbox, invoice, subscription, transaction
from billingctl.domain.clock import parse_time
from billingctl.services.payments import activate_subscription, record_payment, reverse_refund
from billingctl.services.sync import sync_subscription
from billingctl.services.users import freeze

pytestmark = pytest.mark.integration


def analytics(world):
    with world.c.uow() as uow:
        return {key: payload for key, payload in uow.execute(
            select(alert_outbox.c.dedupe_key, alert_outbox.c.payload).where(alert_outbox.c.sink == "analytics"))}


def test_the_document_of_each_outcome(world):
    co = world.checkout()
    paid = world.settle(co["order_id"])
    ids = {"payment_id": paid["id"], "subscription_id": co["subscription_id"], "user_id": "user_a"}
    assert record_payment(world.c, paid, "webhook") == {
        **ids, "outcome": "recorded", "credits_applied": 2000, "provider_recorded": True, "activation": "activated",
        "lock": {"lane": "sfw", "outcome": "locked", "psp": "SFW_STRIPE", "locked_processor": "SFW_STRIPE"}}
    assert record_payment(world.c, paid, "webhook") == {
        **ids, "outcome": "duplicate", "credits_applied": 0, "provider_recorded": True, "activation": "already_active"}
    assert record_payment(world.c, paid, "cli", followups=False) == {**ids, "outcome": "duplicate",
                                                                      "credits_applied": 0}
    nsfw = world.checkout("user_n", "credits-pro-nsfw-USD-monthly")
    second = world.settle(nsfw["order_id"])
    assert record_payment(world.c, second, "webhook") == {
        "payment_id": second["id"], "subscription_id": nsfw["subscription_id"], "user_id": "user_n",
        "outcome": "recorded", "credits_applied": 3000, "provider_recorded": True, "activation": "activated",
        "set_primary": True,
        "lock": {"lane": "nsfw", "outcome": "locked", "psp": "NSFW_SEGPAY", "locked_processor": "NSFW_SEGPAY"}}
    frozen = world.checkout("user_f")
    freeze(world.c, "user_f", "fraud review", "ops")
    held = world.settle(frozen["order_id"])
    assert record_payment(world.c, held, "webhook") == {
        "payment_id": held["id"], "subscription_id": frozen["subscription_id"], "user_id": "user_f",
        "outcome": "held_frozen", "credits_applied": 0}
    cancelled = world.checkout("user_c")
    world.sandbox.cancel(cancelled["subscription_id"])
    late = world.settle(cancelled["order_id"])
    sync_subscription(world.c, cancelled["subscription_id"])
    assert record_payment(world.c, late, "webhook") == {
        "payment_id": late["id"], "subscription_id": cancelled["subscription_id"], "user_id": "user_c",
        "outcome": "orphaned", "credits_applied": 0}
    assert activate_subscription(world.c, co["subscription_id"]) == {
        "subscription_id": co["subscription_id"], "outcome": "already_active", "status": "active"}


def test_the_rows_and_the_analytics_event_of_a_recorded_payment(world):
    co = world.checkout()
    paid = world.settle(co["order_id"])
    record_payment(world.c, paid, "event_poller")
    remote = world.sandbox.subscription(co["subscription_id"])
    with world.c.uow() as uow:
        txn = uow.execute(select(transaction)).mappings().one()
        inv = uow.execute(select(invoice)).mappings().one()
        sub = uow.execute(select(subscription).where(subscription.c.id == co["subscription_id"])).mappings().one()
    assert (txn["transaction_id"], txn["status"], txn["amount"], txn["currency_code"], txn["customer_id"],
            txn["subscription_id"], txn["processor"]) == (paid["id"], "captured", paid["amount"], "USD", "user_a",
                                                          co["subscription_id"], "SFW_STRIPE")
    assert txn["invoice_id"] == inv["id"] == remote_invoice(world, co)
    assert (inv["subscription_id"], inv["customer_id"], inv["total_amount"], inv["currency_code"], inv["status"]) == (
        co["subscription_id"], "user_a", paid["amount"], "USD", "paid")
    # Our invoice row is the provider's copy: paid when the provider recorded the payment (a second after
    # the payment's own date on a loaded machine: comparing with that date was flaky).
    assert inv["paid_at"] == parse_time(world.sandbox.invoice(inv["id"])["paid_at"])
    assert (sub["status"], sub["activation_pending_since"], sub["activation_error"], sub["lane"]) == (
        "active", None, None, "sfw")
    assert sub["current_term_end"] == parse_time(remote["current_term_end"])
    assert sub["start_date"] == parse_time(remote["start_date"])
    assert analytics(world)[f"analytics:payment:{paid['id']}"] == {
        "event": "payment_recorded", "payment_id": paid["id"], "user_id": "user_a",
        "subscription_id": co["subscription_id"], "item_price_id": "credits-pro-USD-monthly", "lane": "sfw",
        "amount": paid["amount"], "currency_code": "USD", "credits": 2000, "path": "event_poller"}


def remote_invoice(world, co):
    [first] = [i["id"] for i in world.sandbox.store.all("invoice") if i["subscription_id"] == co["subscription_id"]]
    return first


def test_a_refund_reversal_document_and_its_analytics_event(world):
    co = world.checkout()
    paid = world.settle(co["order_id"])
    record_payment(world.c, paid, "webhook")
    assert reverse_refund(world.c, "pay_unknown", 10, "webhook") == {
        "payment_id": "pay_unknown", "outcome": "unknown_payment", "credits_reversed": 0}
    half = paid["amount"] // 2
    share = 2000 * half // paid["amount"]
    assert reverse_refund(world.c, paid["id"], half, "event_poller") == {
        "payment_id": paid["id"], "outcome": "reversed", "credits_reversed": share, "user_id": "user_a"}
    assert reverse_refund(world.c, paid["id"], half, "webhook") == {
        "payment_id": paid["id"], "outcome": "already_reversed", "credits_reversed": 0}
    assert analytics(world)[f"analytics:refund:{paid['id']}:{half}"] == {
        "event": "payment_refunded", "payment_id": paid["id"], "user_id": "user_a", "refunded_total": half,
        "credits_reversed": share, "path": "event_poller"}
    assert world.credits() == 2000 - share


def test_a_zero_refund_reverses_nothing_and_the_smallest_reversal_is_one_credit(world):
    co = world.checkout()
    paid = world.settle(co["order_id"])
    record_payment(world.c, paid, "webhook")
    assert reverse_refund(world.c, paid["id"], 0, "webhook")["outcome"] == "already_reversed"
    assert reverse_refund(world.c, paid["id"], -5, "webhook")["outcome"] == "already_reversed"
    one = -(-paid["amount"] // 2000)  # the smallest refund worth one of the 2000 credits
    assert reverse_refund(world.c, paid["id"], one, "webhook") == {
        "payment_id": paid["id"], "outcome": "reversed", "credits_reversed": 1, "user_id": "user_a"}
    assert world.credits() == 1999


def test_a_refund_report_names_the_path_it_came_by(world):
    from billingctl.services.payments import apply_refund_report

    paid = world.settle(world.checkout()["order_id"])
    record_payment(world.c, paid, "webhook")
    assert apply_refund_report(world.c, paid["id"], paid["amount"], "event_poller")["outcome"] == "reversed"
    assert analytics(world)[f"analytics:refund:{paid['id']}:{paid['amount']}"]["path"] == "event_poller"


def test_the_purchase_is_recorded_on_its_invoice_for_its_whole_amount(world):
    """The provider takes a payment short of the amount due as a partial payment and leaves the invoice
    payable (a renewal would charge it again): the purchase's whole amount is what is recorded."""
    co = world.checkout()
    paid = world.settle(co["order_id"])
    record_payment(world.c, paid, "webhook")
    with world.c.uow() as uow:
        invoice_id = uow.purchases.by_payment_id(paid["id"])["invoice_id"]
    document = world.sandbox.invoice(invoice_id)
    assert (document["status"], document["amount_paid"], document["amount_due"]) == ("paid", paid["amount"], 0)
    assert [p["txn_amount"] for p in document["linked_payments"]] == [paid["amount"]]


def test_a_partial_payment_recorded_at_the_provider_leaves_the_invoice_payable(world):
    co = world.checkout()
    invoice = world.sandbox.start_future_subscription(co["subscription_id"], world.sandbox.now())["invoice"]
    world.sandbox.record_payment(invoice["id"], 500, "ref_1")
    part = world.sandbox.invoice(invoice["id"])
    assert (part["status"], part["amount_paid"]) == ("payment_due", 500)
    assert part["amount_due"] == invoice["amount_due"] - 500
    world.sandbox.record_payment(invoice["id"], part["amount_due"], "ref_2")
    whole = world.sandbox.invoice(invoice["id"])
    assert (whole["status"], whole["amount_paid"], whole["amount_due"]) == ("paid", invoice["amount_due"], 0)
    assert len(whole["linked_payments"]) == 2


def test_a_recording_the_provider_could_not_take_now_says_so_and_is_retried(world):
    """A provider outage while recording: the document says provider_recorded false (the purchase is
    still to report), and the activations job records it once the provider is back."""
    from billingctl.services.payments import retry_pending

    co = world.checkout()
    paid = world.settle(co["order_id"])
    world.sandbox.store.add_fault("provider", "503", path="record_payment", count=-1)
    assert record_payment(world.c, paid, "webhook")["provider_recorded"] is False
    with world.c.uow() as uow:
        row = uow.purchases.by_payment_id(paid["id"])
    assert row["provider_recorded_at"] is None
    world.sandbox.store.clear_faults()
    assert retry_pending(world.c) == {"completed": 1, "failed": 0}
    assert world.sandbox.invoice(row["invoice_id"])["status"] == "paid"


def test_a_payment_for_a_subscription_the_database_never_saw_adds_its_row(world):
    """The checkout's local write was lost (the subscription exists only at the provider and in the
    payment's metadata): recording adds the subscription's row, future until its activation succeeds."""
    co = world.checkout()
    with world.c.uow() as uow:
        uow.execute(subscription.delete().where(subscription.c.id == co["subscription_id"]))
        uow.commit()
    paid = world.settle(co["order_id"])
    world.sandbox.store.add_fault("provider", "503", path="update_for_items", count=-1)
    assert record_payment(world.c, paid, "webhook")["activation"] == "pending"
    with world.c.uow() as uow:
        sub = uow.execute(select(subscription).where(subscription.c.id == co["subscription_id"])).mappings().one()
    assert (sub["status"], sub["customer_id"], sub["item_price_id"], sub["lane"]) == (
        "future", "user_a", "credits-pro-USD-monthly", "sfw")
    assert sub["coupon_ids"] == [] and sub["activation_pending_since"] is not None


def test_a_recorded_payment_is_counted_by_path_logged_and_its_latency_never_negative(one_try_world, caplog):
    """A settle stamped ahead of our clock (the two clocks differ by seconds) is observed as no latency,
    never a negative one; the counter names the path; the log marker carries the payment's facts."""
    import logging

    world = one_try_world
    co = world.checkout()
    paid = world.settle(co["order_id"])
    world.c.clock.set(parse_time(paid["date"]) - timedelta(seconds=5))
    with caplog.at_level(logging.INFO, logger="billingctl.payments"):
        record_payment(world.c, paid, "webhook")
    m = world.c.metrics
    assert (m.sample("payment_recording_latency_seconds_count"), m.sample("payment_recording_latency_seconds_sum")) \
        == (1, 0)
    assert m.sample("billing_payments_recorded_total", {"path": "webhook"}) == 1
    [line] = [r for r in caplog.records if r.getMessage() == "payment recorded"]
    assert (line.payment_id, line.user_id, line.path, line.credits, line.lock_outcome) == (
        paid["id"], "user_a", "webhook", 2000, "locked")


def test_a_repeated_webhook_finishes_a_recording_the_provider_could_not_take(world):
    """The duplicate fast path is only for a payment with nothing left to do: a repeated webhook of a
    payment whose record on the invoice failed records it there."""
    co = world.checkout()
    paid = world.settle(co["order_id"])
    world.sandbox.store.add_fault("provider", "503", path="record_payment", count=-1)
    assert record_payment(world.c, paid, "webhook")["provider_recorded"] is False
    world.sandbox.store.clear_faults()
    again = record_payment(world.c, paid, "webhook")
    assert (again["outcome"], again["provider_recorded"]) == ("duplicate", True)
    with world.c.uow() as uow:
        row = uow.purchases.by_payment_id(paid["id"])
    assert row["provider_recorded_at"] is not None
    assert world.sandbox.invoice(row["invoice_id"])["status"] == "paid"
