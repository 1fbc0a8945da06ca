"""The orphan operator commands return exact documents (runbook scripts parse them with --json), write
exact rows and one audit row each, and refuse with exact messages; same-plan duplicates are refunded
with the reason an operator reads at the orchestrator. Written against the survivors of `make mutation`."""

import pytest
from sqlalchemy import select

from billingctl.adapters.db.tables import alert_outbox, audit_log
from billingctl.domain import errors as e
from billingctl.domain.lifecycle import ORPHAN
from billingctl.services import orphans
from tests.integration.test_orphans import chat_alerts, orphan, row
from tests.integration.test_orphans import world as world  # noqa: F401 - the fixture

pytestmark = pytest.mark.integration


def audits(world):
    with world.c.uow() as uow:
        return [tuple(r) for r in uow.execute(select(audit_log.c.actor, audit_log.c.action, audit_log.c.target,
                                                     audit_log.c.reason, audit_log.c.details)
                                              .order_by(audit_log.c.id)).all()]


def under_retry(world, user):
    """An orphan whose first recovery attempt failed (the provider down): status retrying."""
    _, payment = orphan(world, user)
    world.sandbox.store.add_fault("provider", "500", path="subscription_for_items", count=1)
    orphans.run_orphans(world.c)
    assert row(world, payment["id"])["status"] == "retrying"
    return payment


def resolution(world, payment_id):
    state = row(world, payment_id)
    return state["status"], state["resolution"], state["resolved_by"]


def test_resolve_refund_returns_its_plan_and_writes_the_row_the_refund_and_one_audit(world):
    payment = under_retry(world, "user_r")
    pid = payment["id"]
    plan = {"payment_id": pid, "action": "refund", "state": "retrying"}
    assert orphans.resolve(world.c, pid, "refund", "customer asked", "ops", dry_run=True) == {**plan, "dry_run": True}
    assert orphans.resolve(world.c, pid, "refund", "customer asked", "ops") == {**plan, "state": "resolved"}
    assert resolution(world, pid) == ("resolved", "refunded", "ops")
    refunds = world.sandbox.store.get("payment", pid)["refunds"]
    assert [(r["amount"], r["reason"]) for r in refunds] == [(payment["amount"], "duplicate charge")]
    assert audits(world) == [("ops", "orphans.resolve.refund", pid, "customer asked", plan)]
    for status in ("resolved", "recovered", "duplicate_refunded"):
        with world.c.uow() as uow:
            uow.orphans.move(pid, status, ORPHAN.states)  # planted
            uow.commit()
        with pytest.raises(e.Refused) as refused:
            orphans.resolve(world.c, pid, "mark-handled", "again", "ops")
        assert refused.value.message == f"payment {pid} is already {status}"


def test_resolve_mark_handled_and_create_subscription(world):
    handled = under_retry(world, "user_h")["id"]
    assert orphans.resolve(world.c, handled, "mark-handled", "refunded by finance", "ops2") == {
        "payment_id": handled, "action": "mark-handled", "state": "resolved"}
    assert resolution(world, handled) == ("resolved", "handled", "ops2")
    assert world.sandbox.store.get("payment", handled).get("refunds") in (None, [])

    created = under_retry(world, "user_c")["id"]
    assert orphans.resolve(world.c, created, "create-subscription", "user has nothing", "ops3") == {
        "payment_id": created, "action": "create-subscription", "state": "resolved"}
    assert resolution(world, created) == ("resolved", "resubscribed", "ops3")
    assert world.purchases(created) == 1 and world.credits("user_c") == 2000
    assert [a[1:3] for a in audits(world)] == [("orphans.resolve.mark-handled", handled),
                                                ("orphans.resolve.create-subscription", created)]


def test_resolve_refuses_with_exact_messages_and_changes_nothing(world):
    pid = under_retry(world, "user_x")["id"]
    cases = [(("refund", " "), e.InvalidInput, "a reason is required"),
             (("delete", "why"), e.InvalidInput, "choose one of --create-subscription, --refund, --mark-handled")]
    for (action, reason), kind, message in cases:
        with pytest.raises(kind) as refused:
            orphans.resolve(world.c, pid, action, reason, "ops")
        assert refused.value.message == message
    world.sandbox.refund(pid, 1)  # one cent refunded by someone at the orchestrator's console
    for action, message in (("refund", f"payment {pid} was already refunded (1)"),
                            ("create-subscription", f"payment {pid} was refunded: a subscription cannot be created "
                                                    "for it")):
        with pytest.raises(e.Refused) as refused:
            orphans.resolve(world.c, pid, action, "why", "ops")
        assert refused.value.message == message
    assert row(world, pid)["status"] == "retrying" and audits(world) == []


def test_show_and_retry_documents(world):
    pid = under_retry(world, "user_s")["id"]
    shown = orphans.show(world.c, pid)
    assert set(shown) == {"orphan", "payment", "user_subscriptions"}
    assert shown["orphan"]["payment_id"] == pid and shown["payment"]["id"] == pid
    assert [(s["status"], s["item_price_id"]) for s in shown["user_subscriptions"]] == [
        ("cancelled", "credits-pro-USD-monthly")]
    world.sandbox.store.add_fault("orchestrator", "500", path="/payments/", count=1)
    assert orphans.show(world.c, pid)["payment"] == {
        "unavailable": "orchestrator: internal error"}
    with pytest.raises(e.NotFound) as missing:
        orphans.show(world.c, "pay_unknown")
    assert missing.value.message == "no orphan record for payment pay_unknown"

    assert orphans.retry(world.c, pid, "ops") == {"payment_id": pid, "outcome": "recovered"}
    assert audits(world) == [("ops", "orphans.retry", pid, None, {"outcome": "recovered"})]
    with pytest.raises(e.Refused) as refused:
        orphans.retry(world.c, pid, "ops")
    assert refused.value.message == f"payment {pid} is recovered: nothing to retry"


def test_a_same_plan_duplicate_alerts_with_its_facts_and_is_refunded_once_with_a_reason(world):
    held = world.checkout()
    world.sandbox.pay(held["order_id"])  # the user already holds the plan
    _, payment = orphan(world)
    assert orphans.run_orphans(world.c)["outcomes"] == {"recorded": 1, "duplicate_refunded": 1}
    state = row(world, payment["id"])
    assert (state["status"], state["resolution"]) == ("duplicate_refunded", "refunded")
    refunds = world.sandbox.store.get("payment", payment["id"])["refunds"]
    assert [(r["amount"], r["reason"]) for r in refunds] == [(payment["amount"], "duplicate charge")]
    [(key, alert)] = chat_alerts(world)
    assert key == f"orphan-duplicate:{payment['id']}"
    assert alert["text"] == "same-plan duplicate charge during orphan recovery"
    assert {f["title"]: f["value"] for f in alert["attachments"][0]["fields"]} == {
        "payment_id": payment["id"], "user_id": "user_a", "plan": "credits-pro-USD-monthly",
        "active_subscription": held["subscription_id"]}
    assert orphans.refund(world.c, payment["id"]).refunded == payment["amount"]
    assert len(world.sandbox.store.get("payment", payment["id"])["refunds"]) == 1  # refunded in full: not again


def test_a_partly_refunded_same_plan_duplicate_is_refunded_for_the_rest(world):
    """Found through `make mutation`: the refund asked for the full amount, which the orchestrator refuses
    once part of it was refunded, so the duplicate was retried until exhausted and never refunded."""
    world.sandbox.pay(world.checkout()["order_id"])  # the user already holds the plan
    _, payment = orphan(world)
    world.sandbox.refund(payment["id"], 100)  # part of it refunded at the orchestrator's console
    assert orphans.run_orphans(world.c)["outcomes"] == {"recorded": 1, "duplicate_refunded": 1}
    refunds = world.sandbox.store.get("payment", payment["id"])["refunds"]
    assert [r["amount"] for r in refunds] == [100, payment["amount"] - 100]
    assert world.sandbox.store.get("payment", payment["id"])["processor"]["amountRefunded"] == payment["amount"]


def test_credits_of_a_recorded_orphan_are_reversed_by_its_refunded_amount(world):
    """_reverse_credits reads the orchestrator's cumulative refunded amount: a payment recorded (and
    credited) before it became an orphan loses exactly its refunded share."""
    from billingctl.services.payments import record_payment

    co = world.checkout()
    payment = world.settle(co["order_id"])
    record_payment(world.c, payment, "webhook")
    assert world.credits() == 2000
    refunded = world.sandbox.store.get("payment", payment["id"])  # refunded with no report reaching us
    refunded["processor"]["amountRefunded"] = payment["amount"] // 2
    world.sandbox.store.put("payment", payment["id"], refunded)
    orphans._reverse_credits(world.c, payment["id"])
    share = 2000 * (payment["amount"] // 2) // payment["amount"]
    assert world.credits() == 2000 - share
    with world.c.uow() as uow:
        keys = uow.execute(select(alert_outbox.c.payload).where(alert_outbox.c.sink == "analytics")).scalars().all()
    assert [k["path"] for k in keys if k["event"] == "payment_refunded"] == ["orphan_recovery"]
    with world.c.uow() as uow:
        sources = [r["source_key"] for r in uow.execute(select(audit_log)).mappings()]
    assert sources == []


def test_exhaustion_alerts_once_with_the_facts_and_keeps_the_last_error(world):
    _, payment = orphan(world, "user_e")
    world.sandbox.store.add_fault("provider", "500", path="subscription_for_items", count=-1)
    for _ in range(10):
        orphans.run_orphans(world.c)
        due = row(world, payment["id"])["next_attempt_at"]
        if due is not None:
            world.c.clock.set(due)
    state = row(world, payment["id"])
    assert (state["status"], state["attempts"], state["next_attempt_at"]) == ("exhausted", 10, None)
    assert state["last_error"].startswith("subscription_provider: POST /api/v2/customers/user_e/")
    [(key, alert)] = chat_alerts(world)
    assert key == f"orphan-exhausted:{payment['id']}"
    fields = {f["title"]: f["value"] for f in alert["attachments"][0]["fields"]}
    assert fields == {"payment_id": payment["id"], "user_id": "user_e", "attempts": "10",
                      "last_error": state["last_error"][:200]}


def test_a_manual_retry_ahead_of_schedule_counts_its_next_attempt_from_now(world):
    from billingctl.domain.backoff import orphan_retry_delay

    payment = under_retry(world, "user_m")
    world.sandbox.store.add_fault("provider", "500", path="subscription_for_items", count=-1)
    assert orphans.retry(world.c, payment["id"], "ops")["outcome"] == "retrying"  # its first retry is not due yet
    state = row(world, payment["id"])
    assert state["attempts"] == 2
    assert state["next_attempt_at"] == world.c.clock.now() + orphan_retry_delay(2)


def test_a_resubscribed_orphans_purchase_names_recovery_and_the_new_subscription(world):
    co, payment = orphan(world, "user_n")
    assert orphans.run_orphans(world.c)["outcomes"] == {"recovered": 1}
    new_sub = row(world, payment["id"])["subscription_id"]
    with world.c.uow() as uow:
        bought = uow.purchases.by_payment_id(payment["id"])
    assert (bought["recorded_via"], bought["subscription_id"], bought["user_id"], bought["item_price_id"]) == (
        "orphan_recovery", new_sub, "user_n", "credits-pro-USD-monthly")
    assert new_sub != co["subscription_id"]


def test_an_orphan_found_by_the_settled_poller_is_opened_with_the_payments_facts(world):
    from billingctl.domain.clock import parse_time

    co, payment = orphan(world, "user_o")
    world.sandbox.store.add_fault("provider", "500", path="subscription_for_items", count=1)
    orphans.run_orphans(world.c)
    state = row(world, payment["id"])
    assert (state["user_id"], state["subscription_id"], state["item_price_id"], state["amount"],
            state["currency_code"]) == ("user_o", co["subscription_id"], "credits-pro-USD-monthly",
                                        payment["amount"], "USD")
    assert state["settled_at"] == parse_time(payment["date"])


def test_an_unexpected_error_in_recovery_is_kept_on_the_row_and_retried(world, monkeypatch):
    payment = under_retry(world, "user_u")

    def broken(container, row, payment):
        raise RuntimeError("boom")

    monkeypatch.setattr(orphans, "_recover", broken)
    assert orphans.retry(world.c, payment["id"], "ops")["outcome"] == "retrying"
    state = row(world, payment["id"])
    assert (state["status"], state["attempts"], state["last_error"]) == ("retrying", 2, "RuntimeError: boom")


def test_a_frozen_users_orphan_waits_for_review_with_one_alert(world):
    from billingctl.services.users import freeze

    _, payment = orphan(world, "user_z")
    freeze(world.c, "user_z", "fraud review", "ops")
    assert orphans.run_orphans(world.c)["outcomes"] == {"needs_review": 1}
    state = row(world, payment["id"])
    assert (state["status"], state["last_error"]) == ("needs_review", "user is frozen")
    [(key, alert)] = chat_alerts(world)
    assert key == f"frozen-payment:{payment['id']}"
    assert {f["title"]: f["value"] for f in alert["attachments"][0]["fields"]} == {
        "payment_id": payment["id"], "user_id": "user_z"}


def test_an_operator_cannot_give_a_frozen_users_payment_a_subscription_until_they_are_unfrozen(world):
    """Found by the model-based exploration (2026-11-27): a payment held because its customer is frozen,
    resolved with --create-subscription while the account was still frozen, was recorded and credited (the
    recovery path skips recording's gates): credits after the freeze, which reconcile names. Refused now,
    as the alert says (refund it, or unfreeze and retry); unfrozen, the same command gives it its own."""
    from billingctl.services.users import freeze, unfreeze

    _, payment = orphan(world, "user_z")
    freeze(world.c, "user_z", "fraud review", "ops")
    assert orphans.run_orphans(world.c)["outcomes"] == {"needs_review": 1}
    with pytest.raises(e.Refused) as refused:
        orphans.resolve(world.c, payment["id"], "create-subscription", "customer asked", "ops")
    assert refused.value.message == (
        f"user user_z is frozen: unfreeze them first (billingctl users unfreeze user_z --reason R --yes), "
        f"or refund the payment (billingctl orphans resolve {payment['id']} --refund --reason R --yes)")
    assert world.credits("user_z") == 0 and world.purchases(payment["id"]) == 0
    assert row(world, payment["id"])["status"] == "needs_review"
    assert [a[1] for a in audits(world)] == ["user.freeze"]  # the refusal wrote nothing
    unfreeze(world.c, "user_z", "review passed", "ops")
    assert orphans.resolve(world.c, payment["id"], "create-subscription", "customer asked", "ops")["state"] == \
        "resolved"
    assert world.purchases(payment["id"]) == 1 and world.credits("user_z") == 2000


def test_a_freeze_made_while_recovery_re_subscribes_holds_the_payment_and_credits_nothing(world, monkeypatch):
    """Decision 177: recovery read the freeze once, then re-subscribed at the provider and recorded without
    recording's gates; a freeze made meanwhile was credited past. Recording now reads the freeze under the
    user's row on every path: the attempt fails, and the next one holds the payment for a person."""
    from billingctl.services.users import freeze

    _, payment = orphan(world, "user_z")
    record = orphans.record_payment

    def a_freeze_first(container, settled, path):
        freeze(world.c, "user_z", "fraud review", "ops")  # the operator, while recovery talks to the provider
        return record(container, settled, path)

    monkeypatch.setattr(orphans, "record_payment", a_freeze_first)
    assert orphans.run_orphans(world.c)["outcomes"] == {"retrying": 1}
    assert row(world, payment["id"])["last_error"] == (
        f"user user_z is frozen: unfreeze them first (billingctl users unfreeze user_z --reason R --yes), "
        f"or refund the payment (billingctl orphans resolve {payment['id']} --refund --reason R --yes)")
    assert world.credits("user_z") == 0 and world.purchases(payment["id"]) == 0
    monkeypatch.undo()
    assert orphans.retry(world.c, payment["id"], "ops")["outcome"] == "needs_review"
    assert world.credits("user_z") == 0 and world.purchases(payment["id"]) == 0
    assert [key for key, _ in chat_alerts(world)] == [f"frozen-payment:{payment['id']}"]


def test_a_non_renewing_subscription_of_the_plan_makes_the_orphan_a_duplicate(world):
    held = world.checkout()
    world.sandbox.pay(held["order_id"])
    remote = world.sandbox.subscription(held["subscription_id"])
    world.sandbox.store.put("subscription", held["subscription_id"], {**remote, "status": "non_renewing"})
    with world.c.uow() as uow:
        uow.subscriptions.set(held["subscription_id"], status="non_renewing")
        uow.commit()
    _, payment = orphan(world)
    assert orphans.run_orphans(world.c)["outcomes"] == {"recorded": 1, "duplicate_refunded": 1}


def test_a_resubscription_whose_activation_fails_says_so_and_completes_on_the_next_attempt(world):
    _, payment = orphan(world, "user_y")
    world.sandbox.store.add_fault("provider", "503", path="update_for_items", count=-1)
    assert orphans.run_orphans(world.c)["outcomes"] == {"retrying": 1}
    state = row(world, payment["id"])
    created = [s["id"] for s in world.sandbox.store.all("subscription") if s["customer_id"] == "user_y"][-1]
    assert state["last_error"].startswith(f"re-subscribed {created} but activation is pending: subscription_provider")
    world.sandbox.store.clear_faults()
    assert orphans.retry(world.c, payment["id"], "ops")["outcome"] == "recovered"
    assert (row(world, payment["id"])["resolution"], row(world, payment["id"])["subscription_id"]) == (
        "resubscribed", created)
    assert world.sandbox.subscription(created)["status"] == "active" and world.credits("user_y") == 2000


@pytest.mark.parametrize("by", ["activations job", "operator"])
def test_a_resubscription_activated_by_another_path_between_attempts_is_recovered_not_refunded(world, by):
    """The orphan's new subscription failed to activate; the activations job (or `billingctl activate`) then
    activated it, paid by the orphan's payment. The next orphan attempt must see its own work, not a
    same-plan duplicate to refund."""
    from billingctl.services.payments import activate_subscription, retry_pending

    _, payment = orphan(world, "user_y")
    world.sandbox.store.add_fault("provider", "503", path="update_for_items", count=-1)
    assert orphans.run_orphans(world.c)["outcomes"] == {"retrying": 1}
    created = [s["id"] for s in world.sandbox.store.all("subscription") if s["customer_id"] == "user_y"][-1]
    assert row(world, payment["id"])["last_error"] == (
        f"re-subscribed {created} but activation is pending: subscription_provider: POST /api/v2/subscriptions/"
        f"{created}/update_for_items failed but may have taken effect (subscription_provider: internal error)")
    world.sandbox.store.clear_faults()
    if by == "operator":
        assert activate_subscription(world.c, created)["outcome"] == "activated"
    else:
        assert retry_pending(world.c) == {"completed": 1, "failed": 0}
    world.advance(3600)
    assert orphans.run_orphans(world.c)["outcomes"] == {"recovered": 1}
    state = row(world, payment["id"])
    assert (state["status"], state["resolution"], state["subscription_id"]) == ("recovered", "resubscribed", created)
    assert world.sandbox.store.get("payment", payment["id"])["processor"]["amountRefunded"] == 0  # not refunded
    assert world.sandbox.subscription(created)["status"] == "active" and world.credits("user_y") == 2000
    assert not [a for a in chat_alerts(world) if "duplicate" in a[0]]


def test_the_settled_poller_reads_only_settled_payments_and_only_once(world):
    for user in ("user_1", "user_2"):
        world.sandbox.pay(world.checkout(user)["order_id"])
        world.advance(5)
    world.sandbox.decline_checkout(world.checkout("user_3")["order_id"])
    world.advance(16)
    assert orphans.run_orphans(world.c)["outcomes"] == {"recorded": 2}
    world.advance(60)
    # The cursor moved to the newest (the list's from_date is inclusive): only that one is read again.
    assert orphans.run_orphans(world.c)["outcomes"] == {"recorded": 1}


def test_the_settled_pollers_result_counts_done_failed_and_waiting_and_names_its_cursor(world):
    from billingctl.domain.clock import parse_time

    older = world.sandbox.pay(world.checkout("user_1")["order_id"])
    world.advance(5)
    _, stuck = orphan(world, "user_2")  # an orphan whose recovery will fail: it holds the cursor
    third = world.checkout("user_3")
    world.sandbox.store.add_fault("provider", "500", path="subscription_for_items", count=1)
    world.advance(1)
    fresh = world.sandbox.pay(third["order_id"])  # settled 0 s ago: too recent to judge
    result = orphans.run_orphans(world.c)
    assert result["outcomes"] == {"recorded": 1, "retrying": 1, "too_recent": 1}
    assert result["cursor"] == parse_time(stuck["date"]) < parse_time(fresh["date"])
    assert (result.outcome.done, result.outcome.failed, result.outcome.skipped) == (2, 0, 1)
    assert parse_time(older["date"]) < result["cursor"]
    world.sandbox.store.add_fault("orchestrator", "500", method="GET", path="/payments/", count=-1)
    world.advance(15 * 60)
    failing = orphans.run_orphans(world.c)
    assert failing["outcomes"] == {"error": 1, "recorded": 1}
    assert (failing.outcome.done, failing.outcome.failed, failing.outcome.skipped) == (1, 1, 0)
    world.sandbox.store.clear_faults()
    world.sandbox.store.add_fault("provider", "500", path="subscription_for_items", count=-1)
    world.advance(1)
    assert orphans.run_orphans(world.c)["outcomes"] == {"retrying": 1, "recorded": 1}


def test_the_settled_poller_reads_each_payment_whole_before_recording_it(world):
    """The list holds summaries without the refunded amount: a payment refunded with no report reaching us
    is recorded with its refund reversed, by the settled poller's path."""
    co = world.checkout("user_s")
    paid = world.settle(co["order_id"])
    stored = world.sandbox.store.get("payment", paid["id"])
    stored["processor"]["amountRefunded"] = paid["amount"] // 2
    world.sandbox.store.put("payment", paid["id"], stored)
    world.advance(16)
    assert orphans.run_orphans(world.c)["outcomes"] == {"recorded": 1}
    with world.c.uow() as uow:
        assert uow.purchases.by_payment_id(paid["id"])["recorded_via"] == "settled_poller"
    assert world.credits("user_s") == 2000 - 2000 * (paid["amount"] // 2) // paid["amount"]


def test_a_payment_for_a_checkout_cancelled_only_at_the_provider_is_an_orphan_for_the_settled_poller(world):
    co = world.checkout("user_c")
    world.sandbox.cancel(co["subscription_id"])  # our copy still says future
    paid = world.settle(co["order_id"])
    world.advance(16)
    assert orphans.run_orphans(world.c)["outcomes"] == {"recovered": 1}
    assert row(world, paid["id"])["resolution"] == "resubscribed"


def test_a_partly_refunded_orphan_waits_for_review_with_one_alert(world):
    _, payment = orphan(world, "user_p")
    stored = world.sandbox.store.get("payment", payment["id"])
    stored["processor"]["amountRefunded"] = 100  # part of it refunded at the console; no report reached us
    world.sandbox.store.put("payment", payment["id"], stored)
    assert orphans.run_orphans(world.c)["outcomes"] == {"needs_review": 1}
    state = row(world, payment["id"])
    assert (state["status"], state["last_error"]) == ("needs_review", "partially refunded (100)")
    [(key, alert)] = chat_alerts(world)
    assert key == f"orphan-partial:{payment['id']}"
    assert alert["text"] == f"Orphaned payment {payment['id']} is partially refunded - manual review required"


def test_a_resubscription_cancelled_between_attempts_fails_each_attempt_saying_so(world):
    _, payment = orphan(world, "user_y")
    world.sandbox.store.add_fault("provider", "503", path="update_for_items", count=-1)
    assert orphans.run_orphans(world.c)["outcomes"] == {"retrying": 1}
    created = [s["id"] for s in world.sandbox.store.all("subscription") if s["customer_id"] == "user_y"][-1]
    world.sandbox.store.clear_faults()
    world.sandbox.cancel(created)
    assert orphans.retry(world.c, payment["id"], "ops")["outcome"] == "retrying"
    state = row(world, payment["id"])
    assert (state["attempts"], state["last_error"]) == (
        2, f"re-subscribed {created} but its subscription was not activated: cancelled_at_provider")
    assert world.sandbox.store.get("payment", payment["id"])["processor"]["amountRefunded"] == 0


@pytest.mark.parametrize("action", ["mark-handled", "create-subscription"])
def test_a_second_charge_of_one_order_cannot_be_kept_by_an_operator(world, action):
    """Found by the model-based exploration (issue 36): one checkout paid twice in its payment form (the
    second a same-plan duplicate waiting for recovery's refund), then an operator marked the duplicate
    handled: it was never refunded and the customer stayed charged twice. Keeping a second charge of an
    order whose first stands is refused, naming the refund; the refund still works, and nothing changed."""
    co = world.checkout("user_twice")
    first = world.sandbox.pay(co["order_id"])
    second = world.sandbox.pay(co["order_id"])  # the same form paid again: held for recovery's refund
    assert row(world, second["id"])["status"] in ("retrying", "needs_review")
    with pytest.raises(e.Refused) as refused:
        orphans.resolve(world.c, second["id"], action, "customer asked", "ops")
    assert refused.value.message == (
        f"payment {second['id']} is a second charge of order {co['order_id']} (paid by {first['id']}): "
        f"--{action} would leave the customer charged twice; refund it "
        f"(billingctl orphans resolve {second['id']} --refund --reason R --yes)")
    assert row(world, second["id"])["status"] in ("retrying", "needs_review") and audits(world) == []
    orphans.resolve(world.c, second["id"], "refund", "charged twice", "ops")
    assert world.sandbox.store.get("payment", second["id"])["processor"]["amountRefunded"] == second["amount"]



def test_an_order_paid_again_on_its_live_checkout_after_a_person_kept_its_first_charge_is_refunded(world):
    """Decision 253 (decision 252 on the recording path): a frozen customer's checkout payment is held for a
    person, who marks it handled; unfrozen, the customer pays the same order again from a second tab, its
    subscription still waiting to start. Recording looked for another purchase on the subscription only,
    so it credited the second charge and started the subscription: charged twice for one checkout."""
    from billingctl.services.users import freeze, unfreeze

    co = world.checkout("user_twice")
    freeze(world.c, "user_twice", "fraud review", "ops")
    first = world.sandbox.pay(co["order_id"])  # held for the freeze
    assert (row(world, first["id"])["status"], row(world, first["id"])["last_error"]) == ("needs_review",
                                                                                          "user is frozen")
    orphans.resolve(world.c, first["id"], "mark-handled", "the customer keeps it as a deposit", "ops")
    unfreeze(world.c, "user_twice", "cleared", "ops")
    second = world.sandbox.pay(co["order_id"])  # the other tab
    assert world.purchases(second["id"]) == 0 and world.credits("user_twice") == 0
    world.advance(16)
    assert orphans.run_orphans(world.c)["outcomes"].get("duplicate_refunded") == 1
    assert (row(world, second["id"])["status"], row(world, second["id"])["resolution"]) == ("duplicate_refunded",
                                                                                            "refunded")
    paid = world.sandbox.store.get("payment", second["id"])
    assert paid["processor"]["amountRefunded"] == second["amount"] and len(paid["refunds"]) == 1
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "future"  # never started
    assert world.credits("user_twice") == 0


def test_an_order_paid_again_on_its_live_checkout_after_its_kept_first_charge_was_refunded_starts_it(world):
    """The other side of decision 253: the kept first charge refunded in full since, the second is the
    customer's only charge of the order: recovery records it on the checkout's own subscription, which
    starts, and makes no other."""
    from billingctl.services.users import freeze, unfreeze

    co = world.checkout("user_twice")
    freeze(world.c, "user_twice", "fraud review", "ops")
    first = world.sandbox.pay(co["order_id"])
    orphans.resolve(world.c, first["id"], "mark-handled", "refunded by support", "ops")
    world.sandbox.refund(first["id"])  # support refunds it at the orchestrator's dashboard
    unfreeze(world.c, "user_twice", "cleared", "ops")
    second = world.sandbox.pay(co["order_id"])
    world.advance(16)
    assert orphans.run_orphans(world.c)["outcomes"].get("recovered") == 1
    assert world.purchases(second["id"]) == 1 and world.credits("user_twice") == 2000
    assert [s["id"] for s in world.sandbox.store.all("subscription")
            if s["customer_id"] == "user_twice" and s["status"] != "cancelled"] == [co["subscription_id"]]
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "active"


@pytest.mark.parametrize("fault", ["timeout", "503"])
def test_a_payment_the_orchestrator_cannot_read_is_not_marked_handled_unchecked(world, fault):
    """Found by the exploration on production's container (2026-11-29): a checkout paid twice, its first
    payment's notification lost; the customer was frozen before the poller found it, so it was held for a
    person (needs_review, frozen). An orchestrator timeout then met `orphans resolve --mark-handled`: the
    payment could not be read, and mark-handled went on without the check that refuses a second charge of
    an order (decision 145): the customer stayed charged twice, with reconcile naming it. An action that
    cannot be checked is refused (exit 4, try again); a payment the orchestrator says it does not hold (a
    payment entered at the provider) may still be marked handled."""
    from billingctl.services.users import freeze

    co = world.checkout("user_twice")
    first = world.sandbox.pay(co["order_id"], drop_webhook=True)
    world.sandbox.pay(co["order_id"])  # the same form paid again: this one is recorded
    freeze(world.c, "user_twice", "fraud review", "ops")
    world.advance(180)
    orphans.run_orphans(world.c)  # the settled-payments poller finds the first payment: held for the freeze
    assert (row(world, first["id"])["status"], row(world, first["id"])["last_error"]) == ("needs_review",
                                                                                          "user is frozen")
    world.sandbox.store.add_fault("orchestrator", fault, method="GET", count=-1)
    with pytest.raises(e.ExternalError) as failed:
        orphans.resolve(world.c, first["id"], "mark-handled", "customer asked", "ops")
    assert isinstance(failed.value, e.ExternalUnavailable)  # exit 4: try again
    assert "could not be read at the orchestrator" in failed.value.message
    assert row(world, first["id"])["status"] == "needs_review"
    assert [a for a in audits(world) if a[1].startswith("orphans.")] == []
    world.sandbox.store.clear_faults()
    with pytest.raises(e.Refused):  # readable again: the second charge of the order is refused, as before
        orphans.resolve(world.c, first["id"], "mark-handled", "customer asked", "ops")

def test_an_operator_cannot_give_a_payment_a_second_subscription_of_a_plan_the_customer_holds(world):
    """Found by the exploration: support refunded the customer's first payment in full at the orchestrator's
    console; the customer paid the same checkout's form again, held as a same-plan duplicate (the first
    subscription is still live). An operator then resolved it with --create-subscription, which made a second
    live subscription of the plan beside the first: both renew, and the customer is billed twice each term.
    Refused now, naming the subscription that holds the plan; the refund still works."""
    co = world.checkout("user_held")
    first = world.sandbox.pay(co["order_id"])
    world.sandbox.refund(first["id"])
    second = world.sandbox.pay(co["order_id"])
    assert row(world, second["id"])["status"] in ("retrying", "needs_review")
    before = len(world.sandbox.store.all("subscription"))
    with pytest.raises(e.Refused) as refused:
        orphans.resolve(world.c, second["id"], "create-subscription", "customer asked", "ops")
    assert refused.value.message == (
        f"payment {second['id']}: user_held already holds {co['item_price_id']} ({co['subscription_id']}), so "
        "--create-subscription would bill the plan twice; refund it (billingctl orphans resolve "
        f"{second['id']} --refund --reason R --yes), or cancel {co['subscription_id']} first")
    assert len(world.sandbox.store.all("subscription")) == before and audits(world) == []
    orphans.resolve(world.c, second["id"], "refund", "holds the plan", "ops")
    assert world.sandbox.store.get("payment", second["id"])["processor"]["amountRefunded"] == second["amount"]


def _dispute_of(world, payment_id):
    with world.c.uow() as uow:
        return uow.disputes.deciding(payment_id)["dispute_id"]


def _charged_back(world, payment_id):
    assert world.sandbox.dispute_status(payment_id, "LOST")["delivered"] == 200


def test_a_charged_back_orphan_is_never_given_a_subscription_nor_refunded(world):
    """A dispute lost on a payment waiting for recovery: the customer has the money back through the bank.
    Recovery re-subscribed it (a live subscription and an invoice paid by money that is gone, renewed and
    charged next month); an operator's refund would return the money twice. Recovery ends the row instead
    (`resolved`, `charged_back`), and the operator's refund and subscription are refused."""
    from billingctl.services.payments import refund_by_operator

    _, payment = orphan(world, "user_d")
    pid = payment["id"]
    _charged_back(world, pid)
    before = len(world.sandbox.store.all("subscription"))
    with pytest.raises(e.Refused) as refused:
        refund_by_operator(world.c, pid, "customer asked", "ops")
    assert refused.value.message == (
        f"payment {pid} was charged back (dispute {_dispute_of(world, pid)} lost): the customer has the money "
        f"back, so a refund is refused; mark it handled (billingctl orphans resolve {pid} --mark-handled "
        "--reason R --yes) if it waits for review")
    assert orphans.run_orphans(world.c)["outcomes"] == {"charged_back": 1}
    assert resolution(world, pid) == ("resolved", "charged_back", None)
    assert len(world.sandbox.store.all("subscription")) == before  # nothing started at the provider
    assert world.sandbox.store.get("payment", pid).get("refunds") in (None, [])  # nothing refunded
    assert world.purchases(pid) == 0 and world.credits("user_d") == 0


def test_a_frozen_users_payment_charged_back_while_held_stays_unsubscribed_after_the_unfreeze(world):
    """The fraud flow: a payment held because its customer is frozen, then charged back; the alert says
    "unfreeze and retry", and the retry re-subscribed the charged-back payment."""
    from billingctl.services.users import freeze, unfreeze

    _, payment = orphan(world, "user_z")
    freeze(world.c, "user_z", "fraud review", "ops")
    assert orphans.run_orphans(world.c)["outcomes"] == {"needs_review": 1}
    _charged_back(world, payment["id"])
    for action in ("refund", "create-subscription"):
        with pytest.raises(e.Refused) as refused:
            orphans.resolve(world.c, payment["id"], action, "customer asked", "ops")
        assert f"so --{action} is refused" in refused.value.message
    unfreeze(world.c, "user_z", "review passed", "ops")
    before = len(world.sandbox.store.all("subscription"))
    assert orphans.retry(world.c, payment["id"], "ops")["outcome"] == "charged_back"
    assert len(world.sandbox.store.all("subscription")) == before
    assert world.purchases(payment["id"]) == 0 and world.credits("user_z") == 0


def test_an_orphan_under_an_open_dispute_waits_for_a_person(world):
    """Undecided: neither a subscription (the customer may get the money back) nor a refund (the money
    could go back twice); a person answers the dispute first."""
    _, payment = orphan(world, "user_o")
    assert world.sandbox.dispute_status(payment["id"], "OPEN")["delivered"] == 200
    assert orphans.run_orphans(world.c)["outcomes"] == {"needs_review": 1}
    state = row(world, payment["id"])
    assert state["status"] == "needs_review" and state["last_error"].startswith("disputed")
    with pytest.raises(e.Refused):
        orphans.resolve(world.c, payment["id"], "refund", "customer asked", "ops")
    assert world.sandbox.store.get("payment", payment["id"]).get("refunds") in (None, [])


def _credited_orphan(world, user):
    """A checkout the provider cancelled before its payment settled: the payment is recorded and credited
    here, never on the provider's books, and handed to orphan recovery; the customer frozen meanwhile, it
    waits for a person (needs_review)."""
    from billingctl.services.users import freeze

    co = world.checkout(user)
    world.sandbox.cancel(co["subscription_id"])
    payment = world.sandbox.pay(co["order_id"])
    assert world.purchases(payment["id"]) == 1 and world.credits(user) == 2000
    freeze(world.c, user, "fraud review", "ops")
    world.advance(16)
    assert orphans.run_orphans(world.c)["outcomes"] == {"needs_review": 1}
    return payment["id"]


def _books_after_the_hour(world):
    from billingctl.services.reconcile import reconcile

    world.advance(2 * 3600)
    return [(v["check"], v.get("payment_id")) for v in reconcile(world.c, full=True)["violations"]]


def _closed(world, payment_id):
    with world.c.uow() as uow:
        found = uow.purchases.by_payment_id(payment_id)
    return found["closed_reason"], found["provider_recorded_at"]


@pytest.mark.parametrize("how", ["refunded at the orchestrator", "orphans resolve --refund"])
def test_a_credited_orphan_refunded_in_full_leaves_nothing_for_reconcile_to_name(world, how):
    """Decision 173: the row ended refunded and the credits went back, but the purchase stayed open, never
    to be recorded at the provider: reconcile named it `recorded_not_on_provider_invoice` every day."""
    from billingctl.services.users import unfreeze

    pid = _credited_orphan(world, "user_k")
    if how == "refunded at the orchestrator":
        unfreeze(world.c, "user_k", "review passed", "ops")
        world.sandbox.refund(pid)
        assert orphans.retry(world.c, pid, "ops")["outcome"] == "refunded_elsewhere"
        expected = ("resolved", "refunded_elsewhere", None)
    else:
        orphans.resolve(world.c, pid, "refund", "fraud confirmed", "ops")
        expected = ("resolved", "refunded", "ops")
    assert resolution(world, pid) == expected
    assert world.credits("user_k") == 0
    assert _closed(world, pid) == (expected[1], None)
    assert _books_after_the_hour(world) == []


def test_a_credited_orphan_recovery_refunds_as_a_duplicate_leaves_nothing_for_reconcile_to_name(world):
    """Decision 183 (found by the exploration): a payment credited here, never on the provider's books,
    whose plan the customer took again by a second checkout, is refunded by recovery as a same-plan
    duplicate, its credits go back and its purchase is closed (decision 173). The books agree, but
    reconcile named it `payment_recorded_and_refunded` every day: it named every recorded payment whose
    row is `duplicate_refunded`, closed or not."""
    co = world.checkout("user_d")
    world.sandbox.cancel(co["subscription_id"])  # the provider cancelled the checkout before its payment
    first = world.sandbox.pay(co["order_id"])
    assert world.purchases(first["id"]) == 1 and world.credits("user_d") == 2000
    world.sandbox.pay(world.checkout("user_d")["order_id"])  # the customer took the plan again
    world.advance(16)
    assert orphans.run_orphans(world.c)["outcomes"]["duplicate_refunded"] == 1
    assert world.sandbox.store.get("payment", first["id"])["processor"]["amountRefunded"] == first["amount"]
    assert world.credits("user_d") == 2000  # the duplicate's credits are back, the second payment's stand
    assert _closed(world, first["id"]) == ("refunded", None)
    assert _books_after_the_hour(world) == []


def test_a_credited_orphan_is_marked_handled_only_once_its_credits_are_back(world):
    """Decision 173: marked handled with its credits kept, a payment would hold credits that no invoice at
    the provider carries, named by reconcile every day and acted on by nothing. Refused, changing nothing;
    once the money went back (here a refund at the orchestrator, reported by its notification), it may be
    marked handled, and its purchase is closed."""
    pid = _credited_orphan(world, "user_m")
    with pytest.raises(e.Refused) as refused:
        orphans.resolve(world.c, pid, "mark-handled", "paid by hand", "ops")
    assert refused.value.message == (
        f"payment {pid} is credited here (2000 credits) and not recorded at the provider: marked handled, it "
        f"would keep them with no invoice behind them; give it a subscription (billingctl orphans resolve {pid} "
        f"--create-subscription --reason R --yes) or refund it (billingctl orphans resolve {pid} --refund "
        "--reason R --yes)")
    assert row(world, pid)["status"] == "needs_review"
    assert [a[1] for a in audits(world)] == ["user.freeze"]  # the refusal audited nothing
    assert world.credits("user_m") == 2000 and _closed(world, pid) == (None, None)
    world.sandbox.refund(pid)  # its notification takes the credits back
    assert world.credits("user_m") == 0
    orphans.resolve(world.c, pid, "mark-handled", "refunded by finance", "ops")
    assert resolution(world, pid) == ("resolved", "handled", "ops")
    assert _closed(world, pid) == ("handled", None)
    assert _books_after_the_hour(world) == []
