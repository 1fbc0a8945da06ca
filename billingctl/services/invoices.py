"""The local copy of the provider's invoices, one step of domain.lifecycle.INVOICE at a time (decision
117). Its status is only ever the provider's: a copy the provider sent (an event, the answer to a payment
recorded on the invoice, a read), applied in resource_version order; a payment we record names its invoice
(ids, amount) without inventing a status for it."""

from __future__ import annotations

import logging

from billingctl.adapters.payloads import Invoice
from billingctl.domain.clock import parse_time
from billingctl.domain.lifecycle import INVOICE, INVOICE_PAYABLE
from billingctl.services import alerts
from billingctl.services.lifecycles import provider_status, provider_step_written

log = logging.getLogger("billingctl.invoices")


def save_copy(container, uow, remote: Invoice) -> str:
    """Apply one provider copy of an invoice in the caller's transaction: "applied", "older_ignored" (a
    newer copy is held) or "refused" (a status the provider does not document: reported, nothing written)."""
    remote = Invoice.read(remote)  # typed already, or a copy a caller holds as the provider sent it
    invoice_id, status, version = remote.id, remote.status, remote.resource_version
    local = uow.invoices.get(invoice_id)
    held = local["provider_resource_version"] if local is not None else None
    if version is not None and held is not None and held > version:
        return "older_ignored"
    current = local["status"] if local is not None else None
    step = provider_status(container, uow, INVOICE, invoice_id, current, status)
    if step is None:
        return "refused"
    fields = {"subscription_id": remote.subscription_id, "customer_id": remote.customer_id,
              "total_amount": remote.total, "currency_code": remote.currency_code, "status": status,
              "paid_at": parse_time(remote.paid_at)}
    if remote.term is not None:  # the term its plan line bills; a copy that does not say keeps the one held
        fields["term_start"], fields["term_end"] = (parse_time(t) for t in remote.term)
    if remote.deleted:  # deleted at the provider: it keeps its status and is owed by nobody (decision 201)
        fields["deleted_at"] = (local["deleted_at"] if local is not None else None) or container.clock.now()
    if local is None and uow.invoices.add({"id": invoice_id, "created_at": container.clock.now(),
                                          "provider_resource_version": version, **fields}):
        return "applied"
    if local is None:  # a racing writer inserted it first: step from what it wrote
        local = uow.invoices.get(invoice_id)
        current = local["status"]
        step = INVOICE.step(current, status)
    if not uow.invoices.update(invoice_id, current, version, **fields):
        return "older_ignored"
    provider_step_written(container, uow, INVOICE, invoice_id, current, status, step)
    if current == "paid" and status != "paid":  # payable again, or voided once its payments were removed
        owed_again(container, uow, invoice_id, status)
    return "applied"


def owed_again(container, uow, invoice_id: str, status: str) -> None:
    """A paid invoice owes again: finance removed a payment from it at the provider (its remove-payment; an
    offline transaction is deleted only once removed so). No money moved, so nothing here may charge it
    again nor record the same money twice; each payment of ours that stood recorded on it is named to a
    person at once, who applies it to the invoice again at the provider, or refunds it and voids the invoice
    there (decision 184). The renewal job skips the invoice meanwhile (`payment_removed`), and raises the
    same alert when it finds one whose paid copy never reached us (copies out of order); reconcile names it
    daily (`purchase_on_unpaid_invoice`). A paid invoice can be voided only once its payments are removed,
    so a copy stepping from paid to voided (the removal's copy was older than the void's, and dropped) is
    the same news, with one remedy left: the refund (decision 188)."""
    remedy = ("the invoice can no longer take it; refund it (billingctl payments refund {p} --reason R --yes), "
              "or apply it at the provider to another invoice the customer owes" if status not in INVOICE_PAYABLE
              else "apply the payment to it again at the provider, or, if the term is not owed, refund it "
                   "(billingctl payments refund {p} --reason R --yes) and void the invoice there")
    for payment_id, user_id in uow.purchases.reported_on(invoice_id):
        new = alerts.raise_alert(
            uow, container.clock,
            f"invoice {invoice_id} is {status} at the provider although payment {payment_id} of {user_id} "
            f"was recorded on it: a payment was removed from it there and no money moved (the customer's "
            f"excess payments hold it). Renewals will not charge it again; " + remedy.format(p=payment_id),
            f"payment-removed:{payment_id}:{invoice_id}",
            payment_id=payment_id, invoice_id=invoice_id, user_id=user_id)
        if new:
            log.error("a payment recorded on an invoice was removed from it at the provider",
                      extra={"payment_id": payment_id, "invoice_id": invoice_id, "status": status})


def name_invoice(uow, invoice_id: str, now, **fields) -> None:
    """A payment we record names its invoice: the row exists (ids, amount, currency) before the provider's
    copy says what its status is. An existing row is left as the provider's copies made it."""
    uow.invoices.add({"id": invoice_id, "created_at": now, "status": None, **fields})


def apply_copy(container, remote: Invoice | None) -> str | None:
    """`save_copy` in a transaction of its own (the copy an answer or an event showed); None without one
    (an invoice named without its status is a reference, not a copy)."""
    remote = Invoice.read(remote) if remote is not None else None  # typed, or a copy as the provider sent it
    if remote is None or remote.status is None:
        return None
    with container.uow() as uow:
        outcome = save_copy(container, uow, remote)
        uow.commit()
    return outcome
