"""Reconcile: the invariant checker. Every check of our own books is one SQL query (flat memory at
millions of ledger rows: only violations are held, at most LIMIT per check); the orchestrator's and
the provider's lists are streamed page by page.

From our books:
- every credit-ledger entry matches a purchase (payment) or a refund of one, never more reversed than
  credited; users.credits equals the user's ledger sum;
- no invoice paid by two purchases (two settled charges for one subscription period);
- every purchase recorded on the provider's invoice within an hour (unless orphan recovery owns it);
- no subscription paid but still waiting for activation after an hour;
- no credits applied to an account after its freeze;
- no NSFW authorization-quota window over its limit.
From the orchestrator's and the provider's books:
- every SETTLED payment is recorded exactly once, or owned by orphan recovery or a person;
- no two settled payments for one order (one checkout, one renewal invoice);
- a refund at the orchestrator is reversed in the ledger (payments settled in the last REFUND_WINDOW);
- one orchestrator payment is on at most one provider invoice, and every purchase we marked as recorded
  is on one (the provider's payment transactions of the last REFUND_WINDOW, or since the given time);
- every active local subscription is active at the provider."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, or_, select

from billingctl.adapters.db.tables import (
    credit_ledger,
    fraud_event,
    orphan_recovery,
    purchase,
    subscription,
    users,
)
from billingctl.domain.batch import BatchResult
from billingctl.domain.clock import parse_time
from billingctl.domain.quota import WINDOWS
from billingctl.services.orphans import OWNED as OWNED_BY_RECOVERY

TOO_RECENT = timedelta(seconds=15)
GRACE = timedelta(hours=1)  # follow-up work (provider record, activation) the jobs finish well within
REFUND_WINDOW = timedelta(days=35)
LIMIT = 100  # violations listed per check (all are counted)


def _local_checks(uow, now, enforced: bool = True) -> list[tuple[str, object, callable]]:
    """(check name, query, row -> violation) for every check of our own books."""
    payments = select(credit_ledger.c.id, credit_ledger.c.payment_id, credit_ledger.c.user_id, credit_ledger.c.amount
                      ).outerjoin(purchase, purchase.c.transaction_id == credit_ledger.c.payment_id)
    reversed_ = (select(credit_ledger.c.payment_id, (-func.sum(credit_ledger.c.amount)).label("reversed"))
                 .where(credit_ledger.c.reason == "refund").group_by(credit_ledger.c.payment_id).subquery())
    sums = (select(credit_ledger.c.user_id, func.sum(credit_ledger.c.amount).label("total"))
            .group_by(credit_ledger.c.user_id).subquery())
    handed_to_recovery = select(orphan_recovery.c.payment_id)
    attempts = []
    for name, length, limit in (WINDOWS if enforced else ()):  # outside production the quota is not enforced
        attempts.append((f"quota_over_limit:{name}", select(fraud_event.c.user_id, func.count().label("n"))
                         .where(fraud_event.c.event_type == "authorization_attempt",
                                fraud_event.c.created_at > now - length)
                         .group_by(fraud_event.c.user_id).having(func.count() > limit),
                         lambda r, name=name, limit=limit: {"user_id": r.user_id,
                                                            "detail": f"{r.n} attempts in the {name} window "
                                                                      f"(limit {limit})"}))
    return [
        ("ledger_without_purchase",
         payments.where(credit_ledger.c.reason == "payment", or_(
             purchase.c.id.is_(None), purchase.c.user_id != credit_ledger.c.user_id,
             purchase.c.credits != credit_ledger.c.amount)),
         lambda r: {"ledger_id": r.id, "payment_id": r.payment_id, "detail": "a credit that matches no purchase"}),
        ("refund_without_purchase", payments.where(credit_ledger.c.reason == "refund", purchase.c.id.is_(None)),
         lambda r: {"ledger_id": r.id, "payment_id": r.payment_id, "detail": "a reversal that matches no purchase"}),
        ("ledger_unknown_reason", select(credit_ledger.c.id, credit_ledger.c.reason).where(
            credit_ledger.c.reason.not_in(("payment", "refund"))),
         lambda r: {"ledger_id": r.id, "detail": r.reason}),
        ("refund_exceeds_credit", select(purchase.c.transaction_id, purchase.c.credits, reversed_.c.reversed)
         .join(reversed_, reversed_.c.payment_id == purchase.c.transaction_id)
         .where(reversed_.c.reversed > purchase.c.credits),
         lambda r: {"payment_id": r.transaction_id, "detail": f"{r.reversed} reversed of {r.credits}"}),
        ("credits_differ_from_ledger", select(users.c.id, users.c.credits, func.coalesce(sums.c.total, 0).label("t"))
         .outerjoin(sums, sums.c.user_id == users.c.id).where(users.c.credits != func.coalesce(sums.c.total, 0)),
         lambda r: {"user_id": r.id, "detail": f"users.credits={r.credits}, ledger sum={r.t}"}),
        ("invoice_paid_twice", select(purchase.c.invoice_id, func.count().label("n"))
         .where(purchase.c.invoice_id.is_not(None)).group_by(purchase.c.invoice_id).having(func.count() > 1),
         lambda r: {"invoice_id": r.invoice_id, "detail": f"{r.n} settled charges for one subscription period"}),
        ("recorded_not_on_provider_invoice", select(purchase.c.transaction_id, purchase.c.invoice_id).where(
            purchase.c.provider_recorded_at.is_(None), purchase.c.created_at < now - GRACE,
            purchase.c.transaction_id.not_in(handed_to_recovery)),
         lambda r: {"payment_id": r.transaction_id, "invoice_id": r.invoice_id,
                    "detail": "recorded by us, not on the provider's invoice"}),
        ("paid_not_active", select(subscription.c.id, subscription.c.activation_error).where(
            subscription.c.activation_pending_since < now - GRACE,
            subscription.c.id.in_(select(purchase.c.subscription_id))),
         lambda r: {"subscription_id": r.id, "detail": f"paid, not active: {r.activation_error or 'pending'}"}),
        ("credits_after_freeze", select(credit_ledger.c.id, credit_ledger.c.user_id, credit_ledger.c.payment_id)
         .join(users, users.c.id == credit_ledger.c.user_id)
         .where(users.c.frozen_at.is_not(None), credit_ledger.c.amount > 0,
                credit_ledger.c.created_at > users.c.frozen_at),
         lambda r: {"ledger_id": r.id, "user_id": r.user_id, "payment_id": r.payment_id,
                    "detail": "credits applied after the account was frozen"}),
        *attempts,
    ]


def reconcile(container, since=None, progress=None) -> dict:
    now = container.clock.now()
    violations: list[dict] = []
    counts: dict[str, int] = {}

    def add(check: str, violation: dict) -> None:
        counts[check] = counts.get(check, 0) + 1
        if counts[check] <= LIMIT:
            violations.append({"check": check.split(":")[0], **violation})

    with container.uow() as uow:
        for check, query, describe in _local_checks(uow, now, container.settings.is_production):
            for row in uow.execute(query.limit(LIMIT)):
                add(check, describe(row))
        ledger_entries = uow.execute(select(func.count()).select_from(credit_ledger)).scalar_one()
        user_count = uow.execute(select(func.count()).select_from(users)).scalar_one()

    checked_payments = 0
    orders: dict[str, str] = {}  # order id -> first payment id (as many as payments listed, not ledger rows)
    for payment in container.orchestrator.list_payments("SETTLED", from_date=since):
        checked_payments += 1
        if progress:
            progress(1)
        settled = parse_time(payment.get("date"))
        if settled is not None and now - settled < TOO_RECENT:
            continue
        pid = payment["id"]
        with container.uow() as uow:
            recorded = uow.execute(select(purchase.c.credits).where(purchase.c.transaction_id == pid)).first()
            owner = uow.execute(select(orphan_recovery.c.status).where(orphan_recovery.c.payment_id == pid)).scalar()
        if recorded is None and owner not in OWNED_BY_RECOVERY:
            add("payment_unrecorded", {"payment_id": pid,
                                       "detail": "settled at the orchestrator, no purchase and no orphan record"})
        if recorded is not None and owner == "duplicate_refunded":
            add("payment_recorded_and_refunded", {"payment_id": pid,
                                                  "detail": "recorded although recovery refunded it as a duplicate"})
        order = payment.get("orderId")
        if order and order in orders:
            if not (_fully_refunded(container, pid) or _fully_refunded(container, orders[order])):
                add("order_charged_twice", {"payment_id": pid, "order_id": order, "first_payment_id": orders[order],
                                            "detail": "a second settled payment for one order"})
        elif order:
            orders[order] = pid
        if recorded is not None and settled is not None and now - settled < REFUND_WINDOW:
            _check_refund(container, pid, recorded.credits, add)

    active = 0
    with container.uow() as uow:
        active_ids = select(subscription.c.id).where(subscription.c.status == "active")
        active = uow.execute(select(func.count()).select_from(active_ids.subquery())).scalar_one()
    # The provider's books cost budget per page: without a given time, the last REFUND_WINDOW is read.
    _check_provider_transactions(container, since or now - REFUND_WINDOW, add)

    seen: set[str] = set()  # provider ids (as many as subscriptions, not ledger rows)
    for row in container.provider.list_subscriptions():
        remote = row["subscription"]
        seen.add(remote["id"])
        if progress:
            progress(1)
        with container.uow() as uow:
            local = uow.execute(select(subscription.c.status).where(subscription.c.id == remote["id"])).scalar()
        if local == "active" and remote["status"] != "active":
            add("subscription_differs", {"subscription_id": remote["id"],
                                         "detail": f"local active, provider {remote['status']}"})
    with container.uow() as uow:
        for sub_id in uow.execute(select(subscription.c.id).where(subscription.c.status == "active")).scalars():
            if sub_id not in seen:
                add("subscription_missing_at_provider", {"subscription_id": sub_id,
                                                         "detail": "active locally, unknown to the provider"})

    container.metrics.reconcile_violations.set(sum(counts.values()))
    _store_violations(container, sum(counts.values()))
    # Each violation is a failed item: the reconcile job exits 5 while any stands.
    return BatchResult({"checked": {"payments": checked_payments, "ledger_entries": ledger_entries,
                                    "users": user_count, "active_subscriptions": active},
                        "violations": violations, "counts": counts, "ok": not counts},
                       done=checked_payments, failed=len(violations), errors=violations)


def _check_provider_transactions(container, since, add) -> None:
    """From the provider's books: one orchestrator payment (a transaction's reference number) applied to
    two invoices, and a purchase we marked as recorded that no provider transaction carries."""
    invoice_of: dict[str, str] = {}  # reference -> the first invoice it paid (payments in the window)
    for txn in container.provider.list_transactions("payment", since):
        reference = txn.get("reference_number") or txn.get("id_at_gateway")
        if not reference:
            continue
        for link in txn.get("linked_invoices") or []:
            first = invoice_of.setdefault(reference, link.get("invoice_id"))
            if link.get("invoice_id") != first:
                add("payment_on_two_invoices", {"payment_id": reference, "invoice_ids": [first, link.get("invoice_id")],
                                                "detail": "one orchestrator payment applied to two provider invoices"})
    # Recorded comfortably inside the window, so its transaction is in the list (dated when recorded).
    query = select(purchase.c.transaction_id, purchase.c.invoice_id).where(
        purchase.c.provider_recorded_at.is_not(None), purchase.c.invoice_id.is_not(None),
        purchase.c.provider_recorded_at >= since + timedelta(minutes=5))
    with container.uow() as uow:
        for row in uow.execute(query.execution_options(yield_per=1000)):
            if row.transaction_id not in invoice_of:
                add("recorded_not_on_provider_invoice", {
                    "payment_id": row.transaction_id, "invoice_id": row.invoice_id,
                    "detail": "marked recorded, but no provider transaction carries it"})


def _fully_refunded(container, payment_id: str) -> bool:
    """A second charge already refunded in full is resolved: the check clears once the refund is done."""
    payment = container.orchestrator.get_payment(payment_id)
    return int((payment.get("processor") or {}).get("amountRefunded") or 0) >= int(payment.get("amount") or 0) > 0


def _check_refund(container, payment_id: str, credits: int, add) -> None:
    """Refunded at the orchestrator (the list holds no refunded amount: the payment is read) but not
    reversed in the ledger."""
    payment = container.orchestrator.get_payment(payment_id)
    refunded, amount = int((payment.get("processor") or {}).get("amountRefunded") or 0), int(payment.get("amount") or 0)
    if not refunded or not amount:
        return
    expected = (int(credits) * min(refunded, amount)) // amount
    with container.uow() as uow:
        done = -int(uow.execute(select(func.coalesce(func.sum(credit_ledger.c.amount), 0)).where(
            credit_ledger.c.payment_id == payment_id, credit_ledger.c.reason == "refund")).scalar_one())
    if done < expected:
        add("refund_not_reversed", {"payment_id": payment_id, "detail": f"refunded {refunded} of {amount}: "
                                                                        f"{done} of {expected} credits reversed"})


STATE_KEY = "reconcile_violations"


def _store_violations(container, count: int) -> None:
    """The last run's count, for the scrape (billing_reconcile_violations is live state, not a max over
    the processes that ever ran reconcile)."""
    from billingctl.adapters.db.named_values import write_value

    write_value(container, STATE_KEY, str(count))


def last_violations(container) -> int | None:
    from billingctl.adapters.db.named_values import read_value

    value = read_value(container, STATE_KEY)
    return int(value) if value is not None else None
