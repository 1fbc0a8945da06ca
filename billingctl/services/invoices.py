"""The local copy of the provider's invoices, one step of domain.lifecycle.INVOICE at a time (decision
117). Its status is only ever the provider's: a copy the provider sent (an event, the answer to a payment
recorded on the invoice, a read), applied in resource_version order; a payment we record names its invoice
(ids, amount) without inventing a status for it."""

from __future__ import annotations

from billingctl.adapters.payloads import Invoice
from billingctl.domain.clock import parse_time
from billingctl.domain.lifecycle import INVOICE
from billingctl.services.lifecycles import provider_status, provider_step_written


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
    return "applied"


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
