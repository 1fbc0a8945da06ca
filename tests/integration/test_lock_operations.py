"""The processor-lock operator commands (spec section 2, rules 5, 6 and 11) return exact documents (runbook
scripts parse them with --json), write exact rows and one audit row each, and refuse with exact
messages. Written against the survivors of `make mutation`."""

import pytest
from sqlalchemy import insert, select, text, update

from billingctl.adapters.db.tables import audit_log, transaction, user_credits, users
from billingctl.domain import errors as e
from billingctl.services import processor_lock as pl
from tests.helpers import table_away
from tests.integration.test_processor_lock import NOW, lock_row, settle

pytestmark = pytest.mark.integration
NSFW = "credits-pro-nsfw-USD-monthly"


def audits(world):
    with world.c.uow() as uow:
        return [tuple(r) for r in uow.execute(select(audit_log.c.actor, audit_log.c.action, audit_log.c.target,
                                                     audit_log.c.reason, audit_log.c.details)
                                              .order_by(audit_log.c.id)).all()]


def repairs(world, lane, outcome):
    return world.c.metrics.sample("billing_processor_repair_outcome_total", {"lane": lane, "outcome": outcome})


def unlocked_with_history(world, user, processors):
    """Settled payments on these processors (oldest first), never recorded: the user is not locked."""
    for processor in processors:
        world.settle(world.checkout(user, NSFW)["order_id"], processor=processor)
        world.sandbox.store.advance_clock(60)


def test_repair_locks_the_first_settled_processor_with_its_merchant_account_and_audits(world):
    unlocked_with_history(world, "user_h", ["NSFW_NMI", "NSFW_SEGPAY"])
    first = world.sandbox.payments(status="SETTLED")[0]
    result = pl.repair(world.c, "user_h", "nsfw", actor="ops")
    assert result == {"user_id": "user_h", "lane": "nsfw", "outcome": "locked", "processor": "NSFW_NMI",
                      "from_payment": first["id"]}
    row = lock_row(world, "user_h")
    assert row["nsfw_processor_mid"]
    assert (row["nsfw_processor"], row["nsfw_processor_mid"], row["sfw_processor"]) == (
        "NSFW_NMI", first["processor"]["processorMerchantId"], None)
    assert audits(world) == [("ops", "lock.repair", "user_h", None,
                              {"lane": "nsfw", "processor": "NSFW_NMI", "payment": first["id"]})]
    assert repairs(world, "nsfw", "locked") == 1
    with pytest.raises(e.Refused) as refused:
        pl.repair(world.c, "user_h", "nsfw")
    assert refused.value.message == "user user_h is already locked on nsfw to NSFW_NMI"
    assert repairs(world, "nsfw", "locked") == 2


def test_repair_reads_only_the_users_own_history_and_reports_a_failed_write(world):
    world.settle(world.checkout("user_o", NSFW)["order_id"], processor="NSFW_CCBILL")  # another user's, earlier
    world.sandbox.store.advance_clock(60)
    world.settle(world.checkout("user_h", NSFW)["order_id"], processor="NSFW_NMI")
    with world.c.engine.begin() as conn:  # the lock row cannot be written (the read succeeds: no row yet)
        conn.execute(text("CREATE TRIGGER no_lock BEFORE INSERT ON user_credits BEGIN SELECT RAISE(ABORT, 'x'); END")
                     if world.c.engine.dialect.name == "sqlite" else text(
            "CREATE OR REPLACE FUNCTION no_lock() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION 'x'; END $$ "
            "LANGUAGE plpgsql; CREATE TRIGGER no_lock BEFORE INSERT ON user_credits EXECUTE FUNCTION no_lock()"))
    try:
        failed = pl.repair(world.c, "user_h", "nsfw")
    finally:
        with world.c.engine.begin() as conn:
            conn.execute(text("DROP TRIGGER no_lock" + ("" if world.c.engine.dialect.name == "sqlite"
                                                        else " ON user_credits")))
    assert {k: v for k, v in failed.items() if k != "error"} == {"user_id": "user_h", "lane": "nsfw",
                                                                   "outcome": "unavailable"}
    assert failed["error"] in ("IntegrityError", "InternalError", "ProgrammingError")  # the driver's class name
    assert repairs(world, "nsfw", "unavailable") == 1
    assert pl.repair(world.c, "user_h", "nsfw")["processor"] == "NSFW_NMI"  # its own first payment, not user_o's


def test_repair_on_sfw_writes_no_merchant_account(world):
    world.settle(world.checkout("user_s", "credits-pro-USD-monthly")["order_id"], processor="SFW_ADYEN")
    assert pl.repair(world.c, "user_s", "sfw")["processor"] == "SFW_ADYEN"
    row = lock_row(world, "user_s")
    assert (row["sfw_processor"], row["nsfw_processor"], row["nsfw_processor_mid"]) == ("SFW_ADYEN", None, None)
    assert [a[0] for a in audits(world)] == ["operator"]  # the repair's actor when none is named


def test_repair_without_history_or_orchestrator_or_database_says_so_exactly(world):
    assert pl.repair(world.c, "user_none", "sfw") == {"user_id": "user_none", "lane": "sfw", "outcome": "no_history"}
    world.sandbox.store.add_fault("orchestrator", "500", path="/payments", count=-1)
    assert pl.repair(world.c, "user_x", "nsfw") == {"user_id": "user_x", "lane": "nsfw", "outcome": "unavailable",
                                                    "error": "orchestrator: internal error"}
    world.sandbox.store.clear_faults()
    with table_away(world.c.engine, "user_credits"):
        result = pl.repair(world.c, "user_y", "sfw")
    assert result == {"user_id": "user_y", "lane": "sfw", "outcome": "unavailable", "error": "OperationalError"
                      if world.c.engine.dialect.name == "sqlite" else "ProgrammingError"}
    assert [repairs(world, lane, o) for lane, o in (("sfw", "no_history"), ("nsfw", "unavailable"),
                                                      ("sfw", "unavailable"))] == [1, 1, 1]
    with pytest.raises(e.InvalidInput) as bad:
        pl.repair(world.c, "user_x", "adult")
    assert bad.value.message == "lane must be one of sfw, nsfw"


def test_clear_returns_its_plan_clears_the_lane_and_audits(world):
    settle(world, processor="NSFW_SEGPAY")
    with pytest.raises(e.Refused) as refused:
        pl.clear(world.c, "user_a", "nsfw", "wrong lock", "ops")
    assert refused.value.message == "user user_a has 1 successful transaction(s) on NSFW_SEGPAY; the lock stays"
    with world.c.uow() as uow:
        uow.execute(update(user_credits).values(nsfw_processor="NSFW_CCBILL", nsfw_processor_mid="mid_bad",
                                                sfw_processor="SFW_STRIPE"))
        uow.commit()
    plan = {"user_id": "user_a", "lane": "nsfw", "cleared_processor": "NSFW_CCBILL", "cleared_mid": "mid_bad"}
    assert pl.clear(world.c, "user_a", "nsfw", "wrong lock", "ops", dry_run=True) == {**plan, "dry_run": True}
    assert pl.clear(world.c, "user_a", "nsfw", "wrong lock", "ops") == plan
    row = lock_row(world)
    assert (row["nsfw_processor"], row["nsfw_processor_mid"], row["sfw_processor"]) == (None, None, "SFW_STRIPE")
    assert audits(world) == [("ops", "lock.clear", "user_a", "wrong lock", plan)]
    with pytest.raises(e.Refused) as refused:
        pl.clear(world.c, "user_a", "nsfw", "again", "ops")
    assert refused.value.message == "user user_a is not locked on nsfw"
    with pytest.raises(e.InvalidInput) as bad:
        pl.clear(world.c, "user_a", "sfw", "  ", "ops")
    assert bad.value.message == "a reason is required"


def test_clearing_sfw_reports_no_merchant_account_and_keeps_the_nsfw_one(world):
    with world.c.uow() as uow:
        uow.execute(insert(users).values(id="user_b", created_at=NOW))
        uow.execute(insert(user_credits).values(user_id="user_b", sfw_processor="SFW_ADYEN",
                                                nsfw_processor="NSFW_NMI", nsfw_processor_mid="m1", created_at=NOW))
        uow.commit()
    assert pl.clear(world.c, "user_b", "sfw", "typo", "ops") == {
        "user_id": "user_b", "lane": "sfw", "cleared_processor": "SFW_ADYEN", "cleared_mid": None}
    row = lock_row(world, "user_b")
    assert (row["sfw_processor"], row["nsfw_processor"], row["nsfw_processor_mid"]) == (None, "NSFW_NMI", "m1")


def test_a_soft_deleted_lock_row_is_neither_cleared_nor_repaired(world):
    """Rule 4: soft-deleted rows are excluded from every reader and writer."""
    with world.c.uow() as uow:
        uow.execute(insert(users).values(id="user_d", created_at=NOW))
        uow.execute(insert(user_credits).values(user_id="user_d", nsfw_processor="NSFW_NMI", created_at=NOW,
                                                deleted_at=NOW))
        uow.execute(insert(user_credits).values(user_id="user_d", nsfw_processor="NSFW_CCBILL", created_at=NOW))
        uow.commit()
    pl.clear(world.c, "user_d", "nsfw", "wrong", "ops")
    with world.c.uow() as uow:
        rows = uow.execute(select(user_credits.c.nsfw_processor, user_credits.c.deleted_at.is_(None))
                           .order_by(user_credits.c.id)).all()
    assert [tuple(r) for r in rows] == [("NSFW_NMI", False), (None, True)]


def test_backfill_returns_what_it_filled_and_audits_once(world):
    legacy = world.c.settings.legacy_nmi_processor
    with world.c.uow() as uow:
        for uid in ("legacy_1", "legacy_2"):
            uow.execute(insert(users).values(id=uid, created_at=NOW))
            uow.execute(insert(user_credits).values(user_id=uid, nsfw_processor=legacy, created_at=NOW))
            for n, (status, mid) in enumerate((("failed", "mid_failed"), ("captured", ""),
                                                ("captured", f"mid_{uid}"), ("captured", "mid_later"))):
                uow.execute(insert(transaction).values(
                    transaction_id=f"pay_{uid}_{n}", amount=1, status=status, customer_id=uid, processor=legacy,
                    processor_merchant_id=mid, created_at=NOW.replace(minute=n)))
        uow.commit()
    filled = [{"user_id": "legacy_1", "nsfw_processor_mid": "mid_legacy_1"},
              {"user_id": "legacy_2", "nsfw_processor_mid": "mid_legacy_2"}]
    assert pl.backfill_mid(world.c, actor="ops", dry_run=True) == {"dry_run": True, "filled": filled,
                                                                    "without_history": []}
    assert audits(world) == []
    assert pl.backfill_mid(world.c, actor="ops") == {"dry_run": False, "filled": filled, "without_history": []}
    assert lock_row(world, "legacy_2")["nsfw_processor_mid"] == "mid_legacy_2"
    assert audits(world) == [("ops", "lock.backfill-mid", "*", None, {"filled": filled})]
    assert pl.backfill_mid(world.c, actor="ops") == {"dry_run": False, "filled": [], "without_history": []}
    assert len(audits(world)) == 1  # nothing filled: nothing audited
