"""Account events and watches read exactly what they should: unfreezing lists the payments held for this
user's review and no other; a deleted user's lock row is soft-deleted; the velocity watch counts only
captured charges of the last minute. Written against the survivors of `make mutation`."""

from datetime import timedelta

import pytest
from sqlalchemy import insert, select

from billingctl.adapters.db.tables import transaction, user_credits
from billingctl.services.orphans import list_orphans
from billingctl.services.users import apply_identity_event, freeze, unfreeze, velocity_watch
from tests.integration.test_renewals import world as world  # noqa: F401 - the fixture

pytestmark = pytest.mark.integration


def test_unfreezing_lists_only_this_users_payments_held_for_review(world):
    held = {}
    for user in ("user_a", "user_b"):
        first, later = world.checkout(user), world.checkout(user, "credits-basic-USD-monthly")
        world.sandbox.pay(first["order_id"])
        freeze(world.c, user, "fraud review", "ops")
        held[user] = world.sandbox.pay(later["order_id"])["id"]  # settled while frozen: held for review
    retrying = world.sandbox.pay(world.checkout("user_c")["order_id"], drop_webhook=True)
    with world.c.uow() as uow:
        uow.orphans.open({"payment_id": retrying["id"], "user_id": "user_a", "status": "retrying", "attempts": 0,
                          "settled_at": world.c.clock.now(), "created_at": world.c.clock.now(),
                          "updated_at": world.c.clock.now()})
        uow.commit()
    plan = unfreeze(world.c, "user_a", "cleared", "ops", dry_run=True)
    assert plan == {"user_id": "user_a", "was_frozen": True, "held_payments": [held["user_a"]], "dry_run": True}
    assert unfreeze(world.c, "user_a", "cleared", "ops") == {"user_id": "user_a", "was_frozen": True,
                                                             "held_payments": [held["user_a"]], "frozen": False,
                                                             "changed": True}
    assert [o["payment_id"] for o in list_orphans(world.c, "retrying")] == [retrying["id"]]
    assert sorted(o["payment_id"] for o in list_orphans(world.c, "needs_review")) == sorted(held.values())
    assert len(list_orphans(world.c)) == 3


def test_a_deleted_user_keeps_its_lock_row_soft_deleted_and_only_the_live_one(world):
    now = world.c.clock.now()
    for user in ("user_d", "user_e"):
        apply_identity_event(world.c, "user.created", {"id": user, "email": f"{user}@example.test"})
    with world.c.uow() as uow:
        uow.execute(insert(user_credits).values(user_id="user_d", nsfw_processor="NSFW_NMI", created_at=now))
        uow.execute(insert(user_credits).values(user_id="user_e", nsfw_processor="NSFW_NMI", created_at=now))
        uow.commit()
    world.c.clock.advance(60)
    apply_identity_event(world.c, "user.deleted", {"id": "user_d"})
    world.c.clock.advance(60)
    apply_identity_event(world.c, "user.deleted", {"id": "user_d"})  # a repeat moves nothing
    with world.c.uow() as uow:
        rows = uow.execute(select(user_credits.c.user_id, user_credits.c.deleted_at)
                           .order_by(user_credits.c.user_id)).all()
    assert [tuple(r) for r in rows] == [("user_d", now + timedelta(seconds=60)), ("user_e", None)]


def test_the_velocity_watch_counts_captured_charges_of_the_last_minute_only(world):
    now = world.c.clock.now()
    rows = [("speedy", "captured", 100, 1)] * 10 + [("speedy", "failed", 100, 1), ("speedy", "captured", 100, 61),
                                                    ("calm", "captured", 70, 0)]
    with world.c.uow() as uow:
        for n, (user, status, amount, age) in enumerate(rows):
            uow.execute(insert(transaction).values(transaction_id=f"pay_{n}", amount=amount, status=status,
                                                   created_at=now - timedelta(seconds=age), customer_id=user))
        uow.commit()
    result = velocity_watch(world.c)
    assert (result["charges"], result["amount"], result["offenders"], result["total_alert"]) == (11, 1070, [], True)
