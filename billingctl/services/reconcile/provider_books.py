"""Reconcile's checks from the provider's books. Every list is read from the run's window (updated or dated
since it; a full pass: the refund window for invoices and transactions, every subscription), a page of
100 per call of the shared budget, and each page is judged against our books in one statement."""

from __future__ import annotations

from datetime import timedelta

from billingctl.adapters.db.books import BILLED
from billingctl.domain import errors as e
from billingctl.domain.clock import parse_time
from billingctl.domain.lifecycle import REVIEW_HUMAN, REVIEW_OPEN, REVIEW_REFUNDED
from billingctl.domain.refunds import apart_at_both_consoles, credits_to_reverse
from billingctl.services.reconcile.orchestrator_books import _pages
from billingctl.services.reconcile.rules import GRACE, REFUND_WINDOW

UNPAID = ("pending", "posted", "payment_due", "not_paid", "voided")


def check(container, now, span, add, progress=None) -> int:
    since = span.since or now - REFUND_WINDOW
    _check_transactions(container, since, add)
    _check_refunds(container, now, since, add)
    _check_invoices(container, now, since, add)
    return _check_subscriptions(container, span, add, progress)


def _check_transactions(container, since, add) -> None:
    """One orchestrator payment (a transaction's reference number) applied to two invoices, and a purchase
    we marked as recorded that no provider transaction carries."""
    invoice_of: dict[str, str] = {}  # payment id -> the first invoice it paid (payments in the window)
    for txn in container.provider.list_transactions("payment", since):
        # The payment id recording gave it: a reference typed as free text (a cheque number with spaces)
        # is the provider's own transaction id, as the event poller records it.
        reference = txn.payment_reference()
        if not reference:
            continue
        for link in txn.linked_invoices:
            first = invoice_of.setdefault(reference, link.invoice_id)
            if link.invoice_id != first:
                add("payment_on_two_invoices", {"payment_id": reference, "invoice_ids": [first, link.invoice_id],
                                                "detail": "one orchestrator payment applied to two provider invoices"},
                    at=parse_time(txn.date))
    # Recorded comfortably inside the window, so its transaction is in the list (dated when recorded).
    with container.uow() as uow:
        for row in uow.books.recorded_on_provider_since(since + timedelta(minutes=5)):
            if row.transaction_id not in invoice_of:
                add("recorded_not_on_provider_invoice", {
                    "payment_id": row.transaction_id, "invoice_id": row.invoice_id,
                    "detail": "marked recorded, but no provider transaction carries it"}, at=row.provider_recorded_at)


def _check_refunds(container, now, since, add) -> None:
    """A refund the provider holds (the workflow's mirror of one at the orchestrator, or one finance recorded
    there, made outside the orchestrator: decision 212) whose share of its payment's credits is not taken
    back; and a payment refunded at both consoles (decision 218). The refunds in the window name their
    payments; each payment is read once for all its refunds."""
    named: dict[str, object] = {}
    for txn in container.provider.list_transactions("refund", since):
        at = parse_time(txn.date)
        if txn.status == "success" and txn.reference_transaction_id and at is not None and now - at > GRACE:
            named.setdefault(txn.reference_transaction_id, at)
    for txn_id, at in sorted(named.items()):
        paid = container.provider.get_transaction(txn_id)
        payment_id = paid.payment_reference()
        with container.uow() as uow:
            bought = uow.purchases.by_payment_id(payment_id) if payment_id else None
            done = uow.ledger.reversed_for(payment_id) if bought is not None else 0
        if bought is None:  # never recorded: the payment checks name it
            continue
        expected = credits_to_reverse(bought["credits"], bought["amount"], bought["returned_excess"], paid.refunded)
        if done < expected:
            add("refund_not_reversed", {
                "payment_id": payment_id, "user_id": bought["user_id"],
                "detail": f"refunded {paid.refunded} of {bought['amount']} at the provider: {done} of {expected} "
                          "credits reversed"}, at=at)
        _check_both_consoles(container, payment_id, bought["user_id"], paid.refunded, at, add)


def _check_both_consoles(container, payment_id: str, user_id: str, at_provider: int, at, add) -> None:
    """Both consoles hold refunds of an orchestrator payment and disagree on what was given back (decision
    218): the provider holds more (refunds finance recorded there besides the workflow's mirror), or less
    (a mirror that never landed, with refunds recorded there). Its books hold the mirror and the refunds
    recorded there alike, so a split made on purpose, a duplicate record and a customer paid back twice look
    the same: a person checks (and acknowledges it). Equal totals are the mirror alone. One orchestrator
    read per refunded payment; refunds are rare."""
    try:
        at_orchestrator = container.orchestrator.get_payment(payment_id).refunded
    except e.ExternalNotFound:  # entered at the provider (a cheque): its books alone
        return
    if apart_at_both_consoles(at_orchestrator, at_provider):
        add("refunded_at_both_consoles", {
            "payment_id": payment_id, "user_id": user_id,
            "detail": f"refunded {at_orchestrator} at the orchestrator and {at_provider} at the provider (the "
                      "workflow's mirror and refunds recorded there alike): check the customer was not paid back "
                      "twice"}, at=at)


def _check_invoices(container, now, since, add) -> None:
    """Each invoice the provider holds as paid carries exactly one term's credits (none: paid and nobody
    credited; two: a term credited twice), unless every purchase on it was refunded, it was written off
    with nothing paid, or a person answered for each of its payments; and no standing purchase sits on an
    invoice the provider does not hold as paid (voided, or its payment removed)."""
    for page in _pages(container.provider.list_invoices(updated_after=since)):
        with container.uow() as uow:
            standing = uow.books.grants_on([i.id for i in page])
        for invoice in page:
            grants, purchases = standing[invoice.id]["grants"], standing[invoice.id]["purchases"]
            changed, at = parse_time(invoice.paid_at or invoice.updated_at), parse_time(invoice.updated_at)
            settled_long_ago = changed is not None and now - changed > GRACE
            ids = {"invoice_id": invoice.id, "user_id": invoice.customer_id,
                   "subscription_id": invoice.subscription_id}
            # Written off (paid with nothing paid, decision 185): no term to credit; two would still be named.
            paid_in_money = invoice.amount_paid is None or invoice.amount_paid > 0
            if invoice.status == "paid" and settled_long_ago and (invoice.total or 0) > 0:
                uncredited = not grants and not purchases and paid_in_money
                answered, held = _reviews(container, invoice) if uncredited else (False, [])  # read only then
                if len(grants) > 1 or (uncredited and not answered):
                    add("invoice_credits_not_one_term", {
                        **ids, "payment_ids": grants or held,
                        "detail": f"paid at the provider, {len(grants)} terms of credits stand on it"
                                  + (f"; its payment {', '.join(held)} is held for review" if held else "")},
                        at=at)
            elif invoice.status in UNPAID and grants:
                old = [p.transaction_id for p in purchases if p.transaction_id in grants and now - p.created_at > GRACE]
                if old:
                    add("purchase_on_unpaid_invoice", {
                        **ids, "payment_ids": old,
                        "detail": f"credited by us, {invoice.status} at the provider"}, at=at)


def _reviews(container, invoice) -> tuple[bool, list[str]]:
    """Of a paid invoice nobody credited: whether a person answered for every one of its payments (each
    one's review ended by a person's resolve or a refund, decision 198), and those that wait in the review
    queue (a payment entered at the provider for a customer frozen meanwhile, its id the provider's
    transaction's), named with the violation so the person who holds them sees what it waits on (decision
    187)."""
    with container.uow() as uow:
        reviews = {p.txn_id: uow.orphans.status(p.txn_id) for p in invoice.linked_payments if p.txn_id}
    answered = bool(reviews) and all(status in REVIEW_REFUNDED for status in reviews.values())
    return answered, [txn for txn, status in reviews.items() if status in (*REVIEW_OPEN, *REVIEW_HUMAN)]


def _check_subscriptions(container, span, add, progress) -> int:
    """Every local active subscription active at the provider (and, in a full pass, known to it); at most
    one billed subscription per customer and plan (the window's copies, with our copies of the same
    customers' others)."""
    seen: set[str] = set()
    billed: dict[tuple[str, str], set[str]] = {}
    oldest: dict[tuple[str, str], object] = {}  # the oldest listed copy of each customer and plan
    for remote in container.provider.list_subscriptions(updated_after=span.since):
        seen.add(remote.id)
        if progress:
            progress(1)
        with container.uow() as uow:
            local = uow.subscriptions.status(remote.id)
        at = parse_time(remote.updated_at)
        if local == "active" and remote.status != "active":
            add("subscription_differs", {"subscription_id": remote.id, "user_id": remote.customer_id,
                                         "detail": f"local active, provider {remote.status}"}, at=at)
        if remote.status in BILLED and remote.customer_id and remote.item_price_id:
            key = (remote.customer_id, remote.item_price_id)
            billed.setdefault(key, set()).add(remote.id)
            oldest[key] = min(oldest.get(key) or at, at) if at else oldest.get(key)
    with container.uow() as uow:
        for row in uow.books.billed_of(sorted({customer for customer, _ in billed})):
            if row.id not in seen and row.item_price_id:
                billed.setdefault((row.customer_id, row.item_price_id), set()).add(row.id)
        # A full pass lists every subscription; an incremental one asks about each of ours it did not list
        # that is new since its window began (a copy of one the provider never had).
        active = uow.books.active_created_since(None if span.full else span.since)
    for (customer, plan), ids in sorted(billed.items()):
        if len(ids) > 1:
            add("two_live_subscriptions", {"user_id": customer, "item_price_id": plan,
                                           "subscription_ids": sorted(ids),
                                           "detail": f"{len(ids)} live subscriptions of {plan}, each billed"},
                at=oldest.get((customer, plan)))
    for sub_id, created in active:
        if sub_id not in seen and (span.full or _unknown_to_provider(container, sub_id, add)):
            add("subscription_missing_at_provider", {"subscription_id": sub_id,
                                                     "detail": "active locally, unknown to the provider"}, at=created)
    return len(seen)


def _unknown_to_provider(container, sub_id: str, add) -> bool:
    try:
        remote = container.provider.get_subscription(sub_id)
    except e.NotFound:
        return True
    if remote.status != "active":
        add("subscription_differs", {"subscription_id": sub_id, "user_id": remote.customer_id,
                                     "detail": f"local active, provider {remote.status}"})
    return False
