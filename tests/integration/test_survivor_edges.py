"""Edges found by reading the survivors of `make mutation`, one behaviour each: which lane an authorization
counts on, which invoice a lost start answer belongs to, which soft-deleted or foreign rows an operator
command must leave alone, where the velocity window starts, and what recovery does with a payment held
while its user was frozen."""

from datetime import timedelta

import pytest
from sqlalchemy import insert, select

from billingctl.adapters.db.tables import alert_outbox, fraud_event, orphan_recovery, transaction, user_credits, users
from billingctl.adapters.payloads import Payment
from billingctl.domain import errors as e
from billingctl.domain.lifecycle import ORPHAN
from billingctl.services import orphans
from billingctl.services import processor_lock as pl
from billingctl.services.payments import record_payment, update_transaction_status
from billingctl.services.users import freeze, unfreeze, velocity_watch
from tests.integration.test_lock_operations import audits
from tests.integration.test_orphans import chat_alerts, orphan, row
from tests.integration.test_orphans import world as world  # noqa: F401 - the fixture
from tests.integration.test_processor_lock import NOW, lock_row

pytestmark = pytest.mark.integration
NSFW, PRO = "credits-pro-nsfw-USD-monthly", "credits-pro-USD-monthly"


def counted(world, user):
    with world.c.uow() as uow:
        return uow.execute(select(fraud_event.c.dedupe_key).where(fraud_event.c.user_id == user)).scalars().all()


def test_an_authorizations_lane_is_its_metadatas_first_then_its_checkouts(world):
    update_transaction_status(world.c, {"id": "pay_m", "status": "DECLINED", "customerId": "user_m",
                                        "metadata": {"lane": "nsfw"}})
    assert counted(world, "user_m") == ["payment:pay_m"]  # no order id: the metadata alone decides
    sfw = world.checkout("user_s", PRO)
    update_transaction_status(world.c, {"id": "pay_s", "status": "DECLINED", "customerId": "user_s",
                                        "orderId": sfw["order_id"], "metadata": {"lane": "nsfw"}})
    assert counted(world, "user_s") == ["payment:pay_s"]  # the payment's own lane wins over its checkout's
    with world.c.uow() as uow:
        amount = uow.execute(select(transaction.c.amount).where(transaction.c.transaction_id == "pay_m")).scalar()
    assert amount == 0  # no amount reported: none recorded


def test_a_lost_start_answer_finds_the_first_invoice_of_its_own_subscription(world):
    other = world.checkout("user_o")
    world.sandbox.pay(other["order_id"])  # another subscription's invoice exists first
    co = world.checkout()
    world.sandbox.store.add_fault("provider", "error_after_effect", path="update_for_items", count=1)
    with world.c.provider.http.attempts(1):
        record_payment(world.c, world.sandbox.pay(co["order_id"], drop_webhook=True), "cli")
    from billingctl.services.payments import retry_pending

    assert retry_pending(world.c) == {"completed": 1, "failed": 0}
    own = [i for i in world.sandbox.store.all("invoice") if i["subscription_id"] == co["subscription_id"]]
    with world.c.uow() as uow:
        bought = uow.purchases.first_of_subscription(co["subscription_id"])
    assert bought.invoice_id == own[0]["id"] and own[0]["status"] == "paid"


def test_a_cancelled_checkout_opens_review_only_for_its_own_unassigned_payments(world):
    pending = world.checkout("user_p")
    world.sandbox.store.add_fault("provider", "503", path=f"{pending['subscription_id']}/update_for_items",
                                  count=-1)
    stuck = world.sandbox.pay(pending["order_id"])  # recorded, its activation (and invoice) pending
    co = world.checkout()
    world.sandbox.cancel(co["subscription_id"])
    late = world.sandbox.pay(co["order_id"])
    with world.c.uow() as uow:
        opened = uow.execute(select(orphan_recovery.c.payment_id)).scalars().all()
        synced = uow.subscriptions.get(co["subscription_id"])["synced_at"]
    assert opened == [late["id"]] and stuck["id"] not in opened
    assert synced == world.c.clock.now()


def test_clear_and_backfill_leave_soft_deleted_rows_alone_and_read_successes_on_the_stored_processor(world):
    legacy = world.c.settings.legacy_nmi_processor
    with world.c.uow() as uow:
        uow.execute(insert(users).values(id="user_d", created_at=NOW))
        uow.execute(insert(user_credits).values(user_id="user_d", nsfw_processor="NSFW_CCBILL", created_at=NOW,
                                                deleted_at=NOW))
        uow.execute(insert(user_credits).values(user_id="user_d", nsfw_processor="NSFW_CCBILL", created_at=NOW))
        uow.execute(insert(transaction).values(transaction_id="pay_other", amount=1, status="captured",
                                               created_at=NOW, customer_id="user_d", processor="NSFW_SEGPAY"))
        uow.execute(insert(transaction).values(transaction_id="pay_failed", amount=1, status="failed",
                                               created_at=NOW, customer_id="user_d", processor="NSFW_CCBILL"))
        for uid, deleted in (("old_1", NOW), ("legacy_0", None), ("legacy_3", None)):
            uow.execute(insert(users).values(id=uid, created_at=NOW))
            uow.execute(insert(user_credits).values(user_id=uid, nsfw_processor=legacy, created_at=NOW,
                                                    deleted_at=deleted))
        for n, (created, mid) in enumerate(((NOW + timedelta(minutes=5), "mid_late"), (NOW, "mid_first"))):
            for uid in ("old_1", "legacy_3"):
                uow.execute(insert(transaction).values(transaction_id=f"pay_{uid}_{n}", amount=1, status="captured",
                                                       created_at=created, customer_id=uid, processor=legacy,
                                                       processor_merchant_id=mid))
        uow.commit()
    pl.clear(world.c, "user_d", "nsfw", "wrong", "ops")  # successes elsewhere or failed ones do not hold it
    with world.c.uow() as uow:
        rows = uow.execute(select(user_credits.c.nsfw_processor).where(user_credits.c.user_id == "user_d")
                           .order_by(user_credits.c.id)).scalars().all()
    assert rows == ["NSFW_CCBILL", None]  # the soft-deleted row keeps its value
    result = pl.backfill_mid(world.c)
    assert result["filled"] == [{"user_id": "legacy_3", "nsfw_processor_mid": "mid_first"}]
    assert result["without_history"] == ["legacy_0"]  # and the users after it are still filled
    with world.c.uow() as uow:
        old = uow.execute(select(user_credits.c.nsfw_processor_mid).where(user_credits.c.user_id == "old_1")).scalar()
    assert old is None and lock_row(world, "legacy_3")["nsfw_processor_mid"] == "mid_first"
    assert [a[0] for a in audits(world)] == ["ops", "operator"]  # the backfill's actor when none is named


def test_the_velocity_window_is_the_last_minute_exclusive_of_its_start(world):
    now = world.c.clock.now()
    with world.c.uow() as uow:
        for n, age in enumerate((60, 59)):
            uow.execute(insert(transaction).values(transaction_id=f"pay_{n}", amount=10, status="captured",
                                                   created_at=now - timedelta(seconds=age), customer_id="u"))
        uow.commit()
    assert (velocity_watch(world.c)["charges"], velocity_watch(world.c)["amount"]) == (1, 10)


def test_orphans_are_listed_by_when_they_were_found(world):
    now = world.c.clock.now()
    with world.c.uow() as uow:
        for pid, created in (("pay_late", now), ("pay_early", now - timedelta(hours=1))):
            uow.orphans.open({"payment_id": pid, "user_id": "u", "status": "exhausted", "attempts": 7,
                              "settled_at": created, "created_at": created, "updated_at": created})
        uow.commit()
    assert [o["payment_id"] for o in orphans.list_orphans(world.c)] == ["pay_early", "pay_late"]

PENDING = ("recorded {} but activation is pending: subscription_provider: POST /api/v2/subscriptions/{}/"
           "update_for_items failed but may have taken effect (subscription_provider: internal error)")


def test_a_payment_held_while_frozen_is_recorded_on_its_own_subscription_after_unfreeze(world):
    """Found through `make mutation`: once recorded on its own subscription, a failed activation made the
    next attempt re-subscribe the user (a second subscription) and leave the first pending for ever."""
    co = world.checkout("user_f")
    freeze(world.c, "user_f", "fraud review", "ops")
    first = world.sandbox.pay(co["order_id"])  # its webhook: held for review, nothing credited
    assert row(world, first["id"])["status"] == "needs_review"
    unfreeze(world.c, "user_f", "cleared", "ops")
    world.sandbox.store.add_fault("provider", "503", path="update_for_items", count=-1)
    assert orphans.retry(world.c, first["id"], "ops")["outcome"] == "retrying"
    assert row(world, first["id"])["last_error"] == PENDING.format(first["id"], co["subscription_id"])
    world.sandbox.store.clear_faults()
    assert orphans.retry(world.c, first["id"], "ops")["outcome"] == "recovered"
    state = row(world, first["id"])
    assert (state["status"], state["resolution"], state["subscription_id"]) == (
        "recovered", "recorded", co["subscription_id"])
    with world.c.uow() as uow:
        bought = uow.purchases.by_payment_id(first["id"])
    assert (bought["recorded_via"], bought["subscription_id"]) == ("orphan_recovery", co["subscription_id"])
    assert world.sandbox.subscription(co["subscription_id"])["status"] == "active"
    assert len(world.sandbox.store.all("subscription")) == 1 and world.credits("user_f") == 2000


def under_retry(world):
    _, payment = orphan(world)
    world.sandbox.store.add_fault("provider", "500", path="subscription_for_items", count=1)
    orphans.run_orphans(world.c)
    world.sandbox.store.clear_faults()
    return payment


def test_a_failed_manual_resubscription_leaves_the_orphan_to_automatic_recovery(world):
    payment = under_retry(world)
    with world.c.uow() as uow:
        uow.orphans.move(payment["id"], "exhausted", ORPHAN.states)  # planted
        uow.commit()
    world.sandbox.store.add_fault("provider", "400", path="subscription_for_items", count=-1)
    with pytest.raises(e.BillingError):
        orphans.resolve(world.c, payment["id"], "create-subscription", "user asked", "ops")
    assert row(world, payment["id"])["status"] == "retrying"


def test_a_refund_resolution_while_the_orchestrator_is_unreadable_fails_as_unavailable(world):
    payment = under_retry(world)
    world.sandbox.store.add_fault("orchestrator", "500", method="GET", path="/payments/", count=-1)
    with pytest.raises(e.ExternalError):
        orphans.resolve(world.c, payment["id"], "refund", "customer asked", "ops")
    with pytest.raises(e.ExternalUnavailable):  # unread, nothing is checked, so nothing is taken (decision 228)
        orphans.resolve(world.c, payment["id"], "mark-handled", "refunded by phone", "ops")
    world.sandbox.store.clear_faults()
    assert orphans.resolve(world.c, payment["id"], "mark-handled", "refunded by phone", "ops")["state"] == "resolved"


def test_a_refund_reported_before_its_settle_names_the_reporting_path_everywhere(world):
    from billingctl.services.payments import apply_refund_report

    co = world.checkout()
    paid = world.settle(co["order_id"])
    stored = world.sandbox.store.get("payment", paid["id"])
    stored["processor"]["amountRefunded"] = paid["amount"]  # refunded; neither report reached us
    world.sandbox.store.put("payment", paid["id"], stored)
    assert apply_refund_report(world.c, paid["id"], paid["amount"], "event_poller")["outcome"] == "recorded"
    with world.c.uow() as uow:
        assert uow.purchases.by_payment_id(paid["id"])["recorded_via"] == "event_poller"
        events = [p for p in uow.execute(select(alert_outbox.c.payload)).scalars() if p.get("event")]
    assert [(p["event"], p["path"]) for p in events] == [("payment_recorded", "event_poller"),
                                                         ("payment_refunded", "event_poller")]
    assert world.credits() == 0


def test_dunning_attempts_are_listed_by_user_invoice_and_limit(world):
    from billingctl.services.renewals import list_attempts

    now = world.c.clock.now()
    with world.c.uow() as uow:
        for n, (user, invoice) in enumerate((("u1", "inv_1"), ("u1", "inv_2"), ("u2", "inv_1"), ("u1", "inv_1"))):
            uow.dunning.add(invoice_id=invoice, subscription_id="sub", user_id=user, status="declined",
                            attempt_no=n, created_at=now)
        uow.commit()
    assert [a["attempt_no"] for a in list_attempts(world.c, user_id="u1")] == [3, 1, 0]
    assert [a["attempt_no"] for a in list_attempts(world.c, invoice_id="inv_1")] == [3, 2, 0]
    assert [a["attempt_no"] for a in list_attempts(world.c, user_id="u1", invoice_id="inv_1")] == [3, 0]
    assert [a["attempt_no"] for a in list_attempts(world.c, limit=2)] == [3, 2]


def test_repair_relocks_only_the_live_row(world):
    world.settle(world.checkout("user_h", NSFW)["order_id"], processor="NSFW_NMI")
    now = world.c.clock.now()
    with world.c.uow() as uow:
        uow.execute(insert(user_credits).values(user_id="user_h", created_at=now, deleted_at=now))
        uow.commit()
    assert pl.repair(world.c, "user_h", "nsfw")["outcome"] == "locked"
    with world.c.uow() as uow:
        rows = uow.execute(select(user_credits.c.nsfw_processor, user_credits.c.deleted_at.is_(None))
                           .where(user_credits.c.user_id == "user_h").order_by(user_credits.c.id)).all()
    assert [tuple(r) for r in rows] == [(None, False), ("NSFW_NMI", True)]


def test_a_recovered_checkout_payment_moves_with_its_transaction_and_nothing_else_moves(world):
    from billingctl.services.payments import pending_activations

    stuck = world.checkout("user_p")
    world.sandbox.store.add_fault("provider", "503", path=f"{stuck['subscription_id']}/update_for_items", count=-1)
    stuck_payment = world.sandbox.pay(stuck["order_id"])  # another purchase without an invoice, not an orphan
    co = world.checkout()
    world.sandbox.cancel(co["subscription_id"])
    late = world.sandbox.pay(co["order_id"])  # recorded, then handed to recovery
    assert co["subscription_id"] not in {r["id"] for r in pending_activations(world.c)}
    assert stuck["subscription_id"] in {r["id"] for r in pending_activations(world.c)}
    world.advance(16)
    orphans.run_orphans(world.c)
    new_sub = row(world, late["id"])["subscription_id"]
    assert new_sub != co["subscription_id"]
    with world.c.uow() as uow:
        placed = {r.transaction_id: (r.subscription_id, r.kind) for r in uow.execute(
            select(transaction.c.transaction_id, transaction.c.subscription_id,
                   transaction.c.status.label("kind")))}
        moved = uow.purchases.by_payment_id(late["id"])["subscription_id"]
        kept = uow.purchases.by_payment_id(stuck_payment["id"])["subscription_id"]
    assert (moved, placed[late["id"]][0]) == (new_sub, new_sub)
    assert (kept, placed[stuck_payment["id"]][0]) == (stuck["subscription_id"], stuck["subscription_id"])


def test_a_held_payment_whose_subscription_an_operator_activated_meanwhile_is_recovered(world):
    """The orphan's retry finds its payment recorded and its subscription already active (`billingctl activate`
    ran between two attempts): that is a recovery, not an error."""
    from billingctl.services.payments import activate_subscription

    co = world.checkout("user_f")
    freeze(world.c, "user_f", "fraud review", "ops")
    first = world.sandbox.pay(co["order_id"])
    unfreeze(world.c, "user_f", "cleared", "ops")
    world.sandbox.store.add_fault("provider", "503", path="update_for_items", count=-1)
    assert orphans.retry(world.c, first["id"], "ops")["outcome"] == "retrying"
    assert row(world, first["id"])["last_error"] == PENDING.format(first["id"], co["subscription_id"])
    world.sandbox.store.clear_faults()
    assert activate_subscription(world.c, co["subscription_id"])["outcome"] == "activated"
    assert orphans.retry(world.c, first["id"], "ops")["outcome"] == "recovered"
    state = row(world, first["id"])
    assert (state["status"], state["resolution"], state["subscription_id"]) == (
        "recovered", "recorded", co["subscription_id"])
    assert len(world.sandbox.store.all("subscription")) == 1 and world.credits("user_f") == 2000


def test_an_orphans_failure_stores_its_own_error_cut_to_the_columns_and_the_alerts_length(world):
    from billingctl.services.orphans import ORPHAN_MAX_ATTEMPTS, _failed

    _, payment = orphan(world)
    world.sandbox.store.add_fault("provider", "500", path="subscription_for_items", count=-1)
    assert orphans.run_orphans(world.c)["outcomes"] == {"retrying": 1}
    world.c.clock.advance(90)
    assert _failed(world.c, dict(row(world, payment["id"])), "E" * 600) == "retrying"
    state = row(world, payment["id"])
    assert (state["attempts"], state["last_error"], state["updated_at"]) == (2, "E" * 500, world.c.clock.now())
    with world.c.uow() as uow:
        uow.orphans.set(payment["id"], attempts=ORPHAN_MAX_ATTEMPTS - 1)
        uow.commit()
    world.c.clock.advance(90)
    assert _failed(world.c, dict(row(world, payment["id"])), "F" * 600) == "exhausted"
    state = row(world, payment["id"])
    assert (state["status"], state["attempts"], state["last_error"], state["updated_at"]) == (
        "exhausted", ORPHAN_MAX_ATTEMPTS, "F" * 500, world.c.clock.now())
    [(_, alert)] = [a for a in chat_alerts(world) if a[0] == f"orphan-exhausted:{payment['id']}"]
    fields = {f["title"]: f["value"] for f in alert["attachments"][0]["fields"]}
    assert (fields["last_error"], fields["attempts"]) == ("F" * 200, str(ORPHAN_MAX_ATTEMPTS))


def test_a_payment_refunded_in_full_is_not_refunded_again(world):
    paid = world.settle(world.checkout("user_r")["order_id"])
    world.sandbox.refund(paid["id"])
    before = world.sandbox.store.count_requests("orchestrator", "POST", "/refund")
    assert orphans.refund(world.c, paid["id"]).refunded == paid["amount"]
    assert world.sandbox.store.count_requests("orchestrator", "POST", "/refund") == before


def test_a_run_that_lists_nothing_keeps_and_names_its_cursor(world):
    from billingctl.domain.clock import parse_time
    from billingctl.services.cursors import read_value, write_value

    world.settle(world.checkout("user_r")["order_id"])
    ahead = world.c.clock.now() + timedelta(hours=1)
    write_value(world.c, orphans.CURSOR, ahead.isoformat())
    result = orphans.run_orphans(world.c)
    assert (result["outcomes"], result["cursor"]) == ({}, ahead)
    assert parse_time(read_value(world.c, orphans.CURSOR)) == ahead


@pytest.mark.parametrize("missing", ["customerId", "metadata"])
def test_an_orphan_takes_its_user_from_the_payments_customer_or_else_its_metadata(world, missing):
    """The orchestrator's customerId is optional; our checkout's metadata names the user too."""
    co = world.checkout("user_m")
    payment = world.settle(co["order_id"])
    shown = {**payment, "customerId": None} if missing == "customerId" else {**payment, "metadata": None}
    orphans._open(world.c, Payment.read(shown))
    assert row(world, payment["id"])["user_id"] == "user_m"


def test_an_error_after_a_decline_waits_the_first_backoff_step(world):
    from billingctl.services.renewals import list_attempts, run_renewals
    from tests.integration.test_renewals import month_passes, subscribed

    subscribed(world, "user_e")
    world.sandbox.decline_customer("user_e")
    month_passes(world)
    assert run_renewals(world.c)["outcomes"] == {"declined": 1}
    world.sandbox.decline_customer("user_e", decline=False)
    world.c.clock.advance(world.c.settings.renewal_retry_hours[0] * 3600)
    world.sandbox.store.add_fault("orchestrator", "503", method="POST", path="/payments", count=-1)
    assert run_renewals(world.c)["outcomes"] == {"error": 1}
    last = list_attempts(world.c, user_id="user_e")[0]
    assert (last["status"], last["next_attempt_at"]) == ("error", world.c.clock.now() + timedelta(minutes=10))


def test_the_cursor_holds_at_the_oldest_payment_too_recent_to_judge(world):
    from billingctl.domain.clock import parse_time

    first = world.sandbox.pay(world.checkout("user_1")["order_id"])
    world.advance(5)
    second = world.sandbox.pay(world.checkout("user_2")["order_id"])
    result = orphans.run_orphans(world.c)
    assert result["outcomes"] == {"too_recent": 2}
    assert result["cursor"] == parse_time(first["date"]) < parse_time(second["date"])


def test_a_payment_settled_exactly_the_grace_period_ago_is_judged(world):
    from billingctl.domain.clock import parse_time

    paid = world.sandbox.pay(world.checkout("user_1")["order_id"])
    world.c.clock.advance((orphans.TOO_RECENT - (world.c.clock.now() - parse_time(paid["date"]))).total_seconds())
    assert world.c.clock.now() - parse_time(paid["date"]) == orphans.TOO_RECENT
    assert orphans.run_orphans(world.c)["outcomes"] == {"recorded": 1}


def test_a_first_run_that_lists_nothing_writes_no_cursor_even_with_an_orphan_open(world):
    from billingctl.services.cursors import read_value

    now = world.c.clock.now()
    with world.c.uow() as uow:  # held for review by another path; the orchestrator lists no payment
        uow.orphans.open({"payment_id": "pay_held", "user_id": "u", "status": "retrying", "attempts": 0,
                          "settled_at": now, "created_at": now, "updated_at": now})
        uow.commit()
    result = orphans.run_orphans(world.c)
    assert (result["outcomes"], result["cursor"]) == ({}, None)
    assert read_value(world.c, orphans.CURSOR) is None


def test_a_held_payment_whose_subscription_was_cancelled_meanwhile_is_resubscribed(world):
    co = world.checkout("user_f")
    freeze(world.c, "user_f", "fraud review", "ops")
    held = world.sandbox.pay(co["order_id"])
    assert row(world, held["id"])["status"] == "needs_review"
    world.sandbox.cancel(co["subscription_id"])
    with world.c.uow() as uow:
        uow.subscriptions.set(co["subscription_id"], status="cancelled")
        uow.commit()
    unfreeze(world.c, "user_f", "cleared", "ops")
    assert orphans.retry(world.c, held["id"], "ops")["outcome"] == "recovered"
    state = row(world, held["id"])
    assert state["resolution"] == "resubscribed" and state["subscription_id"] != co["subscription_id"]
    assert world.sandbox.subscription(state["subscription_id"])["status"] == "active"
    assert world.credits("user_f") == 2000


def test_an_orphan_whose_webhook_was_lost_is_recovered_on_the_pollers_first_run(world):
    from billingctl.services.checkout import cleanup_expired

    co = world.checkout("user_w")
    world.advance(2 * 86400)
    assert co["subscription_id"] in cleanup_expired(world.c)["cancelled"]
    payment = world.sandbox.pay(co["order_id"], drop_webhook=True)
    world.advance(16)
    assert orphans.run_orphans(world.c)["outcomes"] == {"recovered": 1}
    assert row(world, payment["id"])["resolution"] == "resubscribed" and world.credits("user_w") == 2000


def test_a_payment_for_a_subscription_deleted_at_the_provider_is_recovered_as_an_orphan(world):
    """A subscription deleted in the provider's console is gone (404), not cancelled: its late payment is
    an orphan all the same, re-subscribed, never recorded on a subscription that no longer exists."""
    co = world.checkout("user_d")
    with world.sandbox.store.tx() as db:
        db.execute("DELETE FROM objects WHERE kind='subscription' AND id=?", (co["subscription_id"],))
    payment = world.sandbox.pay(co["order_id"], drop_webhook=True)
    world.advance(16)
    assert orphans.run_orphans(world.c)["outcomes"] == {"recovered": 1}
    state = row(world, payment["id"])
    assert state["resolution"] == "resubscribed" and state["subscription_id"] != co["subscription_id"]
    assert world.sandbox.subscription(state["subscription_id"])["status"] == "active"
    assert world.credits("user_d") == 2000


def test_two_orphans_of_one_user_re_subscribed_in_one_run_each_get_their_own_subscription(world):
    """The provider replays the answer to a repeated idempotency key: each re-subscription's key names
    its payment, or the second plan would be handed the first plan's new subscription."""
    from billingctl.services.checkout import cleanup_expired

    basic, pro = world.checkout("user_a", "credits-basic-USD-monthly"), world.checkout("user_a")
    world.advance(2 * 86400)
    assert set(cleanup_expired(world.c)["cancelled"]) == {basic["subscription_id"], pro["subscription_id"]}
    paid = [world.sandbox.pay(co["order_id"], drop_webhook=True) for co in (basic, pro)]
    world.advance(16)
    assert orphans.run_orphans(world.c)["outcomes"] == {"recovered": 2}
    new_subs = [row(world, p["id"])["subscription_id"] for p in paid]
    assert len(set(new_subs)) == 2 and not set(new_subs) & {basic["subscription_id"], pro["subscription_id"]}
    plans = [world.sandbox.subscription(sub_id)["subscription_items"][0]["item_price_id"] for sub_id in new_subs]
    assert plans == ["credits-basic-USD-monthly", "credits-pro-USD-monthly"]
    assert all(world.sandbox.subscription(sub_id)["status"] == "active" for sub_id in new_subs)


def test_a_settled_payment_without_our_subscription_is_held_for_review_once_and_the_cursor_moves_on(world):
    """Found through `make mutation`: a payment made outside our checkout (at the orchestrator's console)
    failed the settled poller's every run, held its cursor for ever and made each run a failed job."""
    from billingctl.domain.clock import parse_time

    card = world.sandbox.add_instrument("user_z", "PAYMENT_CARD")
    paid = world.sandbox.charge({"paymentMethodToken": card["token"], "customerId": "user_z", "amount": 999,
                                 "currencyCode": "EUR", "metadata": {"psp": "SFW_STRIPE"}}, drop_webhook=True)
    world.advance(16)
    # another integration's charge names its user only in its metadata
    other = world.sandbox.charge({"paymentMethodToken": card["token"], "amount": 500,
                                  "metadata": {"psp": "SFW_STRIPE", "user_id": "user_m"}}, drop_webhook=True)
    world.advance(16)
    later = world.sandbox.pay(world.checkout("user_l")["order_id"], drop_webhook=True)
    world.advance(16)
    result = orphans.run_orphans(world.c)
    assert result["outcomes"] == {"needs_review": 2, "recorded": 1}
    assert result["cursor"] == parse_time(later["date"])  # the cursor moves on: nothing is looked at for ever
    state = row(world, paid["id"])
    assert (state["status"], state["user_id"], state["amount"], state["currency_code"], state["subscription_id"],
            state["last_error"]) == ("needs_review", "user_z", 999, "EUR", None,
                                     f"payment {paid['id']} names no subscription or invoice")
    assert state["settled_at"] == parse_time(paid["date"])
    assert (row(world, other["id"])["user_id"], row(world, other["id"])["amount"]) == ("user_m", 500)
    assert [p["text"] for k, p in chat_alerts(world) if k == f"unattributed-payment:{paid['id']}"] == [
        f"Payment {paid['id']} names none of our subscriptions - manual review required"]
    assert world.purchases(paid["id"]) == 0
    world.advance(60)
    assert orphans.run_orphans(world.c)["outcomes"] == {"recorded": 1}  # only the newest is listed again
    assert len(chat_alerts(world)) == 2


def test_activating_a_malformed_subscription_id_is_refused_with_the_fields_name(world):
    """An operator's (or the internal endpoint's) activation of an id that is not one is refused before any
    lock, read or provider call, with a message that names the field."""
    from billingctl.services.payments import activate_subscription

    with pytest.raises(e.InvalidInput, match="^subscription_id is not a valid id$"):
        activate_subscription(world.c, "sub 1; drop")


def test_a_recorded_payment_sent_again_without_its_id_or_settle_is_refused_not_called_a_duplicate(world):
    """The duplicate fast path answers only for a settled payment with an id: the same payment sent again
    without its id, as another status, or as no object at all, is refused with the full path's message."""
    co = world.checkout()
    payment = world.sandbox.pay(co["order_id"])  # recorded and finished
    with pytest.raises(e.InvalidInput, match="is AUTHORIZED, not SETTLED"):
        record_payment(world.c, {**payment, "status": "AUTHORIZED"}, "cli")
    without_id = {k: v for k, v in payment.items() if k != "id"}
    for sent, message in ((without_id, "payment id is missing"), ([payment], "payment is not an object")):
        with pytest.raises(e.InvalidInput, match=message):
            record_payment(world.c, sent, "cli")
    assert world.purchases(payment["id"]) == 1
