"""The processor lock, rule by rule (spec section 2, "Processor lock" 1-11), metrics read back with
their labels and the log markers captured verbatim."""

import logging
import threading
from datetime import UTC, datetime

import pytest
from sqlalchemy import insert, select, update

from billingctl.adapters.db.tables import audit_log, transaction, user_credits, users
from billingctl.domain import errors as e
from billingctl.services import processor_lock as pl
from billingctl.services.payments import record_payment
from tests.helpers import plan_not_held, table_away

pytestmark = pytest.mark.integration
NOW = datetime(2026, 11, 21, tzinfo=UTC)


NSFW_PLANS = ("credits-pro-nsfw-USD-monthly", "credits-max-nsfw-USD-monthly")


def settle(world, user="user_a", plan=None, processor=None):
    """A paid NSFW checkout: of a plan the user does not hold yet (one live subscription per plan); a third
    settle of the lane cancels the user's subscriptions first."""
    if plan is None:
        try:
            plan = plan_not_held(world.c, user, NSFW_PLANS)
        except AssertionError:
            _cancel_all(world, user)
            plan = NSFW_PLANS[0]
    co = world.checkout(user, plan)
    payment = world.settle(co["order_id"], processor=processor)
    return record_payment(world.c, payment, "webhook")


def _cancel_all(world, user):
    from billingctl.services.sync import cancel_subscription

    with world.c.uow() as uow:
        held = [sid for plan in NSFW_PLANS for sid in uow.subscriptions.holding_plan(user, plan, None)]
    for sub_id in held:
        cancel_subscription(world.c, sub_id, "test: settle the lane again", "test")


def lock_row(world, user="user_a"):
    with world.c.uow() as uow:
        return pl.read_lock(uow, user)


def outcome(world, lane, psp, result):
    return world.c.metrics.sample("billing_processor_lock_outcome_total", {"lane": lane, "psp": psp, "outcome": result})


def test_rule_1_no_preassignment_unlocked_is_normal(world):
    world.checkout()
    assert lock_row(world) is None  # checkout assigns nothing
    result = settle(world, plan="credits-pro-USD-monthly")
    assert result["lock"]["outcome"] == "locked"


def test_rules_2_3_workflow_routes_and_the_settled_processor_is_locked_with_the_mid(world):
    result = settle(world)  # the NSFW workflow routes to its high-risk default
    row = lock_row(world)
    assert (row["nsfw_processor"], row["nsfw_processor_mid"]) == ("NSFW_SEGPAY", "mid_NSFW_SEGPAY_1")
    assert row["sfw_processor"] in (None, "")
    assert result["lock"]["outcome"] == "locked"
    assert outcome(world, "nsfw", "NSFW_SEGPAY", "locked") == 1


def test_rule_3_first_write_wins_and_is_permanent(world, caplog):
    settle(world, processor="NSFW_SEGPAY")
    with caplog.at_level(logging.WARNING, logger="billingctl.processor_lock"):
        result = settle(world, processor="NSFW_CCBILL")
    assert result["lock"]["outcome"] == "already_locked"
    assert lock_row(world)["nsfw_processor"] == "NSFW_SEGPAY"
    # Rule 8: drift within the lane
    assert "settled processor differs from locked psp" in [r.getMessage() for r in caplog.records]
    assert [r.levelname for r in caplog.records if r.getMessage() == "settled processor differs from locked psp"] == [
        "WARNING"]
    assert world.c.metrics.sample("billing_processor_lock_drift_total",
                                  {"lane": "nsfw", "locked_psp": "NSFW_SEGPAY", "settled_psp": "NSFW_CCBILL"}) == 1
    assert outcome(world, "nsfw", "NSFW_CCBILL", "already_locked") == 1


def test_rule_8_sfw_fallback_counts_drift_on_its_own_lane(world):
    settle(world, plan="credits-pro-USD-monthly", processor="SFW_STRIPE")
    settle(world, plan="credits-basic-USD-monthly", processor="SFW_ADYEN")
    assert world.c.metrics.sample("billing_processor_lock_drift_total",
                                  {"lane": "sfw", "locked_psp": "SFW_STRIPE", "settled_psp": "SFW_ADYEN"}) == 1
    assert world.c.metrics.sample("billing_processor_lock_drift_total",
                                  {"lane": "nsfw", "locked_psp": "SFW_STRIPE", "settled_psp": "SFW_ADYEN"}) == 0


def test_rule_4_soft_deleted_rows_are_excluded_from_the_writers(world):
    with world.c.uow() as uow:
        uow.execute(insert(users).values(id="user_a", created_at=NOW))
        uow.execute(insert(user_credits).values(user_id="user_a", nsfw_processor="NSFW_CCBILL",
                                                nsfw_processor_mid="old", created_at=NOW, deleted_at=NOW))
        uow.commit()
    result = settle(world, processor="NSFW_SEGPAY")
    assert result["lock"]["outcome"] == "locked"
    with world.c.uow() as uow:
        rows = uow.execute(select(user_credits.c.nsfw_processor, user_credits.c.deleted_at)
                           .order_by(user_credits.c.id)).all()
    assert [r[0] for r in rows] == ["NSFW_CCBILL", "NSFW_SEGPAY"]
    assert rows[0][1] is not None and rows[1][1] is None


def test_rule_9_cross_lane_settle_on_a_locked_user_is_a_debug_line(world, caplog):
    settle(world, plan="credits-pro-USD-monthly", processor="SFW_STRIPE")
    with caplog.at_level(logging.DEBUG, logger="billingctl.processor_lock"):
        result = settle(world, plan="credits-basic-USD-monthly", processor="NSFW_SEGPAY")
    record = [r for r in caplog.records if r.getMessage() == "cross-lane settle on a locked user"]
    assert [(r.levelname, r.user_id, r.lane, r.processor) for r in record] == [
        ("DEBUG", "user_a", "sfw", "NSFW_SEGPAY")]
    row = lock_row(world)
    assert row["sfw_processor"] == "SFW_STRIPE" and row["nsfw_processor"] in (None, "")
    assert result["lock"] == {"lane": "sfw", "outcome": "already_locked", "psp": "NSFW_SEGPAY",
                              "locked_processor": "SFW_STRIPE"}
    assert outcome(world, "sfw", "NSFW_SEGPAY", "already_locked") == 1


def test_rule_10_unknown_processor_logs_an_error_and_locks_nothing(world, caplog):
    with caplog.at_level(logging.ERROR, logger="billingctl.processor_lock"):
        result = settle(world, processor="MYSTERY_PSP")
    assert [(r.levelname, r.user_id, r.processor, r.lane) for r in caplog.records
            if r.getMessage() == "settled processor is unknown to every lane"] == [
        ("ERROR", "user_a", "MYSTERY_PSP", "nsfw")]
    assert result["lock"]["outcome"] == "unknown_processor"
    assert outcome(world, "nsfw", "other", "unknown_processor") == 1
    row = lock_row(world)
    assert row is None or row["nsfw_processor"] in (None, "")
    assert world.credits() == 3000  # the payment itself is recorded
    # Already-locked users are unaffected.
    settle(world, processor="NSFW_SEGPAY")
    settle(world, processor="MYSTERY_PSP")
    assert lock_row(world)["nsfw_processor"] == "NSFW_SEGPAY"


def test_a_recorded_payment_reports_its_lock_outcome_whole(world):
    """The lock's result travels with the recorded payment (`lock`): the lane it was judged on, the
    outcome, the processor as counted (an unknown name counts as `other`) and the processor the lane is
    locked to. Written against the survivors of `make mutation`."""
    first = settle(world, processor="NSFW_SEGPAY")
    assert first["lock"] == {"lane": "nsfw", "outcome": "locked", "psp": "NSFW_SEGPAY",
                             "locked_processor": "NSFW_SEGPAY"}
    again = settle(world, processor="NSFW_CCBILL")
    assert again["lock"] == {"lane": "nsfw", "outcome": "already_locked", "psp": "NSFW_CCBILL",
                             "locked_processor": "NSFW_SEGPAY"}
    unknown = settle(world, processor="MYSTERY_PSP")
    assert unknown["lock"] == {"lane": "nsfw", "outcome": "unknown_processor", "psp": "other",
                               "locked_processor": None}


def test_a_lock_write_that_fails_is_counted_and_the_payment_is_still_recorded(world):
    """The gate runs inside the recording's transaction; when the lock table cannot be written the settle is
    counted assign_error (lane, psp) and reported so, and the payment, its credits and its purchase are
    recorded all the same. Written against the survivors of `make mutation`."""
    co = world.checkout("user_w", "credits-pro-nsfw-USD-monthly")
    payment = world.settle(co["order_id"], processor="NSFW_SEGPAY")
    with table_away(world.c.engine, "user_credits"):
        result = record_payment(world.c, payment, "webhook")
    assert result["outcome"] == "recorded"
    assert result["lock"] == {"lane": "nsfw", "outcome": "assign_error", "psp": "NSFW_SEGPAY",
                              "locked_processor": None}
    assert outcome(world, "nsfw", "NSFW_SEGPAY", "assign_error") == 1
    assert world.credits("user_w") == result["credits_applied"] > 0
    assert lock_row(world, "user_w") is None  # nothing locked: the next settle locks the lane


def test_no_processor_is_psp_none(world):
    with world.c.uow() as uow:
        result = pl.lock_after_settle(uow, world.c, user_id="user_z", payment_lane="sfw", processor=None,
                                      merchant_id=None)
    assert result == pl.LockResult("sfw", "assign_error", "none", None)
    assert outcome(world, "sfw", "none", "assign_error") == 1


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_two_concurrent_first_settles_one_locked_one_lost_race(world, monkeypatch):
    with world.c.uow() as uow:
        uow.execute(insert(users).values(id="user_r", created_at=NOW))
        uow.execute(insert(user_credits).values(user_id="user_r", created_at=NOW))
        uow.commit()
    a_updated, b_read = threading.Event(), threading.Event()
    real_read = pl.read_lock
    results = {}

    def read_then_signal(uow, user_id):
        row = real_read(uow, user_id)
        if threading.current_thread().name == "B":
            b_read.set()
        return row

    monkeypatch.setattr(pl, "read_lock", read_then_signal)

    def a():
        with world.c.uow() as uow:
            results["A"] = pl.lock_after_settle(uow, world.c, user_id="user_r", payment_lane="nsfw",
                                                processor="NSFW_SEGPAY", merchant_id="m1")
            a_updated.set()
            b_read.wait(10)
            uow.commit()

    def b():
        a_updated.wait(10)
        with world.c.uow() as uow:
            results["B"] = pl.lock_after_settle(uow, world.c, user_id="user_r", payment_lane="nsfw",
                                                processor="NSFW_CCBILL", merchant_id="m2")
            uow.commit()

    threads = [threading.Thread(target=a, name="A"), threading.Thread(target=b, name="B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert (results["A"].outcome, results["B"].outcome) == ("locked", "lost_race")
    row = lock_row(world, "user_r")
    assert (row["nsfw_processor"], row["nsfw_processor_mid"]) == ("NSFW_SEGPAY", "m1")
    assert outcome(world, "nsfw", "NSFW_CCBILL", "lost_race") == 1
    # Issue "Money paths" 13: the race was lost to another processor of the lane, which is drift (rule 8).
    assert world.c.metrics.sample("billing_processor_lock_drift_total", {
        "lane": "nsfw", "locked_psp": "NSFW_SEGPAY", "settled_psp": "NSFW_CCBILL"}) == 1


def test_a_lock_read_before_another_settle_locked_the_lane_loses_the_race(world, monkeypatch, caplog):
    """The lost race on either database: this settle read the lane unlocked (before the other settle's
    commit, which the threaded test above interleaves on PostgreSQL); its conditional write then finds
    the lane locked. It reports the winner, counts lost_race, and the other processor is drift."""
    settle(world, processor="NSFW_SEGPAY")
    real_read, reads = pl.read_lock, []

    def read_before_the_other_commit(uow, user_id):
        reads.append(user_id)
        return None if len(reads) == 1 else real_read(uow, user_id)

    monkeypatch.setattr(pl, "read_lock", read_before_the_other_commit)
    with caplog.at_level(logging.WARNING, logger="billingctl.processor_lock"), world.c.uow() as uow:
        result = pl.lock_after_settle(uow, world.c, user_id="user_a", payment_lane="nsfw", processor="NSFW_CCBILL",
                                      merchant_id="m2")
        uow.commit()
    assert result == pl.LockResult("nsfw", "lost_race", "NSFW_CCBILL", "NSFW_SEGPAY")
    assert reads == ["user_a", "user_a"]  # the winner is read again after the refused write
    assert outcome(world, "nsfw", "NSFW_CCBILL", "lost_race") == 1
    assert world.c.metrics.sample("billing_processor_lock_drift_total", {
        "lane": "nsfw", "locked_psp": "NSFW_SEGPAY", "settled_psp": "NSFW_CCBILL"}) == 1
    [drift] = [r for r in caplog.records if r.getMessage() == "settled processor differs from locked psp"]
    assert (drift.user_id, drift.lane, drift.locked_psp, drift.settled_psp) == (
        "user_a", "nsfw", "NSFW_SEGPAY", "NSFW_CCBILL")
    assert lock_row(world)["nsfw_processor"] == "NSFW_SEGPAY"


def test_concurrent_first_settles_leave_exactly_one_winner(world):
    """On either database, whatever the interleaving: one lock, the winner's."""
    cos = [world.checkout("user_c", plan) for plan in NSFW_PLANS]  # two plans: one live subscription per plan
    payments = [world.settle(cos[0]["order_id"], processor="NSFW_SEGPAY"),
                world.settle(cos[1]["order_id"], processor="NSFW_CCBILL")]
    barrier = threading.Barrier(2)
    results = []

    def go(p):
        barrier.wait()
        results.append(record_payment(world.c, p, "webhook")["lock"])

    threads = [threading.Thread(target=go, args=(p,)) for p in payments]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [r for r in results if r["outcome"] == "locked"]
    assert len(winners) == 1
    losers = [r["outcome"] for r in results if r["outcome"] != "locked"]
    assert len(losers) == 1 and losers[0] in ("already_locked", "lost_race")
    assert lock_row(world, "user_c")["nsfw_processor"] == winners[0]["psp"]


def test_rule_6_clear_only_without_a_successful_transaction(world):
    settle(world, processor="NSFW_SEGPAY")
    with pytest.raises(e.Refused, match="successful transaction"):
        pl.clear(world.c, "user_a", "nsfw", "wrong lock", "ops")
    # The stored processor had no successful transaction: e.g. a lock set wrongly by hand.
    with world.c.uow() as uow:
        uow.execute(update(user_credits).values(nsfw_processor="NSFW_CCBILL", nsfw_processor_mid="bad"))
        uow.commit()
    plan = pl.clear(world.c, "user_a", "nsfw", "wrong lock", "ops", dry_run=True)
    assert plan["dry_run"] and lock_row(world)["nsfw_processor"] == "NSFW_CCBILL"
    pl.clear(world.c, "user_a", "nsfw", "wrong lock", "ops")
    row = lock_row(world)
    assert row["nsfw_processor"] is None and row["nsfw_processor_mid"] is None  # cleared together
    with world.c.uow() as uow:
        audit = uow.execute(select(audit_log.c.action, audit_log.c.reason, audit_log.c.actor)).all()
    assert [tuple(a) for a in audit] == [("lock.clear", "wrong lock", "ops")]
    settle(world, processor="NSFW_CCBILL")  # the next settle re-locks
    assert lock_row(world)["nsfw_processor"] == "NSFW_CCBILL"


def test_rule_5_backfill_only_the_legacy_mid(world):
    legacy = world.c.settings.legacy_nmi_processor
    with world.c.uow() as uow:
        for uid, proc, mid in (("legacy_1", legacy, None), ("legacy_2", legacy, ""), ("legacy_3", legacy, "keep"),
                               ("modern", "NSFW_SEGPAY", None), ("no_hist", legacy, None)):
            uow.execute(insert(users).values(id=uid, created_at=NOW))
            uow.execute(insert(user_credits).values(user_id=uid, nsfw_processor=proc, nsfw_processor_mid=mid,
                                                    created_at=NOW))
            if uid != "no_hist":
                uow.execute(insert(transaction).values(transaction_id=f"pay_{uid}", amount=1, status="captured",
                                                       created_at=NOW, customer_id=uid, processor=proc,
                                                       processor_merchant_id=f"mid_{uid}"))
        uow.commit()
    dry = pl.backfill_mid(world.c, dry_run=True)
    assert sorted(f["user_id"] for f in dry["filled"]) == ["legacy_1", "legacy_2"]
    assert lock_row(world, "legacy_1")["nsfw_processor_mid"] is None
    result = pl.backfill_mid(world.c)
    assert result["without_history"] == ["no_hist"]
    assert lock_row(world, "legacy_1")["nsfw_processor_mid"] == "mid_legacy_1"
    assert lock_row(world, "legacy_2")["nsfw_processor_mid"] == "mid_legacy_2"
    assert lock_row(world, "legacy_3")["nsfw_processor_mid"] == "keep"
    assert lock_row(world, "modern")["nsfw_processor_mid"] is None
    assert {lock_row(world, u)["nsfw_processor"] for u in ("legacy_1", "legacy_2", "modern")} == {legacy, "NSFW_SEGPAY"}


def test_rule_9_cross_lane_settle_on_an_unlocked_user_is_a_debug_line_not_a_write_failure(world, caplog):
    """Issue "Money paths" 13: it used to log a warning and count assign_error, which pages."""
    with caplog.at_level(logging.DEBUG, logger="billingctl.processor_lock"):
        result = settle(world, plan="credits-basic-USD-monthly", processor="NSFW_SEGPAY")
    record = [r for r in caplog.records if r.getMessage() == "cross-lane settle on an unlocked user; not locked"]
    assert [(r.levelname, r.user_id, r.lane, r.processor) for r in record] == [
        ("DEBUG", "user_a", "sfw", "NSFW_SEGPAY")]
    assert result["lock"] == {"lane": "sfw", "outcome": "cross_lane", "psp": "NSFW_SEGPAY", "locked_processor": None}
    assert outcome(world, "sfw", "NSFW_SEGPAY", "assign_error") == 0
    assert outcome(world, "sfw", "NSFW_SEGPAY", "cross_lane") == 1
    assert lock_row(world)["sfw_processor"] in (None, "")


def test_rule_11_every_repair_records_one_outcome_even_refused_or_without_a_database(world):
    """Issue "Money paths" 13: a failed database read recorded nothing (and crashed), a refusal nothing."""
    co = world.checkout("user_h", "credits-pro-nsfw-USD-monthly")
    world.settle(co["order_id"], processor="NSFW_NMI")
    assert pl.repair(world.c, "user_h", "nsfw")["outcome"] == "locked"
    with pytest.raises(e.Refused):
        pl.repair(world.c, "user_h", "nsfw")

    with table_away(world.c.engine, "user_credits"):  # the lock table cannot be read
        assert pl.repair(world.c, "user_h", "sfw")["outcome"] == "unavailable"
    m = world.c.metrics
    assert [m.sample("billing_processor_repair_outcome_total", {"lane": lane, "outcome": o}) for lane, o in
            (("nsfw", "locked"), ("sfw", "unavailable"))] == [2, 1]


def test_rule_11_repair_outcomes(world):
    # locked: history exists but the lock was never written (e.g. an unknown name at the time)
    co = world.checkout("user_h", "credits-pro-nsfw-USD-monthly")
    world.settle(co["order_id"], processor="NSFW_NMI")
    assert pl.repair(world.c, "user_h", "nsfw")["outcome"] == "locked"
    assert lock_row(world, "user_h")["nsfw_processor"] == "NSFW_NMI"
    with pytest.raises(e.Refused):
        pl.repair(world.c, "user_h", "nsfw")
    assert pl.repair(world.c, "user_none", "sfw")["outcome"] == "no_history"
    world.sandbox.store.add_fault("orchestrator", "500", path="/payments", count=-1)
    assert pl.repair(world.c, "user_x", "sfw")["outcome"] == "unavailable"
    m = world.c.metrics
    assert [m.sample("billing_processor_repair_outcome_total", {"lane": lane, "outcome": o}) for lane, o in
            (("nsfw", "locked"), ("sfw", "no_history"), ("sfw", "unavailable"))] == [2, 1, 1]
