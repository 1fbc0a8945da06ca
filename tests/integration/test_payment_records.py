"""What recording writes besides the purchase, field by field: the transaction row of every payment status,
the manual-review row of a checkout the provider cancelled before its payment, and the activations job's
counts. Written against the survivors of `make mutation`."""

import pytest
from sqlalchemy import select

from billingctl.adapters.db.tables import alert_outbox, fraud_event, orphan_recovery, subscription, transaction
from billingctl.domain.clock import parse_time
from billingctl.services.payments import (
    activate_subscription,
    record_payment,
    retry_pending,
    update_transaction_status,
)

pytestmark = pytest.mark.integration
NSFW = "credits-pro-nsfw-USD-monthly"
TXN = ("transaction_id", "status", "amount", "currency_code", "customer_id", "invoice_id", "subscription_id",
       "processor", "processor_merchant_id")


def txn(world, payment_id):
    with world.c.uow() as uow:
        row = uow.execute(select(transaction).where(transaction.c.transaction_id == payment_id)).mappings().first()
    return tuple(row[f] for f in TXN) if row else None


@pytest.mark.parametrize(("status", "local"), [("AUTHORIZED", "authorized"), ("SETTLING", "settling"),
                                               ("DECLINED", "declined"), ("PENDING", "pending"),
                                               ("FAILED", "failed"), ("CANCELLED", "cancelled")])
def test_a_payment_status_keeps_every_field_of_the_transaction(world, status, local):
    co = world.checkout("user_t", NSFW)
    payment = world.sandbox.decline_checkout(co["order_id"], processor="NSFW_SEGPAY", drop_webhook=True)
    payment = {**payment, "status": status, "processor": {"name": "NSFW_SEGPAY", "processorMerchantId": "mid_7"}}
    assert update_transaction_status(world.c, payment) == {"payment_id": payment["id"], "outcome": "status_updated",
                                                           "status": local}
    # a checkout's order id is its subscription's, not an invoice's (decision 209)
    assert txn(world, payment["id"]) == (payment["id"], local, payment["amount"], "USD", "user_t", None,
                                         co["subscription_id"], "NSFW_SEGPAY", "mid_7")


def test_a_status_the_orchestrator_does_not_document_is_refused_counted_and_alerted(world):
    """Issue 34: an event outside the payment's table is never ignored (it used to be booked pending)."""
    from billingctl.adapters.db.tables import alert_outbox

    co = world.checkout("user_t", NSFW)
    payment = world.sandbox.decline_checkout(co["order_id"], drop_webhook=True)
    before = world.c.metrics.sample("billing_lifecycle_illegal_transitions_total", {"lifecycle": "payment"})
    answer = update_transaction_status(world.c, {**payment, "status": "SOMETHING_NEW"})
    assert answer == {"payment_id": payment["id"], "outcome": "illegal", "status": "SOMETHING_NEW"}
    assert txn(world, payment["id"]) is None
    assert world.c.metrics.sample("billing_lifecycle_illegal_transitions_total", {"lifecycle": "payment"}) == before + 1
    with world.c.uow() as uow:
        keys = uow.execute(select(alert_outbox.c.dedupe_key).where(alert_outbox.c.sink == "chat")).scalars().all()
    assert f"illegal:payment:{payment['id']}:None:SOMETHING_NEW" in keys


def test_payment_statuses_move_forward_only_stale_news_changes_nothing_and_a_contradiction_is_alerted(world):
    co = world.checkout("user_t", NSFW)
    payment = world.sandbox.decline_checkout(co["order_id"], drop_webhook=True)
    at = {**payment, "processor": {"name": "NSFW_SEGPAY"}}
    assert update_transaction_status(world.c, {**at, "status": "AUTHORIZED"})["outcome"] == "status_updated"
    assert update_transaction_status(world.c, {**at, "status": "PENDING"})["outcome"] == "stale"
    assert txn(world, payment["id"])[1] == "authorized"
    assert update_transaction_status(world.c, {**at, "status": "CANCELLED"})["outcome"] == "status_updated"
    assert update_transaction_status(world.c, {**at, "status": "AUTHORIZED"})["outcome"] == "stale"
    assert update_transaction_status(world.c, {**at, "status": "DECLINED"})["outcome"] == "illegal"
    assert txn(world, payment["id"])[1] == "cancelled"


def test_an_nsfw_authorization_without_a_lane_in_its_metadata_counts_by_its_checkout(world):
    """The lane comes from the payment's metadata, else from the checkout its order id names."""
    co = world.checkout("user_q", NSFW)
    declined = world.sandbox.decline_checkout(co["order_id"], drop_webhook=True)
    declined["metadata"] = {k: v for k, v in declined["metadata"].items() if k != "lane"}
    update_transaction_status(world.c, declined)
    with world.c.uow() as uow:
        keys = uow.execute(select(fraud_event.c.dedupe_key).where(fraud_event.c.user_id == "user_q")).scalars().all()
    assert keys == [f"payment:{declined['id']}"]  # the checkout's reserved slot, taken by this authorization
    sfw = world.checkout("user_r")
    other = world.sandbox.decline_checkout(sfw["order_id"], drop_webhook=True)
    other["metadata"] = {}
    update_transaction_status(world.c, other)
    with world.c.uow() as uow:
        assert uow.execute(select(fraud_event.c.id).where(fraud_event.c.user_id == "user_r")).first() is None


def test_a_payment_reported_authorized_before_it_settled_is_recorded_once_its_row_moved_to_captured(world):
    """Issue 39 item 4: a new payment's writes are one statement on PostgreSQL. A transaction row an earlier
    status report opened is not written again but moved through its lifecycle; the purchase, its credits,
    its subscription's pending activation and its analytics message are written once, and a second
    recording writes none of them again."""
    co = world.checkout("user_auth")
    payment = world.settle(co["order_id"])
    assert update_transaction_status(world.c, {**payment, "status": "AUTHORIZED"})["outcome"] == "status_updated"
    assert txn(world, payment["id"])[1] == "authorized"
    first = record_payment(world.c, payment, "webhook", followups=False)
    again = record_payment(world.c, payment, "settled_poller", followups=False)
    assert (first["outcome"], again["outcome"]) == ("recorded", "duplicate")
    assert txn(world, payment["id"])[1:5] == ("captured", payment["amount"], "USD", "user_auth")
    assert world.purchases(payment["id"]) == 1 and world.credits("user_auth") == first["credits_applied"] > 0
    with world.c.uow() as uow:
        row = uow.execute(select(subscription.c.status, subscription.c.activation_pending_since).where(
            subscription.c.id == co["subscription_id"])).one()
        messages = uow.execute(select(alert_outbox.c.payload).where(
            alert_outbox.c.dedupe_key == f"analytics:payment:{payment['id']}")).scalars().all()
    assert row.status == "future" and row.activation_pending_since is not None
    assert [m["event"] for m in messages] == ["payment_recorded"]


def test_a_checkout_cancelled_at_the_provider_opens_its_payment_for_review_with_its_facts(world):
    co = world.checkout()
    world.sandbox.cancel(co["subscription_id"])
    payment = world.sandbox.pay(co["order_id"])  # the webhook records it; activation finds it cancelled
    with world.c.uow() as uow:
        row = uow.execute(select(orphan_recovery).where(orphan_recovery.c.payment_id == payment["id"])).mappings().one()
        local = uow.execute(select(subscription).where(subscription.c.id == co["subscription_id"])).mappings().one()
    assert (row["user_id"], row["subscription_id"], row["item_price_id"], row["amount"], row["currency_code"],
            row["status"]) == ("user_a", co["subscription_id"], "credits-pro-USD-monthly", payment["amount"], "USD",
                               "retrying")
    assert row["settled_at"] == parse_time(payment["date"])
    assert (local["status"], local["activation_pending_since"], local["activation_error"]) == ("cancelled", None, None)
    assert local["synced_at"] is not None
    assert activate_subscription(world.c, co["subscription_id"]) == {
        "subscription_id": co["subscription_id"], "outcome": "cancelled_at_provider", "status": "cancelled"}


def test_a_failed_activation_then_a_cancel_at_the_provider_leaves_no_activation_error(world):
    co = world.checkout()
    world.sandbox.store.add_fault("provider", "503", path="update_for_items", count=-1)
    payment = world.sandbox.pay(co["order_id"])  # recorded; its activation fails
    world.sandbox.store.clear_faults()
    with world.c.uow() as uow:
        assert uow.subscriptions.get(co["subscription_id"])["activation_error"] is not None
    world.sandbox.cancel(co["subscription_id"])
    assert activate_subscription(world.c, co["subscription_id"])["outcome"] == "cancelled_at_provider"
    with world.c.uow() as uow:
        local = uow.subscriptions.get(co["subscription_id"])
        assert uow.orphans.status(payment["id"]) == "retrying"
    assert (local["status"], local["activation_pending_since"], local["activation_error"]) == ("cancelled", None, None)


def test_the_activations_job_counts_what_it_completed_and_what_still_fails(world):
    first, second = world.checkout("user_1"), world.checkout("user_2")
    world.sandbox.store.add_fault("provider", "503", path="update_for_items", count=-1)
    world.sandbox.pay(first["order_id"])
    world.sandbox.pay(second["order_id"])
    world.sandbox.store.clear_faults()
    world.sandbox.store.add_fault("provider", "503", path=f"{second['subscription_id']}/update_for_items", count=-1)
    result = retry_pending(world.c)
    assert result == {"completed": 1, "failed": 1}
    assert (result.outcome.done, result.outcome.failed) == (1, 1)
    world.sandbox.store.clear_faults()
    assert retry_pending(world.c) == {"completed": 1, "failed": 0}
    assert retry_pending(world.c) == {"completed": 0, "failed": 0}


def test_the_activations_job_counts_each_kind_of_failure_and_success(world):
    """Every count of the activations job: subscriptions pending with no purchase (their activation
    refuses), active ones whose purchase the provider refuses to record, and three that complete."""
    from billingctl.services.payments import pending_activations

    done = [world.checkout(f"user_{n}") for n in range(2)]
    world.sandbox.store.add_fault("provider", "503", path="update_for_items", count=-1)
    for co in done:
        world.sandbox.pay(co["order_id"])
    world.sandbox.store.clear_faults()
    recorded = world.checkout("user_r")
    world.sandbox.store.add_fault("provider", "503", path="record_payment", count=-1)
    world.sandbox.pay(recorded["order_id"])  # activated; its payment not yet on the provider's invoice
    world.sandbox.store.clear_faults()
    orphaned = [world.checkout(f"user_x{n}") for n in range(2)]  # two of each failure: each is counted
    with world.c.uow() as uow:
        for co in orphaned:
            uow.subscriptions.set(co["subscription_id"], activation_pending_since=world.c.clock.now())
        uow.commit()
    refused = [world.checkout(f"user_v{n}") for n in range(2)]
    for co in refused:
        world.sandbox.pay(co["order_id"], drop_webhook=True)
        invoice = world.sandbox.start_future_subscription(co["subscription_id"], world.sandbox.now())["invoice"]
        # the provider will refuse to record the payment on it, for a reason it does not explain as paid
        world.sandbox.store.add_fault("provider", "400", path=f"/invoices/{invoice['id']}/record_payment", count=-1)
        assert record_payment(world.c, world.sandbox.store.all("payment")[-1], "cli")["provider_recorded"] is False
    assert {r["id"] for r in pending_activations(world.c)} == {
        *(co["subscription_id"] for co in done + orphaned + refused), recorded["subscription_id"]}
    assert retry_pending(world.c) == {"completed": 3, "failed": 4}
