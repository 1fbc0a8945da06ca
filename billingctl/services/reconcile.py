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
from itertools import groupby

from billingctl.domain.batch import BatchResult
from billingctl.domain.quota import CUSTOMER, LONGEST, Attempt, starts_over_limit
from billingctl.services.fraud_quota import FULL

TOO_RECENT = timedelta(seconds=15)
GRACE = timedelta(hours=1)  # follow-up work (provider record, activation) the jobs finish well within
REFUND_WINDOW = timedelta(days=35)
LIMIT = 100  # violations listed per check (all are counted)


def reconcile(container, since=None, progress=None) -> dict:
    now = container.clock.now()
    violations: list[dict] = []
    counts: dict[str, int] = {}

    def add(check: str, violation: dict) -> None:
        counts[check] = counts.get(check, 0) + 1
        if counts[check] <= LIMIT:
            violations.append({"check": check.split(":")[0], **violation})

    with container.uow() as uow:
        for check, violation in uow.books.violations(now, GRACE, LIMIT):
            add(check, violation)
        if container.settings.is_production:  # outside production the quota is not enforced
            _check_quota(uow, now, add)
        ledger_entries = uow.ledger.count()
        user_count = uow.books.count_users()

    checked_payments = 0
    orders: dict[str, str] = {}  # order id -> first payment id (as many as payments listed, not ledger rows)
    for payment in container.orchestrator.list_payments("SETTLED", from_date=since):
        checked_payments += 1
        if progress:
            progress(1)
        settled = payment.settled_at
        if settled is not None and now - settled < TOO_RECENT:
            continue
        pid = payment.id
        with container.uow() as uow:
            recorded = uow.purchases.by_payment_id(pid)
            owner = uow.orphans.status(pid)
        if recorded is None and owner is None:  # any review row owns it (domain.lifecycle.ORPHAN)
            add("payment_unrecorded", {"payment_id": pid,
                                       "detail": "settled at the orchestrator, no purchase and no orphan record"})
        if recorded is not None and owner == "duplicate_refunded":
            add("payment_recorded_and_refunded", {"payment_id": pid,
                                                  "detail": "recorded although recovery refunded it as a duplicate"})
        order = payment.order_id
        if order and order in orders:
            if not (_fully_refunded(container, pid) or _fully_refunded(container, orders[order])):
                add("order_charged_twice", {"payment_id": pid, "order_id": order, "first_payment_id": orders[order],
                                            "detail": "a second settled payment for one order"})
        elif order:
            orders[order] = pid
        if recorded is not None and settled is not None and now - settled < REFUND_WINDOW:
            _check_refund(container, pid, recorded["credits"], add)

    with container.uow() as uow:
        active = len(uow.subscriptions.ids_in(("active",)))
    # The provider's books cost budget per page: without a given time, the last REFUND_WINDOW is read.
    _check_provider_transactions(container, since or now - REFUND_WINDOW, add)

    seen: set[str] = set()  # provider ids (as many as subscriptions, not ledger rows)
    for remote in container.provider.list_subscriptions():
        seen.add(remote.id)
        if progress:
            progress(1)
        with container.uow() as uow:
            local = uow.subscriptions.status(remote.id)
        if local == "active" and remote.status != "active":
            add("subscription_differs", {"subscription_id": remote.id,
                                         "detail": f"local active, provider {remote.status}"})
    with container.uow() as uow:
        for sub_id in uow.subscriptions.ids_in(("active",)):
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


def _check_provider_transactions(container, since, add) -> None:
    """From the provider's books: one orchestrator payment (a transaction's reference number) applied to
    two invoices, and a purchase we marked as recorded that no provider transaction carries."""
    invoice_of: dict[str, str] = {}  # reference -> the first invoice it paid (payments in the window)
    for txn in container.provider.list_transactions("payment", since):
        reference = txn.reference_number or txn.id_at_gateway
        if not reference:
            continue
        for link in txn.linked_invoices:
            first = invoice_of.setdefault(reference, link.invoice_id)
            if link.invoice_id != first:
                add("payment_on_two_invoices", {"payment_id": reference, "invoice_ids": [first, link.invoice_id],
                                                "detail": "one orchestrator payment applied to two provider invoices"})
    # Recorded comfortably inside the window, so its transaction is in the list (dated when recorded).
    with container.uow() as uow:
        for row in uow.books.recorded_on_provider_since(since + timedelta(minutes=5)):
            if row.transaction_id not in invoice_of:
                add("recorded_not_on_provider_invoice", {
                    "payment_id": row.transaction_id, "invoice_id": row.invoice_id,
                    "detail": "marked recorded, but no provider transaction carries it"})


def _fully_refunded(container, payment_id: str) -> bool:
    """A second charge already refunded in full is resolved: the check clears once the refund is done."""
    payment = container.orchestrator.get_payment(payment_id)
    return payment.refunded >= payment.charged > 0


def _check_refund(container, payment_id: str, credits: int, add) -> None:
    """Refunded at the orchestrator (the list holds no refunded amount: the payment is read) but not
    reversed in the ledger."""
    payment = container.orchestrator.get_payment(payment_id)
    refunded, amount = payment.refunded, payment.charged
    if not refunded or not amount:
        return
    expected = (int(credits) * min(refunded, amount)) // amount
    with container.uow() as uow:
        done = uow.ledger.reversed_for(payment_id)
    if done < expected:
        add("refund_not_reversed", {"payment_id": payment_id, "detail": f"refunded {refunded} of {amount}: "
                                                                        f"{done} of {expected} credits reversed"})


STATE_KEY = "reconcile_violations"


def _store_violations(container, count: int) -> None:
    """The last run's count, for the scrape (billing_reconcile_violations is live state, not a max over
    the processes that ever ran reconcile)."""
    from billingctl.services.cursors import write_value

    write_value(container, STATE_KEY, str(count))


def last_violations(container) -> int | None:
    from billingctl.services.cursors import read_value

    value = read_value(container, STATE_KEY)
    return int(value) if value is not None else None
