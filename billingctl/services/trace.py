"""`billingctl trace USER|PAYMENT|SUBSCRIPTION|INVOICE` (issue 38 item 12): one chronological timeline of
one customer across the three sets of books: ours (inbox events, purchases, ledger, review and dunning
rows, disputes, the audit log), the provider's (subscriptions, invoices) and the orchestrator's (payments,
refunds). Every place where the books disagree is flagged with the reconcile check that names it. It is
the first command of the "I paid and have no credits" runbook; `--json` for scripts."""

from __future__ import annotations

from datetime import datetime

from billingctl.domain import errors as e
from billingctl.domain.clock import parse_time
from billingctl.domain.plans import require_id
from billingctl.domain.refunds import apart_at_both_consoles, credits_to_reverse
from billingctl.services.payments import CAPTURED_STATUSES

OURS, PROVIDER, ORCHESTRATOR = "ours", "provider", "orchestrator"


def trace(container, any_id: str) -> dict:
    require_id(any_id, "id")
    user_id = _owner(container, any_id)
    with container.uow() as uow:
        books = uow.books.trace(user_id)
    lines: list[dict] = []
    flags: list[dict] = []

    def line(at, source: str, what: str, flag: str | None = None, **ids) -> None:
        ids = {k: v for k, v in ids.items() if v}
        lines.append({"at": parse_time(at) if not isinstance(at, datetime) else at, "source": source,
                      "what": what, "ids": " ".join(f"{k}={v}" for k, v in ids.items()), "flag": flag})
        if flag:
            flags.append({"check": flag, **ids, "detail": what})

    _ours(books, line)
    reversed_ = _reversed(books)
    payments = _orchestrator(container, user_id, books, reversed_, line)
    _provider(container, user_id, books, payments, reversed_, line)
    if books["user"]:
        credits, ledger = books["user"][0]["credits"], sum(r["amount"] for r in books["ledger"])
        if credits != ledger:
            line(books["user"][0]["created_at"], OURS, f"credits {credits} beside a ledger sum of {ledger}",
                 "credits_differ_from_ledger", user=user_id)
    lines.sort(key=lambda r: (r["at"] is None, r["at"] or datetime.min))
    return {"user_id": user_id, "asked": any_id, "timeline": lines, "disagreements": flags,
            "agree": not flags, "not_shown": books["not_shown"]}


def _owner(container, any_id: str) -> str:
    with container.uow() as uow:
        owner = uow.books.owner_of(any_id)
    if owner:
        return owner
    for read in (lambda: container.orchestrator.get_payment(any_id).user_id,
                 lambda: container.provider.get_subscription(any_id).customer_id,
                 lambda: container.provider.get_invoice(any_id).customer_id):
        try:
            owner = read()
        except e.NotFound:
            continue
        if owner:
            return owner
    raise e.NotFound(f"{any_id} is no user, payment, subscription or invoice any of the books know")


def _ours(books: dict, line) -> None:
    for r in books["inbox"]:
        line(r["received_at"], OURS, f"{r['source']} event {r['event_type']} received, {r['status']}",
             inbox=r["id"])
    for r in books["purchases"]:
        line(r["created_at"], OURS, f"purchase recorded via {r['recorded_via']}: {r['credits']} credits",
             payment=r["transaction_id"], subscription=r["subscription_id"], invoice=r["invoice_id"])
        if r["provider_recorded_at"]:
            excess = int(r["returned_excess"] or 0)  # its invoice was paid in part elsewhere (decision 180)
            rest = f" for the rest of it, {int(r['amount'] or 0) - excess}; {excess} refunded as an excess" \
                if excess else ""
            line(r["provider_recorded_at"], OURS, f"payment recorded on the provider's invoice{rest}",
                 payment=r["transaction_id"], invoice=r["invoice_id"])
        if r["closed_at"]:
            line(r["closed_at"], OURS, f"purchase closed ({r['closed_reason']})", payment=r["transaction_id"])
    for r in books["ledger"]:
        line(r["created_at"], OURS, f"ledger {r['reason']} {r['amount']:+}", payment=r["payment_id"])
    for r in books["reviews"]:
        line(r["created_at"], OURS, "held for review", payment=r["payment_id"])
        line(r["updated_at"], OURS, f"review row {r['status']}"
             + (f" ({r['resolution']})" if r.get("resolution") else ""), payment=r["payment_id"])
    for r in books["dunning"]:
        line(r["created_at"], OURS, f"renewal attempt {r['attempt_no']}: {r['status']}"
             + (f" ({r['decline_code']})" if r["decline_code"] else ""), invoice=r["invoice_id"],
             payment=r["payment_id"])
    for r in books["disputes"]:
        line(r["created_at"], OURS, " ".join(filter(None, ("dispute", r["kind"], "opened"))), payment=r["payment_id"],
             dispute=r["dispute_id"])
        if r["updated_at"] != r["created_at"]:
            line(r["updated_at"], OURS, f"dispute now {r['status']} ({r['state']})", payment=r["payment_id"],
                 dispute=r["dispute_id"])
    for r in books["audit"]:
        line(r["created_at"], OURS, f"operator {r['actor']}: {r['action']}"
             + (f" ({r['reason']})" if r["reason"] else ""), target=r["target"])


def _reversed(books: dict) -> dict[str, int]:
    """Credits taken back of each payment (refunds, lost disputes)."""
    reversed_: dict[str, int] = {}
    for r in books["ledger"]:
        if r["reason"] != "payment" and r["payment_id"]:
            reversed_[r["payment_id"]] = reversed_.get(r["payment_id"], 0) - r["amount"]
    return reversed_


def _orchestrator(container, user_id: str, books: dict, reversed_: dict[str, int], line) -> dict:
    """The customer's payments at the orchestrator (each captured one read for its refunds), flagged where
    ours do not follow."""
    recorded = {r["transaction_id"]: r for r in books["purchases"]}
    reviewed = {r["payment_id"] for r in books["reviews"]}
    payments = {}
    for summary in container.orchestrator.list_payments(status=None, customer_id=user_id):
        payment = container.orchestrator.get_payment(summary.id) if summary.status in CAPTURED_STATUSES else summary
        payments[payment.id] = payment
        flag = None
        if payment.status in CAPTURED_STATUSES and payment.id not in recorded and payment.id not in reviewed:
            flag = "payment_unrecorded"
        line(payment.date, ORCHESTRATOR, f"payment {payment.status} {payment.charged} {payment.currency_code}",
             flag, payment=payment.id, order=payment.order_id)
        bought = recorded.get(payment.id)
        if payment.refunded:
            expected = credits_to_reverse(bought["credits"], payment.charged, bought["returned_excess"],
                                          payment.refunded) if bought else 0
            short = bought is not None and reversed_.get(payment.id, 0) < expected
            line(payment.date, ORCHESTRATOR, f"refunded {payment.refunded} of {payment.charged}",
                 "refund_not_reversed" if short else None, payment=payment.id)
        if payment.refund_pending:  # asked for, not yet settled or refused by the processor (decision 174)
            line(payment.date, ORCHESTRATOR, f"refund of {payment.refund_pending} pending at the processor",
                 payment=payment.id)
        if payment.refunds_failed:
            line(payment.date, ORCHESTRATOR, f"{payment.refunds_failed} refund(s) refused by the processor",
                 payment=payment.id)
    return payments


def _provider(container, user_id: str, books: dict, payments: dict, reversed_: dict[str, int], line) -> None:
    local = {s["id"]: s for s in books["subscriptions"]}
    standing = {r["invoice_id"] for r in books["purchases"] if r["invoice_id"] and not r["closed_at"]}
    for remote in container.provider.list_subscriptions(customer_id=user_id):
        ours = local.get(remote.id)
        differs = ours is not None and ours["status"] != remote.status
        line(remote.created_at, PROVIDER, f"subscription {remote.item_price_id} created", subscription=remote.id)
        line(remote.updated_at, PROVIDER, f"subscription now {remote.status}"
             + (f" (ours says {ours['status']})" if differs else ""),
             "subscription_differs" if differs else None, subscription=remote.id)
        for invoice in container.provider.list_invoices(subscription_id=remote.id):
            flag = None
            if invoice.status == "paid" and (invoice.total or 0) > 0 and invoice.id not in standing:
                flag = "invoice_credits_not_one_term"
            elif invoice.status != "paid" and invoice.id in standing:
                flag = "purchase_on_unpaid_invoice"
            line(invoice.updated_at or invoice.date, PROVIDER, f"invoice {invoice.status}, {invoice.total} "
                 f"{invoice.currency_code}", flag, invoice=invoice.id, subscription=remote.id)
            _provider_refunds(invoice, books, payments, reversed_, line, subscription=remote.id)


def _provider_refunds(invoice, books: dict, payments: dict, reversed_: dict[str, int], line, **ids) -> None:
    """The refunds the provider records on an invoice (the workflow's mirror of the orchestrator's, or one
    finance recorded: decision 212), flagged when it holds more given back than the orchestrator and the
    share of credits of the invoice's one purchase is not taken back, or, that done, when the orchestrator
    gave some back and the two totals differ (decision 218, as reconcile names it)."""
    notes = [n for n in invoice.issued_credit_notes if n.cn_status == "refunded"]
    on_it = [r for r in books["purchases"] if r["invoice_id"] == invoice.id]
    for number, note in enumerate(notes, 1):
        flag = None
        if number == len(notes) and len(on_it) == 1:
            bought, given = on_it[0], sum(int(n.cn_total or 0) for n in notes)
            payment = payments.get(bought["transaction_id"])
            at_orchestrator = payment.refunded if payment is not None else 0
            expected = credits_to_reverse(bought["credits"], bought["amount"], bought["returned_excess"],
                                          max(given, at_orchestrator))
            if given > at_orchestrator and reversed_.get(bought["transaction_id"], 0) < expected:
                flag = "refund_not_reversed"
            elif apart_at_both_consoles(at_orchestrator, given):  # the totals apart (decision 218)
                flag = "refunded_at_both_consoles"
        line(note.cn_date, PROVIDER, f"refund of {note.cn_total} {invoice.currency_code} recorded (credit note "
             f"{note.cn_id})", flag, invoice=invoice.id, **ids)
