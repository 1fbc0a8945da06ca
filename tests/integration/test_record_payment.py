"""record_payment: exactly once from every path, concurrently, across processes; activation."""

import json
import subprocess
import sys
import textwrap
import threading

import pytest
from sqlalchemy import select

from billingctl.adapters.db.tables import event_inbox, subscription, transaction
from billingctl.bootstrap import Container
from billingctl.domain import errors as e
from billingctl.domain.clock import parse_time
from billingctl.sandbox.model import sign_body
from billingctl.services.payments import activate_subscription, record_payment, retry_pending
from webhooks_app import create_internal_app, create_public_app

pytestmark = pytest.mark.integration


def test_webhook_records_credits_locks_and_activates(world):
    co = world.checkout()
    payment = world.sandbox.pay(co["order_id"])  # delivers the signed webhook to the public app
    assert world.purchases(payment["id"]) == 1
    assert world.credits() == 2000
    assert world.provider_record_calls() == 1
    with world.c.uow() as uow:
        status = uow.execute(select(subscription.c.status).where(subscription.c.id == co["subscription_id"])).scalar()
        txn = uow.execute(select(transaction.c.status, transaction.c.processor)).one()
    assert status == "active"
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "active"
    assert tuple(txn) == ("captured", "SFW_STRIPE")
    m = world.c.metrics
    labels = {"lane": "sfw", "psp": "SFW_STRIPE", "outcome": "locked"}
    assert m.sample("billing_processor_lock_outcome_total", labels) == 1
    assert m.sample("payment_recording_latency_seconds_count") == 1


def test_every_path_and_every_duplicate_records_once(world):
    co = world.checkout()
    payment = world.sandbox.pay(co["order_id"], duplicates=3)
    for path in ("event_poller", "settled_poller", "workflow_callback", "cli"):
        assert record_payment(world.c, payment, path)["outcome"] == "duplicate"
    assert world.purchases() == 1
    assert world.credits() == 2000
    assert world.provider_record_calls() == 1
    with world.c.uow() as uow:
        # the authorization's report, then three deliveries of the settle's: one inbox row for each status
        assert len(uow.execute(select(event_inbox)).all()) == 2


def test_concurrent_paths_from_threads_record_once(world):
    co = world.checkout()
    payment = world.settle(co["order_id"])
    body = world.sandbox.webhook_body("PAYMENT.STATUS", payment)
    headers = {"X-Signature-Primary": sign_body(
        world.c.settings.secret("orchestrator_webhook_secret"), body), "Content-Type": "application/json"}
    app = create_public_app(container=world.c)
    barrier = threading.Barrier(5)
    errors = []

    def webhook():
        barrier.wait()
        response = app.test_client().post("/webhooks/orchestrator/payments", data=body, headers=headers)
        if response.status_code != 200:
            errors.append(response.get_data(as_text=True))

    def poller(path):
        barrier.wait()
        record_payment(world.c, payment, path)

    threads = [threading.Thread(target=webhook) for _ in range(3)]
    threads += [threading.Thread(target=poller, args=(p,)) for p in ("event_poller", "settled_poller")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert world.purchases() == 1
    assert world.credits() == 2000
    assert world.provider_record_calls() == 1


WORKER = textwrap.dedent("""
    import json, sys
    from billingctl.bootstrap import Container
    from billingctl.settings import load_settings
    from billingctl.services.payments import record_payment
    c = Container(load_settings(database_url=sys.argv[1], redis_url=sys.argv[2], sandbox_db=sys.argv[3]))
    payment = json.loads(sys.argv[4])
    outcomes = [record_payment(c, payment, path)["outcome"] for path in ("event_poller", "settled_poller", "cli")]
    print(json.dumps(outcomes))
""")


def test_two_os_processes_record_once(world, redis_url):
    co = world.checkout()
    payment = world.settle(co["order_id"])
    s = world.c.settings
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, s.database_url, redis_url, s.sandbox_db,
                               json.dumps(payment)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    outcomes = sorted(o for out, _ in outputs for o in json.loads(out))
    assert outcomes.count("recorded") == 1 and outcomes.count("duplicate") == 5
    assert world.purchases() == 1
    assert world.credits() == 2000
    assert world.provider_record_calls() == 1


def test_two_different_payments_of_one_user_racing_are_both_credited(world):
    first, second = world.checkout(item_price_id="credits-basic-USD-monthly"), world.checkout()
    payments = [world.settle(first["order_id"]), world.settle(second["order_id"])]
    barrier = threading.Barrier(2)

    def go(p):
        barrier.wait()
        record_payment(world.c, p, "webhook")

    threads = [threading.Thread(target=go, args=(p,)) for p in payments]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert world.purchases() == 2
    assert world.credits() == 1000 + 2000


def test_redis_down_never_breaks_exactly_once(make_settings, db_url):
    c = Container(make_settings(database_url=db_url, redis_url="redis://127.0.0.1:1/0"))
    from tests.integration.conftest import World

    world = World(c)
    co = world.checkout()
    payment = world.settle(co["order_id"])
    assert record_payment(c, payment, "webhook")["outcome"] == "recorded"
    assert record_payment(c, payment, "event_poller")["outcome"] == "duplicate"
    assert world.credits() == 2000
    c.close()


def test_activation_requires_a_recorded_payment(world):
    co = world.checkout()
    with pytest.raises(e.PaymentNotRecorded) as info:
        activate_subscription(world.c, co["subscription_id"])
    assert info.value.message == (f"no purchase exists for subscription {co['subscription_id']}: "
                                  "the payment was never recorded")
    client = create_internal_app(container=world.c).test_client()
    response = client.post("/internal/billing/activate", json={"subscription_id": co["subscription_id"]},
                           headers={"Authorization": "Bearer test-internal-token"})
    assert response.status_code == 409 and response.get_json()["error"] == "payment_not_recorded"
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "future"


def test_activating_an_active_subscription_is_a_no_op(world):
    co = world.checkout()
    world.sandbox.pay(co["order_id"])
    calls = world.sandbox.store.count_requests("provider")
    assert activate_subscription(world.c, co["subscription_id"])["outcome"] == "already_active"
    assert world.sandbox.store.count_requests("provider") == calls  # answered from the local copy


def test_a_failed_activation_keeps_the_payment_and_is_retried(world):
    from billingctl.services.health import health_report

    co = world.checkout()
    world.sandbox.store.add_fault("provider", "503", path="update_for_items", count=1)
    payment = world.sandbox.pay(co["order_id"])  # the webhook makes one attempt per provider call
    assert world.purchases(payment["id"]) == 1 and world.credits() == 2000
    with world.c.uow() as uow:
        row = uow.execute(select(subscription).where(subscription.c.id == co["subscription_id"])).mappings().one()
    assert row["status"] == "future" and row["activation_pending_since"] is not None
    checks = {ch["name"]: ch for ch in health_report(world.c)["checks"]}
    assert checks["pending_activations"]["ok"] is False
    # Found by the runbook tests (issue 38 item 8): the ActivationErrorsHigh runbook reads the subscription
    # ids and errors from `health`, whose table showed only a count.
    assert checks["pending_activations"]["detail"].startswith(
        f"1 recorded payment(s) waiting for activation: {co['subscription_id']} (")
    assert world.c.metrics.sample("billing_activation_errors_total") == 1

    assert retry_pending(world.c) == {"completed": 1, "failed": 0}
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "active"
    checks = {ch["name"]: ch for ch in health_report(world.c)["checks"]}
    assert checks["pending_activations"]["ok"] is True
    assert world.credits() == 2000


def test_a_non_settled_status_updates_the_transaction(world):
    client = create_public_app(container=world.c).test_client()
    from billingctl.sandbox.model import sign_body

    for status, expected in (("AUTHORIZED", "authorized"), ("DECLINED", "declined")):
        body = world.sandbox.webhook_body("PAYMENT.STATUS", {"id": "pay_d1", "status": status, "amount": 999,
                                                             "customerId": "user_a", "orderId": "inv_x"})
        sig = sign_body(world.c.settings.secret("orchestrator_webhook_secret"), body)
        assert client.post("/webhooks/orchestrator/payments", data=body,
                           headers={"X-Signature-Primary": sig}).status_code == 200
        with world.c.uow() as uow:
            assert uow.execute(select(transaction.c.status)).scalar_one() == expected
    assert world.purchases() == 0  # nothing recorded, no credits: no ledger row exists


def test_reordered_webhooks_still_record_once(world):
    """A DECLINED status arriving after SETTLED never downgrades a captured transaction."""
    co = world.checkout()
    world.sandbox.hold_webhooks()
    payment = world.sandbox.pay(co["order_id"], duplicates=2)  # AUTHORIZED, then SETTLED twice
    assert world.purchases() == 0
    statuses = world.sandbox.release_webhooks("reverse")  # the two SETTLED first, AUTHORIZED last
    assert statuses == [200, 200, 200]
    assert world.purchases() == 1 and world.credits() == 2000
    with world.c.uow() as uow:
        assert uow.execute(select(transaction.c.status)).scalar_one() == "captured"
    world.sandbox.send_webhook("PAYMENT.STATUS", {**payment, "status": "DECLINED"})
    with world.c.uow() as uow:
        assert uow.execute(select(transaction.c.status)).scalar_one() == "captured"


def test_a_payment_recorded_after_its_refund_is_reversed_at_once(world):
    """A late poller records a payment the customer was already refunded for: credits net to zero."""
    co = world.checkout()
    payment = world.settle(co["order_id"])
    world.sandbox.hold_webhooks()  # the refund webhook is lost too
    world.sandbox.refund(payment["id"])
    world.sandbox.store.set_meta("held_webhooks", [])
    result = record_payment(world.c, world.sandbox.store.get("payment", payment["id"]), "settled_poller")
    assert result["refund"]["credits_reversed"] == 2000
    assert world.credits() == 0


def test_a_dry_run_activation_answers_what_it_would_do_and_starts_nothing(world):
    """`billingctl subscriptions activate --dry-run` on a paid subscription whose activation failed: every
    check passes, the answer says it would activate, and the subscription stays as it was, here and at the
    provider. Written against the survivors of `make mutation`."""
    co = world.checkout()
    world.sandbox.store.add_fault("provider", "503", path="update_for_items", count=-1)
    world.sandbox.pay(co["order_id"])  # recorded; its activation fails
    world.sandbox.store.clear_faults()
    sub = co["subscription_id"]
    assert activate_subscription(world.c, sub, dry_run=True) == {
        "subscription_id": sub, "outcome": "would_activate", "dry_run": True, "status": "future"}
    with world.c.uow() as uow:
        assert uow.subscriptions.get(sub)["status"] == "future"
    assert world.c.provider.get_subscription(sub).status == "future"
    assert activate_subscription(world.c, sub)["outcome"] != "would_activate"



def test_activating_a_paid_subscription_cancelled_since_never_starts_it_again(one_try_world):
    """A subscription started by its checkout's payment, then cancelled at the provider (and synced), is
    activated again (an operator's `billingctl subscriptions activate`, or the follow-ups of a later
    payment) within the same second: it stays cancelled, here and at the provider. Before the fix the
    start was sent again with the same idempotency key, the provider replayed its first answer ("active")
    and the local copy was written back to active. Found by the mutation run (`… or bought.invoice_id`)."""
    from billingctl.services.sync import sync_subscription

    world = one_try_world
    co = world.checkout()
    sub = co["subscription_id"]
    world.sandbox.pay(co["order_id"])  # recorded and activated: the first term's invoice is assigned
    assert world.sandbox.subscription(sub)["status"] == "active"
    world.sandbox.cancel(sub)
    sync_subscription(world.c, sub)
    calls = world.sandbox.store.count_requests("provider")
    assert activate_subscription(world.c, sub) == {
        "subscription_id": sub, "outcome": "cancelled_at_provider", "status": "cancelled"}
    with world.c.uow() as uow:
        assert uow.subscriptions.get(sub)["status"] == "cancelled"
    assert world.sandbox.subscription(sub)["status"] == "cancelled"
    # One call: the provider's copy read; no start sent
    assert world.sandbox.store.count_requests("provider") == calls + 1
    assert world.sandbox.store.count_requests("provider", "GET", f"/subscriptions/{sub}") >= 1
    assert world.purchases() == 1 and world.credits() == 2000


def test_activating_a_started_subscription_whose_local_copy_lags_takes_the_providers_copy(one_try_world):
    """A started subscription (its first invoice assigned) whose local copy does not say active, e.g. a
    restored backup: activation sends no second start; it takes the provider's copy and answers
    `already_active` (decision 101)."""
    world = one_try_world
    co = world.checkout()
    sub = co["subscription_id"]
    world.sandbox.pay(co["order_id"])
    with world.c.uow() as uow:
        uow.subscriptions.set(sub, status="future", current_term_end=None)
        uow.commit()
    calls = world.sandbox.store.count_requests("provider")
    assert activate_subscription(world.c, sub) == {
        "subscription_id": sub, "outcome": "already_active", "status": "active"}
    remote = world.sandbox.subscription(sub)
    with world.c.uow() as uow:
        local = uow.subscriptions.get(sub)
    assert local["status"] == "active" and local["activation_pending_since"] is None
    assert local["current_term_end"] is not None
    assert int(local["current_term_end"].timestamp()) == remote["current_term_end"]
    assert world.sandbox.store.count_requests("provider") == calls + 1  # the read; no start, no invoice search


def _started_then_held_by_the_provider_as(world, status: str) -> str:
    """A paid, started subscription that the provider now holds in `status` while the local copy says
    future (nothing in the sandbox pauses a subscription, so its copy is set directly)."""
    co = world.checkout()
    sub = co["subscription_id"]
    world.sandbox.pay(co["order_id"])
    world.sandbox.store.put("subscription", sub, {**world.sandbox.subscription(sub), "status": status})
    with world.c.uow() as uow:
        uow.subscriptions.set(sub, status="future")
        uow.commit()
    return sub


def test_activating_a_started_subscription_paused_at_the_provider_takes_its_copy_and_leaves_nothing_pending(
        one_try_world):
    """A started subscription the provider holds paused was started: activation sends no start, takes the
    provider's copy (paused; the local future -> paused is the provider's, counted and alerted as a step
    the table does not know) and leaves nothing pending (decision 193; decision 101 left it pending with
    its error, asked the provider again on every activations run, and reconcile named it every day)."""
    world = one_try_world
    sub = _started_then_held_by_the_provider_as(world, "paused")
    assert activate_subscription(world.c, sub) == {"subscription_id": sub, "outcome": "already_active",
                                                   "status": "paused"}
    with world.c.uow() as uow:
        local = uow.subscriptions.get(sub)
    assert (local["status"], local["activation_pending_since"], local["activation_error"]) == ("paused", None, None)
    assert world.c.metrics.sample("billing_activation_errors_total") == 0


def test_activating_a_started_subscription_the_provider_holds_future_is_refused_and_stays_visible(one_try_world):
    """A subscription the provider holds future although its first invoice was assigned (a copy restored
    there) cannot be activated by a read: the activation fails with the provider's status named, is
    counted, and the local copy keeps the error for `health` (decision 101)."""
    world = one_try_world
    sub = _started_then_held_by_the_provider_as(world, "future")
    with pytest.raises(e.ExternalError) as raised:
        activate_subscription(world.c, sub)
    assert raised.value.message == f"the provider holds {sub} future: it cannot be activated"
    assert raised.value.details == {"dependency": "subscription_provider"}
    with world.c.uow() as uow:
        local = uow.subscriptions.get(sub)
    assert (local["status"], local["activation_error"]) == ("future", raised.value.message)
    assert world.c.metrics.sample("billing_activation_errors_total") == 1


def test_a_retried_activation_answers_whole_and_stamps_its_sync(one_try_world):
    """The activations job finishes an activation that failed when the payment was recorded: the answer
    names the subscription, `activated` and the provider's status; the local copy takes the provider's
    term, leaves "activation pending", and its sync time is the activation's."""
    from tests.conftest import advance_with_sandbox

    world = one_try_world
    co = world.checkout()
    sub = co["subscription_id"]
    world.sandbox.store.add_fault("provider", "503", path="update_for_items", count=-1)
    world.sandbox.pay(co["order_id"])
    world.sandbox.store.clear_faults()
    advance_with_sandbox(world.c, 60)
    assert activate_subscription(world.c, sub) == {"subscription_id": sub, "outcome": "activated", "status": "active"}
    remote = world.sandbox.subscription(sub)
    with world.c.uow() as uow:
        local = uow.subscriptions.get(sub)
    assert (local["status"], local["activation_pending_since"], local["activation_error"]) == ("active", None, None)
    assert int(local["current_term_end"].timestamp()) == remote["current_term_end"]
    assert local["synced_at"].timestamp() == pytest.approx(world.c.clock.now().timestamp(), abs=0.001)


def test_a_paid_checkout_cancelled_before_its_activation_is_handed_over_without_asking_the_provider(one_try_world):
    """The payment was recorded but its activation failed, and the checkout was cancelled at the provider
    since (the local copy synced): activation hands the payment to orphan recovery (an orphan row it retries)
    from the local copy, with no call to the provider."""
    from billingctl.services.sync import sync_subscription

    world = one_try_world
    co = world.checkout()
    sub = co["subscription_id"]
    world.sandbox.store.add_fault("provider", "503", path="update_for_items", count=-1)
    payment = world.sandbox.pay(co["order_id"])
    world.sandbox.store.clear_faults()
    world.sandbox.cancel(sub)
    sync_subscription(world.c, sub)
    calls = world.sandbox.store.count_requests("provider")
    assert activate_subscription(world.c, sub) == {
        "subscription_id": sub, "outcome": "cancelled_at_provider", "status": "cancelled"}
    assert world.sandbox.store.count_requests("provider") == calls
    with world.c.uow() as uow:
        local = uow.subscriptions.get(sub)
        orphan = uow.orphans.status(payment["id"])
    assert (local["status"], local["activation_pending_since"]) == ("cancelled", None)
    assert orphan == "retrying"  # orphan recovery's: re-subscribe or refund


def test_an_activation_error_is_kept_to_its_first_500_characters(one_try_world):
    """Whatever the provider answers, the local copy keeps a bounded error for `health`: a status longer than
    any the provider documents (and than its column) is refused where the answer is read (decision 122)."""
    world = one_try_world
    sub = _started_then_held_by_the_provider_as(world, "p" * 600)
    with pytest.raises(e.ExternalPayloadInvalid, match="invalid subscription status") as raised:
        activate_subscription(world.c, sub)
    with world.c.uow() as uow:
        kept = uow.subscriptions.get(sub)["activation_error"]
    assert kept == raised.value.message[:500] and len(kept) <= 500


def test_a_recorded_renewal_payments_transaction_names_its_invoice(world):
    """The transaction row of a payment that names its invoice keeps it (an orphan's move to a new
    subscription leaves a transaction on an invoice where it is), and the local invoice row is the
    subscription's, paid."""
    from billingctl.adapters.db.tables import invoice as invoice_table
    from billingctl.services import events

    co, invoice, payment = world.renewal_charged_unseen()
    assert record_payment(world.c, payment, "settled_poller")["outcome"] == "recorded"
    events.poll(world.c)  # the provider's copies of the invoice (issue 39: no read-back of our own)
    with world.c.uow() as uow:
        row = uow.execute(select(transaction.c.invoice_id, transaction.c.status).where(
            transaction.c.transaction_id == payment["id"])).one()
        local = uow.execute(select(invoice_table).where(invoice_table.c.id == invoice["id"])).mappings().one()
    assert tuple(row) == (invoice["id"], "captured")
    assert (local["subscription_id"], local["customer_id"], local["total_amount"], local["currency_code"],
            local["status"]) == (co["subscription_id"], "user_a", payment["amount"], "USD", "paid")
    # The provider's copy: paid when the workflow recorded it there (a second after the settle, on a slow run).
    assert local["paid_at"] == parse_time(world.sandbox.invoice(invoice["id"])["paid_at"])


def test_a_recorded_nsfw_payments_transaction_names_its_processor_and_merchant_account(world):
    """The merchant account on the transaction is what `lock backfill-mid` reads for legacy users."""
    from billingctl.adapters.payloads import Payment

    co = world.checkout("user_a", "credits-pro-nsfw-USD-monthly")
    payment = world.sandbox.pay(co["order_id"])
    processor, mid = Payment.read(payment).processor.name, Payment.read(payment).processor.merchant_id
    assert mid
    with world.c.uow() as uow:
        row = uow.execute(select(transaction.c.processor, transaction.c.processor_merchant_id).where(
            transaction.c.transaction_id == payment["id"])).one()
    assert tuple(row) == (processor, mid)
