"""The manual-review queue for settled payments we must not credit automatically (orphans, payments for
a frozen account). Rows live in `orphan_recovery`, keyed by the orchestrator payment id; `billingctl
orphans list/show/retry/resolve` works them. This module imports nothing from the payment services, so
recording and recovery can both use it."""

from __future__ import annotations

from billingctl.domain import errors as e
from billingctl.domain import lifecycle
from billingctl.services import alerts
from billingctl.services.lifecycles import report_illegal

FROZEN = "user is frozen"
RECORDED = "recorded"  # the resolution of a row ended because its payment was recorded on its own checkout


def frozen_refusal(user_id: str, payment_id: str):
    """What a person is told when a frozen customer's payment would be credited: the two ways out."""
    return e.Refused(f"user {user_id} is frozen: unfreeze them first (billingctl users unfreeze {user_id} "
                     f"--reason R --yes), or refund the payment (billingctl orphans resolve {payment_id} "
                     f"--refund --reason R --yes)")


def move(container, uow, payment_id: str, status: str, **values) -> bool:
    """Every status a review row takes after it opens goes through here (domain.lifecycle.ORPHAN): an
    allowed step is written by a conditional update; a row already there only takes the new values; a
    step the table does not allow is reported (logged, counted, alerted) and not written. True when
    written."""
    values.setdefault("updated_at", container.clock.now())
    while True:
        current = uow.orphans.status(payment_id)
        step = lifecycle.ORPHAN.step(current, status) if current is not None else lifecycle.Step.ILLEGAL
        if step == lifecycle.Step.SAME:
            uow.orphans.set(payment_id, **values)
            return True
        if step != lifecycle.Step.APPLY:
            report_illegal(container, uow, lifecycle.IllegalTransition("orphan", payment_id, current, status))
            return False
        if uow.orphans.move(payment_id, status, lifecycle.ORPHAN.sources(status), **values):
            return True
        # another writer moved it first: judge again against what it wrote


def close_purchase_ended(uow, payment_id: str, now) -> bool:
    """Close the purchase of a payment whose row ended without a subscription (refunded, charged back,
    handled), credited here and never recorded at the provider, once all its credits are back: nothing
    will ever record it there (decisions 173, 174). True when closed."""
    row, bought = uow.orphans.get(payment_id), uow.purchases.by_payment_id(payment_id)
    if row is None or bought is None or row["status"] not in lifecycle.REVIEW_REFUNDED \
            or row["resolution"] == "resubscribed" or uow.ledger.reversed_for(payment_id) < int(bought["credits"]):
        return False
    return uow.purchases.close(payment_id, row["resolution"] or row["status"], now)


def open_row(uow, now, *, payment_id: str, user_id: str | None, subscription_id: str | None,
             item_price_id: str | None, amount, currency_code: str | None, settled_at, status: str = "retrying",
             last_error: str | None = None) -> bool:
    """One row per payment id (a second opening is a no-op); True when it is new."""
    return uow.orphans.open({
        "payment_id": payment_id, "user_id": user_id, "subscription_id": subscription_id,
        "item_price_id": item_price_id, "amount": amount, "currency_code": currency_code, "status": status,
        "attempts": 0, "next_attempt_at": now if status == "retrying" else None, "last_error": last_error,
        "settled_at": settled_at or now, "created_at": now, "updated_at": now})


def hand_to_recovery(container, uow, *, payment_id: str, **facts) -> None:
    """A settled payment whose checkout is no longer owed goes to orphan recovery: a new row opens
    `retrying`; a row ended because the payment was recorded on that checkout (resolution `recorded`:
    decision 226, or recovery's own recording) goes back to `retrying`, or the payment would keep its
    credits with no subscription and no invoice, and no queue would hold it (decision 230). Any other row is
    left as it is."""
    now = container.clock.now()
    if open_row(uow, now, payment_id=payment_id, **facts):
        return
    row = uow.orphans.get(payment_id)
    if row["status"] == "recovered" and row["resolution"] == RECORDED:
        move(container, uow, payment_id, "retrying", resolution=None, resolved_by=None, attempts=0,
             next_attempt_at=now, last_error="its checkout was cancelled at the provider before it was activated")


def hold_frozen(uow, clock, *, payment_id: str, user_id: str, **facts) -> None:
    """A settled payment for a frozen account: neither credited nor activated; one chat alert."""
    open_row(uow, clock.now(), payment_id=payment_id, user_id=user_id, status="needs_review", last_error=FROZEN,
             **facts)
    alert_frozen(uow, clock, payment_id, user_id)


def hold_unattributed(uow, clock, *, payment_id: str, user_id: str | None, reason: str, **facts) -> None:
    """A settled payment that names none of our subscriptions or invoices (a charge made at the
    orchestrator's console, or by another integration on the account): nothing to credit or activate,
    and nothing for the poller to retry for ever; one chat alert."""
    open_row(uow, clock.now(), payment_id=payment_id, user_id=user_id, status="needs_review", last_error=reason,
             **facts)
    alerts.raise_alert(uow, clock, f"Payment {payment_id} names none of our subscriptions - manual review required",
                       f"unattributed-payment:{payment_id}", payment_id=payment_id, user_id=user_id, reason=reason)


def hold_mismatch(uow, clock, *, payment_id: str, user_id: str, reason: str, **facts) -> bool:
    """A captured payment that does not match its order (a partial settle, another amount or currency):
    neither credited nor activated nor reported to the provider; one chat alert. True when new."""
    new = open_row(uow, clock.now(), payment_id=payment_id, user_id=user_id, status="needs_review",
                   last_error=reason, **facts)
    alerts.raise_alert(uow, clock, f"Payment {payment_id} of user {user_id} does not match its order ({reason}) - "
                                   "held for manual review, nothing credited", f"payment-mismatch:{payment_id}",
                       payment_id=payment_id, user_id=user_id, reason=reason)
    return new


def captured_in_full(container, uow, payment_id: str, user_id: str, to: str = "recovered") -> None:
    """A payment held for review as captured in part, captured in full since (Primer: a capture that was not
    final, then the rest), now matches its order (decision 226). Recorded in this transaction (`to`
    recovered: resolution `recorded`), or, when recording hands it to orphan recovery as any payment of a
    checkout no longer owed (a cancelled checkout, a same-plan duplicate, a chargeback), sent back to
    recovery (`to` retrying); a frozen customer's stays with a person, for that reason. One chat alert
    when it leaves a person's queue."""
    if to == "needs_review":
        move(container, uow, payment_id, to, last_error=FROZEN)
        return
    values = ({"resolution": RECORDED, "resolved_by": "system", "next_attempt_at": None} if to == "recovered"
              else {"attempts": 0, "next_attempt_at": container.clock.now()})
    what = "recorded and credited" if to == "recovered" else "handed to orphan recovery"
    if move(container, uow, payment_id, to, **values):
        alerts.raise_alert(uow, container.clock, f"Payment {payment_id} of user {user_id}, held for review as "
                                                 f"captured in part, is now captured in full: {what}, nothing "
                                                 "left to review", f"payment-captured-in-full:{payment_id}",
                           payment_id=payment_id, user_id=user_id)


def alert_frozen(uow, clock, payment_id: str, user_id: str) -> None:
    alerts.raise_alert(uow, clock, f"Payment {payment_id} settled for frozen user {user_id} - manual review required "
                                   "(refund it, or unfreeze and retry)", f"frozen-payment:{payment_id}",
                       payment_id=payment_id, user_id=user_id)
