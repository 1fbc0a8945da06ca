"""Fraud signals from outside: disputes opened at the orchestrator."""

from __future__ import annotations

import logging

from billingctl.domain import errors as e
from billingctl.services import alerts

log = logging.getLogger("billingctl.fraud")


def record_dispute(container, event_type: str, dispute: dict) -> dict:
    """DISPUTE.OPENED in the orchestrator's flat shape (paymentId, processorDisputeId, processorId, orderId):
    a fraud signal and one chat alert per dispute. The user and the amount come from our purchase of that
    payment, else from the orchestrator's payment."""
    if event_type != "DISPUTE.OPENED":
        return {"outcome": "ignored"}
    payment_id, dispute_id = dispute["paymentId"], dispute["processorDisputeId"]
    with container.uow() as uow:
        bought = uow.purchases.by_payment_id(payment_id)
    user_id, amount = (bought["user_id"], bought["amount"]) if bought is not None else (None, None)
    if bought is None:
        try:
            payment = container.orchestrator.get_payment(payment_id)
            user_id = payment.get("customerId") or (payment.get("metadata") or {}).get("user_id")
            amount = payment.get("amount")
        except e.BillingError as exc:  # the dispute is still recorded and alerted; the user is looked up by hand
            log.warning("disputed payment could not be read: %s", exc.message, extra={"payment_id": payment_id})
    user_id = user_id or "unknown"
    now = container.clock.now()
    with container.uow() as uow:
        uow.fraud.add(user_id, "dispute_opened", now, {"merchant_context": "full", "amount": amount,
                                                       "payment_id": payment_id, "dispute_id": dispute_id,
                                                       "processor": dispute.get("processorId")})
        alerts.raise_alert(uow, container.clock, f"Dispute opened on payment {payment_id} by user {user_id}",
                           f"dispute:{dispute_id}", amount=amount, processor=dispute.get("processorId") or "")
        uow.commit()
    return {"outcome": "recorded", "user_id": user_id}
