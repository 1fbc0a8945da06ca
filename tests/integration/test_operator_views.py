"""What the operator's read commands return, in process and whole (`users show`, `lock show`, `fraud
quota`, `payments record`): the CLI tests run them in subprocesses, which no mutant reaches. Written
against the mutants of `make mutation` that no test reached."""

from datetime import timedelta

import pytest

from billingctl.domain import errors as e
from billingctl.services import fraud_quota
from billingctl.services import processor_lock as pl
from billingctl.services.payments import record_payment_by_id
from billingctl.services.users import show_user

pytestmark = pytest.mark.integration
NSFW = "credits-pro-nsfw-USD-monthly"


def test_users_show_sums_the_ledger_and_lists_the_newest_payments_first(world):
    first = world.sandbox.pay(world.checkout("user_a", NSFW)["order_id"], processor="NSFW_NMI")
    second = world.sandbox.pay(world.checkout("user_a")["order_id"])
    world.sandbox.pay(world.checkout("user_b")["order_id"])
    shown = show_user(world.c, "user_a")
    assert {k: shown[k] for k in ("user_id", "credits", "ledger_sum", "purchases", "sfw_processor",
                                  "nsfw_processor", "frozen", "frozen_at", "frozen_reason")} == {
        "user_id": "user_a", "credits": 5000, "ledger_sum": 5000, "purchases": 2, "sfw_processor": "SFW_STRIPE",
        "nsfw_processor": "NSFW_NMI", "frozen": False, "frozen_at": None, "frozen_reason": None}
    assert shown["nsfw_processor_mid"] == first["processor"]["processorMerchantId"]
    recent = shown["recent_payments"]
    assert [p["transaction_id"] for p in recent] == [second["id"], first["id"]]
    assert {k: recent[0][k] for k in ("subscription_id", "amount", "currency_code", "credits", "processor",
                                      "recorded_via")} == {
        "subscription_id": second["metadata"]["subscription_id"], "amount": second["amount"],
        "currency_code": "USD", "credits": 2000, "processor": "SFW_STRIPE", "recorded_via": "webhook"}
    assert recent[0]["created_at"] is not None
    with pytest.raises(e.NotFound) as missing:
        show_user(world.c, "user_none")
    assert missing.value.message == "user user_none not found"


def test_lock_show_and_fraud_quota_show(world):
    paid = world.sandbox.pay(world.checkout("user_a", NSFW)["order_id"])
    assert pl.show(world.c, "user_a") == {"user_id": "user_a", "sfw_processor": None,
                                          "nsfw_processor": "NSFW_SEGPAY",
                                          "nsfw_processor_mid": paid["processor"]["processorMerchantId"]}
    world.sandbox.pay(world.checkout("user_a")["order_id"])
    assert pl.show(world.c, "user_a")["sfw_processor"] == "SFW_STRIPE"
    with pytest.raises(e.NotFound) as missing:
        pl.show(world.c, "user_none")
    assert missing.value.message == "user user_none has no lane record"
    now = world.c.clock.now()
    with world.c.uow() as uow:  # found by the runbook tests: a user whose lock write failed could not be shown
        uow.users.ensure("user_never_locked", now)
        uow.commit()
    assert pl.show(world.c, "user_never_locked") == {"user_id": "user_never_locked", "sfw_processor": None,
                                                     "nsfw_processor": None, "nsfw_processor_mid": None}
    quota = fraud_quota.show(world.c, "user_a")
    assert {k: quota[k] for k in ("user_id", "enforced", "tier", "customer_allowed")} == {
        "user_id": "user_a", "enforced": False, "tier": "nsfw", "customer_allowed": True}
    daily = quota["windows"][0]
    assert (daily["window"], daily["used"], daily["limit"], daily["customer_limit"]) == ("daily", 1, 5, 4)
    assert now - timedelta(minutes=5) + timedelta(days=1) < daily["next_slot_frees_at"] <= now + timedelta(days=1)
    assert [w["window"] for w in quota["windows"]] == ["daily", "weekly", "monthly"]


def test_payments_record_by_id_records_the_orchestrators_payment(world):
    co = world.checkout("user_c")
    paid = world.settle(co["order_id"])
    result = record_payment_by_id(world.c, paid["id"])
    assert (result["outcome"], result["payment_id"], result["credits_applied"]) == ("recorded", paid["id"], 2000)
    with world.c.uow() as uow:
        assert uow.purchases.by_payment_id(paid["id"])["recorded_via"] == "cli"
    assert record_payment_by_id(world.c, paid["id"], "webhook")["outcome"] == "duplicate"
    with pytest.raises(e.InvalidInput) as bad:
        record_payment_by_id(world.c, "")
    assert bad.value.message == "payment_id is not a valid id"


def test_a_user_without_payments_shows_zero_and_no_lock(world):
    world.checkout("user_new")  # creates the user, pays nothing
    shown = show_user(world.c, "user_new")
    assert (shown["ledger_sum"], shown["purchases"], shown["recent_payments"]) == (0, 0, [])
    with world.c.uow() as uow:
        uow.locks.ensure("user_new", world.c.clock.now())
        uow.commit()
    assert pl.show(world.c, "user_new") == {"user_id": "user_new", "sfw_processor": None, "nsfw_processor": None,
                                            "nsfw_processor_mid": None}
    with pytest.raises(e.InvalidInput) as bad:
        record_payment_by_id(world.c, "not an id!")
    assert "payment_id" in bad.value.message
