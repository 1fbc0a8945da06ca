"""Fraud signals from outside: disputes opened at the orchestrator."""

from __future__ import annotations

from billingctl.adapters.db.tables import fraud_event
from billingctl.services import alerts


def record_dispute(container, event_type: str, payment: dict, dispute: dict) -> dict:
    if event_type != "DISPUTE.OPENED":
        return {"outcome": "ignored"}
    user_id = payment.get("customerId") or (payment.get("metadata") or {}).get("user_id") or "unknown"
    now = container.clock.now()
    with container.uow() as uow:
        uow.execute(fraud_event.insert().values(user_id=user_id, event_type="dispute_opened", created_at=now,
                                                metadata={"merchant_context": "full",
                                                          "amount": payment.get("amount"),
                                                          "payment_id": payment["id"],
                                                          "reason": dispute.get("reason")}))
        alerts.raise_alert(uow, container.clock, f"Dispute opened on payment {payment['id']} by user {user_id}",
                           f"dispute:{dispute.get('id') or payment['id']}", amount=payment.get("amount"),
                           reason=dispute.get("reason") or "")
        uow.commit()
    return {"outcome": "recorded", "user_id": user_id}
