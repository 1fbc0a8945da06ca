"""Flows on the sandbox made faithful to the real provider and orchestrator: the order id of a future
subscription, the invoice its start generates, asynchronous renewal charges, payment summaries,
a catalog with foreign item prices, both systems' error shapes, and disputes in their real shape.
Each test judges from the outside world's books (the sandbox's invoices and payments) too."""

import logging
import threading

import pytest
from sqlalchemy import event, select

from billingctl.adapters.db.tables import checkout_session, dunning_attempt, fraud_event, purchase
from billingctl.domain import errors as e
from billingctl.services import catalog, orphans
from billingctl.services.checkout import checkout_status
from billingctl.services.payments import pending_activations, record_payment, retry_pending
from billingctl.services.renewals import run_renewals
from tests.helpers import term_runs_out

pytestmark = pytest.mark.integration
PRO, NSFW = "credits-pro-USD-monthly", "credits-pro-nsfw-USD-monthly"


def rows(world, table, **where):
    with world.c.uow() as uow:
        query = select(table)
        for k, v in where.items():
            query = query.where(table.c[k] == v)
        return [dict(r) for r in uow.execute(query).mappings()]


def charges_for(world, order_id):
    return [p for p in world.sandbox.store.all("payment") if p["orderId"] == order_id]


def renewal_in_flight(world, status):
    """A paid checkout whose renewal comes due, charged by one tick and answered `status` (not final)."""
    co = world.checkout()
    world.sandbox.pay(co["order_id"])
    term_runs_out(world.sandbox, co["subscription_id"])
    invoice = world.sandbox.renew_due()[0]
    world.sandbox.async_charges(status)
    assert run_renewals(world.c)["outcomes"] == {"pending": 1}
    [charge] = charges_for(world, invoice["id"])
    return invoice, charge


# ---- the order id of a future subscription, and the invoice its start generates ----------------------

def test_the_order_id_is_the_subscription_and_activation_pays_the_invoice_it_generates(world):
    co = world.checkout()
    assert co["order_id"] == co["subscription_id"]
    assert world.sandbox.store.all("invoice") == []  # the provider invoices a future subscription when it starts
    assert checkout_status(world.c, "user_a", co["order_id"])["status"] == "pending"
    payment = world.sandbox.pay(co["order_id"])  # webhook: recorded, started, recorded on the new invoice
    invoices = world.sandbox.store.all("invoice")
    assert [(i["subscription_id"], i["status"]) for i in invoices] == [(co["subscription_id"], "paid")]
    txn = world.sandbox.store.get("transaction", invoices[0]["linked_payments"][0]["txn_id"])
    assert txn["reference_number"] == payment["id"]
    [bought] = rows(world, purchase)
    assert bought["invoice_id"] == invoices[0]["id"] and bought["provider_recorded_at"] is not None
    assert rows(world, checkout_session)[0]["invoice_id"] == invoices[0]["id"]
    # The front end's order id, and the invoice id, both answer.
    assert checkout_status(world.c, "user_a", co["order_id"])["status"] == "paid"
    assert checkout_status(world.c, "user_a", invoices[0]["id"])["status"] == "paid"
    # Nothing is left payment_due for the dunning tick: it charges nothing.
    assert run_renewals(world.c)["outcomes"] == {}
    assert len(world.sandbox.store.all("payment")) == 1


def test_a_start_whose_answer_was_lost_is_read_back_and_the_invoice_found(world):
    co = world.checkout()
    world.sandbox.store.add_fault("provider", "error_after_effect", path="update_for_items", count=1)
    with world.c.provider.http.attempts(1):
        result = record_payment(world.c, world.sandbox.pay(co["order_id"], drop_webhook=True), "cli")
    assert result["activation"] == "pending"
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "active"  # it did start
    assert run_renewals(world.c)["outcomes"] == {"activation_pending": 1}  # its first invoice is not a renewal
    assert retry_pending(world.c) == {"completed": 1, "failed": 0}
    assert [i["status"] for i in world.sandbox.store.all("invoice")] == ["paid"]
    assert pending_activations(world.c) == [] and world.credits() == 2000


def test_an_activation_committed_between_the_dunning_ticks_reads_never_charges_the_first_invoice(world):
    """CI, month in separate processes, seed 7, day 8: the activations job assigned a checkout's first invoice
    while the renewals job, which had listed it payment_due, was reading whether it is a renewal. Its reads
    were separate statements: the purchase paying the invoice, read before the commit, was not there yet;
    the purchase waiting for its invoice, read after it, was gone; so the invoice looked like a renewal and
    was charged a second time (one term credited twice; reconcile named it)."""
    co = world.checkout()
    world.sandbox.store.add_fault("provider", "error_after_effect", path="update_for_items", count=1)
    with world.c.provider.http.attempts(1):
        checkout_payment = world.sandbox.pay(co["order_id"], drop_webhook=True)
        assert record_payment(world.c, checkout_payment, "cli")["activation"] == "pending"
    [first] = world.sandbox.store.all("invoice")
    assert first["status"] == "payment_due"  # started at the provider; not yet assigned here
    activation = threading.Thread(target=retry_pending, args=(world.c,))

    def activation_commits_between_reads(conn, cursor, statement, *args):
        if "FROM purchase" in statement and not activation.is_alive() and activation.ident is None:
            activation.start()  # the activations job, in its own connection, while the tick reads
            if world.c.engine.dialect.name != "sqlite":  # SQLite: the tick's transaction holds the database,
                activation.join()  # and the activation commits once it ends

    event.listen(world.c.engine, "after_cursor_execute", activation_commits_between_reads)
    try:
        outcomes = run_renewals(world.c)["outcomes"]
    finally:
        event.remove(world.c.engine, "after_cursor_execute", activation_commits_between_reads)
        activation.join()
    assert activation.ident is not None
    assert outcomes in ({"activation_pending": 1}, {"already_paid": 1}, {"not_a_renewal": 1})
    assert [p["id"] for p in world.sandbox.store.all("payment")] == [checkout_payment["id"]]  # never charged again
    assert world.sandbox.invoice(first["id"])["status"] == "paid"
    assert [r["transaction_id"] for r in rows(world, purchase)] == [checkout_payment["id"]]
    assert world.credits() == 2000


def test_a_refusal_that_is_not_already_paid_leaves_the_report_pending(world):
    co = world.checkout()
    world.sandbox.pay(co["order_id"], drop_webhook=True)
    invoice = world.sandbox.start_future_subscription(co["subscription_id"], world.sandbox.now())["invoice"]
    # refused for a reason the provider does not explain as paid (a voided invoice is refunded: decision 113)
    world.sandbox.store.add_fault("provider", "400", path=f"/invoices/{invoice['id']}/record_payment", count=-1)
    payment = world.sandbox.store.all("payment")[0]
    result = record_payment(world.c, payment, "cli")
    assert result["provider_recorded"] is False
    [bought] = rows(world, purchase)
    assert bought["invoice_id"] == invoice["id"] and bought["provider_recorded_at"] is None
    assert [p["id"] for p in pending_activations(world.c)] == [co["subscription_id"]]  # shown by health
    assert world.credits() == 2000


# ---- asynchronous merchant-initiated charges ------------------------------------------------------------

def test_an_in_flight_renewal_charge_is_never_charged_again(world):
    invoice, charge = renewal_in_flight(world, "PENDING")
    for _ in range(3):  # the next ticks see the charge in flight and wait
        assert run_renewals(world.c)["outcomes"] == {"in_flight": 1}
    world.sandbox.finish_payment(charge["id"], settle=True)  # PAYMENT.STATUS SETTLED arrives
    assert world.purchases(charge["id"]) == 1 and world.credits() == 4000
    assert run_renewals(world.c)["outcomes"] == {}  # the invoice is paid: no longer listed as payment_due
    assert len(charges_for(world, invoice["id"])) == 1
    assert world.sandbox.invoice(invoice["id"])["status"] == "paid"


def test_an_in_flight_charge_declined_without_a_webhook_is_read_on_the_next_tick(world):
    invoice, charge = renewal_in_flight(world, "SETTLING")
    world.sandbox.finish_payment(charge["id"], settle=False, drop_webhook=True)
    assert run_renewals(world.c)["outcomes"] == {"declined": 1}
    statuses = [r["status"] for r in rows(world, dunning_attempt, invoice_id=invoice["id"])]
    assert statuses == ["pending", "declined"]
    assert run_renewals(world.c)["outcomes"] == {"not_due": 1}  # the retry schedule waits an hour
    assert len(charges_for(world, invoice["id"])) == 1 and world.credits() == 2000


# ---- payment summaries in the orchestrator's list -------------------------------------------------------

def test_the_settled_payments_poller_reads_the_full_payment_before_recording(world, caplog):
    co = world.checkout("user_n", NSFW)
    payment = world.sandbox.pay(co["order_id"], drop_webhook=True)
    world.sandbox.hold_webhooks()  # its refund report is lost too (a report alone would record it)
    world.sandbox.refund(payment["id"], 1000)  # partly refunded before we ever saw it
    summary = next(world.c.orchestrator.list_payments("SETTLED"))
    assert summary.is_summary and "customerId" not in summary.wire() and "paymentMethod" not in summary.wire()
    assert summary.processor.amount_refunded is None
    with caplog.at_level(logging.INFO, logger="billingctl.checkout"):
        assert orphans.handle_payment(world.c, summary) == "recorded"
    assert world.credits("user_n") == 3000 - (3000 * 1000) // 2999  # the refund's share is reversed
    [marker] = [r for r in caplog.records if r.getMessage() == "nsfw_checkout_set_primary"]
    assert marker.user_id == "user_n"
    default = [i for i in world.sandbox.instruments("user_n") if i["default"]]
    assert [i["token"] for i in default] == [payment["paymentMethod"]["paymentMethodToken"]]


# ---- a real catalog ---------------------------------------------------------------------------------------

def test_products_skip_addons_charges_and_plans_without_our_metadata(world, caplog):
    with caplog.at_level(logging.WARNING, logger="billingctl.catalog"):
        listed = [p["id"] for p in catalog.products(world.c)]
        catalog.products(world.c)  # cached: logged once per catalog read
    assert listed == ["credits-basic-USD-monthly", "credits-pro-USD-monthly", "credits-pro-nsfw-USD-monthly",
                      "credits-max-nsfw-USD-monthly"]
    skipped = [r for r in caplog.records if "without valid metadata" in r.getMessage()]
    assert len(skipped) == 1 and skipped[0].item_price_ids == ["legacy-team-USD-monthly"]
    calls = world.sandbox.store.count_requests("provider", "GET", "/item_prices")
    assert calls == 1


# ---- error shapes -----------------------------------------------------------------------------------------

def test_orchestrator_errors_are_read_from_their_nested_shape(world):
    with pytest.raises(e.ExternalNotFound) as info:
        world.c.orchestrator.refund_payment("pay_nope")
    assert info.value.message == "orchestrator: Payment pay_nope not found"
    assert info.value.details["api_error_code"] == "resource_not_found"


# ---- disputes in the orchestrator's real shape -------------------------------------------------------------

def test_a_dispute_in_the_real_flat_shape_is_recorded_once(world):
    co = world.checkout()
    payment = world.sandbox.pay(co["order_id"])
    sent = world.sandbox.open_dispute(payment["id"])
    assert sent["delivered"] == 200 and "signedAt" not in sent["dispute"] and "payment" not in sent["dispute"]
    [signal] = rows(world, fraud_event, event_type="dispute_opened")
    assert signal["user_id"] == "user_a" and signal["metadata"]["amount"] == 1999
    assert signal["metadata"]["dispute_id"] == sent["dispute"]["processorDisputeId"]
    # A replay of the same delivery is a no-op (deduplicated on the dispute id).
    import json

    body = json.dumps(sent["dispute"]).encode()
    assert world.sandbox._deliver_raw("/webhooks/orchestrator/disputes", body) == 200
    assert len(rows(world, fraud_event, event_type="dispute_opened")) == 1
    # The dashboard's test webhook is answered 200 and ignored.
    assert world.sandbox._deliver_raw("/webhooks/orchestrator/disputes", b'{"eventType": "TEST"}') == 200
    assert len(rows(world, fraud_event)) == 1


# ---- the sandbox serves its lists in O(page) -----------------------------------------------------------

@pytest.mark.parametrize("kind, filters, sort", [
    ("event", [("occurred_at", ">", 1)], "occurred_at"),
    ("subscription", [("updated_at", ">", 1)], "updated_at"),
    ("invoice", [("status", "=", "payment_due")], None),
    ("invoice", [("subscription_id", "=", "sub_1")], None),
    ("item_price", [("item_type", "=", "plan")], None),
    ("payment", [], None),
])
def test_sandbox_lists_search_an_index_never_scan_every_object(world, kind, filters, sort):
    plan = world.sandbox.store.page(kind, filters, sort, 0, 100, plan=True)[0]
    assert plan and all(step.startswith("SEARCH objects USING INDEX") for step in plan), plan
