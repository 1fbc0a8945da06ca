"""Tests that kill the survivors of the hand-made mutation run recorded in issue "A month of traffic":
each mutant passed the whole suite before; each test here fails on its mutant and passes on the code."""

import pytest
from sqlalchemy import func, insert, select

from billingctl.adapters.db.tables import credit_ledger, fraud_event, orphan_recovery, users
from billingctl.services import orphans
from billingctl.services.payments import reverse_refund
from billingctl.services.processor_lock import read_lock

pytestmark = pytest.mark.integration
PRO, BASIC, NSFW = "credits-pro-USD-monthly", "credits-basic-USD-monthly", "credits-pro-nsfw-USD-monthly"


def reversed_credits(world, payment_id):
    with world.c.uow() as uow:
        return -int(uow.execute(select(func.coalesce(func.sum(credit_ledger.c.amount), 0)).where(
            credit_ledger.c.payment_id == payment_id, credit_ledger.c.reason == "refund")).scalar_one())


def test_refund_reversal_is_the_refunded_share_capped_and_keyed_by_the_cumulative_amount(world):
    """Survivors: a partial refund reversing all the credits; no cap on the refunded share; the ledger
    key without the cumulative share."""
    co = world.checkout()
    payment = world.sandbox.pay(co["order_id"])  # 2000 credits for `amount`
    amount = payment["amount"]
    third = amount // 3
    assert reverse_refund(world.c, payment["id"], third, "test")["credits_reversed"] == 2000 * third // amount
    assert reversed_credits(world, payment["id"]) == 2000 * third // amount  # a share, not everything
    reverse_refund(world.c, payment["id"], 2 * third, "test")  # a second refund: its own ledger row
    assert reversed_credits(world, payment["id"]) == 2000 * (2 * third) // amount
    reverse_refund(world.c, payment["id"], amount * 5, "test")  # more than was paid: capped
    assert reversed_credits(world, payment["id"]) == 2000
    assert world.credits() == 0


def test_an_sfw_lock_writes_no_merchant_account(world):
    co = world.checkout(item_price_id=PRO)
    world.sandbox.pay(co["order_id"], processor="SFW_STRIPE")
    with world.c.uow() as uow:
        lock = read_lock(uow, "user_a")
    assert lock["sfw_processor"] == "SFW_STRIPE" and lock["nsfw_processor_mid"] in (None, "")


def test_the_quota_counts_only_attempts_in_the_full_merchant_context(world):
    from billingctl.domain.quota import CUSTOMER
    from billingctl.services.fraud_quota import attempt_times

    now = world.c.clock.now()
    with world.c.uow() as uow:
        for context in ("full", "full", "other", "other", "other"):
            uow.execute(insert(fraud_event).values(user_id="u_q", event_type="authorization_attempt", created_at=now,
                                                   metadata={"merchant_context": context}))
        uow.commit()
        assert len(attempt_times(uow, "u_q", now)) == 2
    from billingctl.domain.quota import authorization_quota

    with world.c.uow() as uow:
        assert authorization_quota(attempt_times(uow, "u_q", now), now, CUSTOMER).allowed


def test_an_active_subscription_to_another_plan_is_not_a_same_plan_duplicate(one_try_world):
    """Survivor: the same-plan check ignoring the plan (any active subscription counted)."""
    from billingctl.services.checkout import cleanup_expired

    world = one_try_world
    world.sandbox.pay(world.checkout(item_price_id=BASIC)["order_id"])  # holds another plan
    co = world.checkout(item_price_id=PRO)
    world.advance(2 * 86400)  # both clocks to one instant: ours must not fall behind the sandbox's
    assert co["subscription_id"] in cleanup_expired(world.c)["cancelled"]
    payment = world.sandbox.pay(co["order_id"])
    world.advance(16)
    assert orphans.run_orphans(world.c)["outcomes"] == {"recovered": 1, "recorded": 1}
    assert world.sandbox.store.get("payment", payment["id"])["processor"]["amountRefunded"] == 0


def test_a_claimed_orphan_row_cannot_be_claimed_again(one_try_world):
    """Survivor: two orphan runners both claiming one row."""
    world = one_try_world
    now = world.c.clock.now()
    with world.c.uow() as uow:
        uow.execute(insert(users).values(id="u_o", created_at=now, credits=0))
        uow.execute(insert(orphan_recovery).values(payment_id="pay_claim", user_id="u_o", status="retrying",
                                                   attempts=0, next_attempt_at=now, settled_at=now, created_at=now,
                                                   updated_at=now))
        uow.commit()
    assert orphans._claim(world.c, "pay_claim") is not None
    assert orphans._claim(world.c, "pay_claim") is None


def test_the_refund_idempotency_key_is_the_payment_id(one_try_world):
    """Survivor: the refund idempotency key random per call. Recovery's refund goes out with the key the
    orchestrator dedupes on, so two runners (or a retry after a lost answer) make one refund."""
    world = one_try_world
    payment = world.sandbox.pay(world.checkout()["order_id"], drop_webhook=True)
    orphans.refund(world.c, payment["id"])
    stored = world.sandbox.store.idempotent_result(f"/payments/{payment['id']}/refund:refund:{payment['id']}")
    assert stored is not None and stored["status"] == 200  # the orchestrator holds the answer under that key
    assert len(world.sandbox.store.get("payment", payment["id"])["refunds"]) == 1


def test_any_secret_of_a_rotation_verifies_wherever_it_stands():
    """Survivor: secret rotation where only the last comparison counts."""
    import base64
    import hashlib
    import hmac

    from webhooks_app.signatures import matches_any, verify_orchestrator

    raw = b'{"x": 1}'
    good = base64.b64encode(hmac.new(b"new", raw, hashlib.sha256).digest()).decode()
    verify_orchestrator(raw, good, None, ["new", "old"])  # the matching secret first
    verify_orchestrator(raw, good, None, ["old", "new"])  # and last
    verify_orchestrator(raw, "nonsense", good, ["new", "old"])  # the matching header second
    assert matches_any("wf-new", ["wf-new", "wf-old"]) and matches_any("wf-new", ["wf-old", "wf-new"])


def test_a_media_signature_is_compared_whole_never_by_prefix():
    """Survivor: a media signature compared by prefix."""
    from billingctl.services import media

    url = media.sign("s3cret", "/media/a.png", 1_700_000_000)
    for cut in (1, 5, 20):
        assert not media.verify("s3cret", url[:-cut], 1_700_000_001, 300000).valid
    assert not media.verify("s3cret", url + "A", 1_700_000_001, 300000).valid
