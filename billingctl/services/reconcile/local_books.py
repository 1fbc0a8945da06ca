"""Reconcile's checks of our own books: the SQL checks of `adapters.db.books` and the quota."""

from __future__ import annotations

from datetime import timedelta
from itertools import groupby

from billingctl.adapters.db.books import Limits
from billingctl.domain.quota import CUSTOMER, LONGEST, Attempt, starts_over_limit
from billingctl.services.fraud_quota import FULL
from billingctl.services.reconcile.rules import GRACE, REFUND_PENDING_MAX


def limits(settings) -> Limits:
    return Limits(grace=GRACE, in_flight=timedelta(hours=settings.renewal_in_flight_max_hours),
                  authorized=timedelta(minutes=settings.renewal_authorized_max_minutes))


def check_local(container, now, found, since=None) -> dict:
    closed = []  # the orchestrator is read outside the transaction
    with container.uow() as uow:
        uow.books.without_jit()
        if container.settings.is_production:  # outside production the quota is not enforced
            _check_quota(uow, now, found.add)
        for check, violation, at in uow.books.violations(now, limits(container.settings), since):
            if check == "closed_purchase_not_reversed":
                closed.append((violation, at))
            else:
                found.add(check, violation, at=at)
        checked = {"ledger_entries": uow.books.count_ledger(since), "users": uow.books.count_users(),
                   "active_subscriptions": len(uow.subscriptions.ids_in(("active",)))}
    for violation, at in closed:
        if not _refund_on_its_way(container, now, violation["payment_id"]):
            found.add("closed_purchase_not_reversed", violation, at=at)
    return checked


def _refund_on_its_way(container, now, payment_id: str) -> bool:
    """A closed purchase keeps its credits until its refund settles (they follow the money, decision 174):
    while the processor has not decided a refund of all of it, asked for less than REFUND_PENDING_MAX ago,
    the credits are on their way back, not kept (decision 233). A refused refund, or one pending longer,
    and the purchase is named."""
    payment = container.orchestrator.get_payment(payment_id)
    asked = payment.refund_pending_since
    return asked is not None and payment.refunding_in_full and now - asked <= REFUND_PENDING_MAX


def _check_quota(uow, now, add) -> None:
    """Spec section 3's quota: no attempt started (a checkout, a renewal charge) while a window was full,
    over the starts of the longest window (the attempts of two, so each start sees all before it)."""
    for user_id, rows in groupby(uow.books.attempts_since(now - 2 * LONGEST), key=lambda row: row.user_id):
        attempts = [Attempt(row.created_at, (row.metadata or {}).get("initiator") or CUSTOMER,
                            "payment_id" not in (row.metadata or {}))
                    for row in rows if (row.metadata or {}).get("merchant_context") == FULL]
        for attempt, window in starts_over_limit(attempts):
            if attempt.at > now - LONGEST:
                add(f"quota_over_limit:{window.window}", {
                    "user_id": user_id, "detail": f"a {attempt.initiator}-initiated attempt started with "
                    f"{window.used} attempts in the {window.window} window (limit {window.limit})"})
