"""Reconcile: check the invariants the service promises and list every violation.

1. every SETTLED orchestrator payment is recorded exactly once, or is an orphan owned by recovery or
   by a person;
2. every credit-ledger entry matches a purchase (payment) or a refund of one, never more reversed
   than credited;
3. users.credits equals the user's ledger sum;
4. every active local subscription matches the provider."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select

from billingctl.adapters.db.tables import credit_ledger, orphan_recovery, purchase, subscription, users
from billingctl.services.orphans import OWNED as OWNED_BY_RECOVERY
from billingctl.services.payments import parse_time

TOO_RECENT = timedelta(seconds=15)


def reconcile(container, since=None, progress=None) -> dict:
    now = container.clock.now()
    violations: list[dict] = []
    with container.uow() as uow:
        purchases = {r.transaction_id: r for r in uow.execute(select(purchase))}
        orphans = dict(uow.execute(select(orphan_recovery.c.payment_id, orphan_recovery.c.status)).all())
        ledger = uow.execute(select(credit_ledger)).mappings().all()
        balances = dict(uow.execute(select(users.c.id, users.c.credits)).all())
        sums = dict(uow.execute(select(credit_ledger.c.user_id, func.sum(credit_ledger.c.amount))
                                .group_by(credit_ledger.c.user_id)).all())
        active = {r.id: r for r in uow.execute(select(subscription).where(subscription.c.status == "active"))}

    checked_payments = 0
    for payment in container.orchestrator.list_payments("SETTLED", from_date=since):
        checked_payments += 1
        if progress:
            progress(1)
        settled = parse_time(payment.get("date"))
        if settled is not None and now - settled < TOO_RECENT:
            continue
        pid = payment["id"]
        if pid not in purchases and orphans.get(pid) not in OWNED_BY_RECOVERY:
            violations.append({"check": "payment_unrecorded", "payment_id": pid,
                               "detail": "settled at the orchestrator, no purchase and no orphan record"})
        if pid in purchases and orphans.get(pid) == "duplicate_refunded":
            violations.append({"check": "payment_recorded_and_refunded", "payment_id": pid,
                               "detail": "recorded although recovery refunded it as a duplicate"})

    reversed_by_payment: dict[str, int] = {}
    for entry in ledger:
        pid = entry["payment_id"]
        if entry["reason"] == "payment":
            bought = purchases.get(pid)
            if bought is None or bought.user_id != entry["user_id"] or bought.credits != entry["amount"]:
                violations.append({"check": "ledger_without_purchase", "ledger_id": entry["id"], "payment_id": pid,
                                   "detail": "a credit that matches no purchase"})
        elif entry["reason"] == "refund":
            if pid not in purchases:
                violations.append({"check": "refund_without_purchase", "ledger_id": entry["id"], "payment_id": pid,
                                   "detail": "a reversal that matches no purchase"})
            reversed_by_payment[pid] = reversed_by_payment.get(pid, 0) - entry["amount"]
        else:
            violations.append({"check": "ledger_unknown_reason", "ledger_id": entry["id"], "detail": entry["reason"]})
    for pid, total in reversed_by_payment.items():
        if pid in purchases and total > purchases[pid].credits:
            violations.append({"check": "refund_exceeds_credit", "payment_id": pid,
                               "detail": f"{total} reversed of {purchases[pid].credits}"})

    for user_id, balance in balances.items():
        expected = int(sums.get(user_id) or 0)
        if int(balance) != expected:
            violations.append({"check": "credits_differ_from_ledger", "user_id": user_id,
                               "detail": f"users.credits={balance}, ledger sum={expected}"})

    seen = set()
    for row in container.provider.list_subscriptions():
        remote = row["subscription"]
        seen.add(remote["id"])
        if progress:
            progress(1)
        local = active.get(remote["id"])
        if local is not None and remote["status"] != "active":
            violations.append({"check": "subscription_differs", "subscription_id": remote["id"],
                               "detail": f"local active, provider {remote['status']}"})
    for sub_id in active:
        if sub_id not in seen:
            violations.append({"check": "subscription_missing_at_provider", "subscription_id": sub_id,
                               "detail": "active locally, unknown to the provider"})

    container.metrics.reconcile_violations.set(len(violations))
    return {"checked": {"payments": checked_payments, "ledger_entries": len(ledger), "users": len(balances),
                        "active_subscriptions": len(active)},
            "violations": violations, "ok": not violations}
