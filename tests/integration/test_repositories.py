"""The repositories' contracts on SQLite and PostgreSQL, where a service's tests cannot tell a wrong
filter from a right one (the in-memory fakes of tests/fakes.py keep the same contracts)."""

from datetime import timedelta

import pytest

from billingctl.domain.quota import LONGEST

pytestmark = pytest.mark.integration


def test_fraud_events_since_filters_on_user_type_and_strictly_after(container):
    now = container.clock.now()
    after = now - LONGEST
    with container.uow() as uow:
        for user, kind, at in (("u1", "authorization_attempt", after), ("u1", "authorization_attempt", now),
                               ("u1", "velocity_triggered", now), ("u2", "authorization_attempt", now),
                               ("u1", "authorization_attempt", after + timedelta(seconds=1))):
            uow.users.ensure(user, now)
            uow.fraud.add(user, kind, at, {"merchant_context": "full", "at": at.isoformat()})
        uow.commit()
        found = uow.fraud.since("u1", "authorization_attempt", after)
    assert sorted(created for created, _ in found) == [after + timedelta(seconds=1), now]


def test_fraud_event_keys_rename_and_remove_one_event(container):
    now = container.clock.now()
    with container.uow() as uow:
        uow.users.ensure("u1", now)
        assert uow.fraud.add("u1", "authorization_attempt", now, {}, "order:1")
        assert not uow.fraud.add("u1", "authorization_attempt", now, {}, "order:1")
        assert uow.fraud.add("u1", "authorization_attempt", now, {}, "order:2")
        assert uow.fraud.rename("order:1", "payment:1") and not uow.fraud.rename("order:9", "payment:9")
        uow.fraud.remove("order:2")
        assert [uow.fraud.exists(k) for k in ("order:1", "payment:1", "order:2")] == [False, True, False]
        uow.commit()


def test_orphan_status_is_the_rows_own(container):
    now = container.clock.now()
    with container.uow() as uow:
        for pid, status in (("pay_a", "retrying"), ("pay_b", "exhausted")):
            uow.orphans.open({"payment_id": pid, "user_id": "u", "status": status, "attempts": 0,
                              "settled_at": now, "created_at": now, "updated_at": now})
        uow.commit()
        assert [uow.orphans.status(p) for p in ("pay_a", "pay_b", "pay_c")] == ["retrying", "exhausted", None]
