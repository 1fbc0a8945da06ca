"""Client of the payment orchestrator: client sessions, payments, vaulted instruments."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

from billingctl.adapters.http import ResilientClient
from billingctl.adapters.subscription_provider import seg

API_VERSION = "2.4"


def processor_of(payment: dict) -> tuple[str | None, str | None]:
    """(processor name, merchant account id); the orchestrator spells the account id two ways."""
    processor = payment.get("processor") or {}
    name = processor.get("name") or None
    mid = processor.get("processorMerchantId") or processor.get("processor_merchant_id") or None
    return name, mid


class OrchestratorClient:
    dependency = "orchestrator"

    def __init__(self, http: ResilientClient, charge_timeout: float | None = None):
        self.http = http
        # Primer's API answers within 90 s (a 504 after): a call that moves money waits for that answer,
        # is sent once, and is read back (by order id) before it is ever sent again.
        self.charge_timeout = charge_timeout

    def create_client_session(self, *, order_id: str, customer_id: str, amount: int, currency_code: str,
                              metadata: dict, vault_on_success: bool = True,
                              idempotency_key: str | None = None) -> dict:
        # A checkout is the customer-initiated first payment of a subscription: its card is vaulted for the
        # merchant-initiated renewals that follow (Primer's paymentMethod.paymentType FIRST_PAYMENT).
        body = {"orderId": order_id, "currencyCode": currency_code, "amount": amount, "customerId": customer_id,
                "metadata": metadata, "paymentMethod": {"vaultOnSuccess": vault_on_success,
                                                        "paymentType": "FIRST_PAYMENT"}}
        return self.http.request("POST", "/client-session", json=body, idempotency_key=idempotency_key)

    def create_payment(self, *, payment_method_token: str, amount: int, currency_code: str, order_id: str,
                       customer_id: str, metadata: dict, idempotency_key: str | None = None) -> dict:
        """A merchant-initiated charge on a vaulted token, flagged as the scheduled payment of a subscription
        (Primer's paymentMethod.paymentType SUBSCRIPTION), so the processor sends it as a recurring MIT."""
        body = {"paymentMethodToken": payment_method_token, "amount": amount, "currencyCode": currency_code,
                "orderId": order_id, "customerId": customer_id, "metadata": metadata,
                "paymentMethod": {"paymentType": "SUBSCRIPTION"}}
        return self.http.request("POST", "/payments", json=body, idempotency_key=idempotency_key,
                                 timeout=self.charge_timeout, once=True)

    def capture_payment(self, payment_id: str, amount: int | None = None) -> dict:
        """Capture an AUTHORIZED payment (in full when no amount is given)."""
        body = {"final": True} | ({"amount": amount} if amount is not None else {})
        return self.http.request("POST", f"/payments/{seg(payment_id)}/capture", json=body,
                                 idempotency_key=f"capture:{payment_id}", timeout=self.charge_timeout, once=True)

    def cancel_payment(self, payment_id: str, reason: str = "") -> dict:
        """Void a payment that has not settled (PENDING or AUTHORIZED)."""
        return self.http.request("POST", f"/payments/{seg(payment_id)}/cancel", json={"reason": reason},
                                 idempotency_key=f"cancel:{payment_id}", timeout=self.charge_timeout, once=True)

    def list_payments(self, status: str = "SETTLED", from_date: datetime | None = None,
                      cursor: str | None = None, limit: int = 100, customer_id: str | None = None,
                      order_id: str | None = None) -> Iterator[dict]:
        while True:
            params = {"status": status, "limit": limit} if status else {"limit": limit}
            if customer_id:
                params["customer_id"] = customer_id
            if order_id:
                params["order_id"] = order_id
            if from_date is not None:
                params["from_date"] = from_date.isoformat()
            if cursor:
                params["cursor"] = cursor
            page = self.http.request("GET", "/payments", params=params)
            yield from page.get("data", [])
            cursor = page.get("nextCursor")
            if not cursor:
                return

    def payments_of_order(self, order_id: str) -> list[dict]:
        """Every payment of one order, whatever its status (summaries), oldest first."""
        return list(self.list_payments(status=None, order_id=order_id))

    def get_payment(self, payment_id: str) -> dict:
        return self.http.request("GET", f"/payments/{seg(payment_id)}")

    def refund_payment(self, payment_id: str, amount: int | None = None, reason: str = "",
                       idempotency_key: str | None = None) -> dict:
        body = {"reason": reason} | ({"amount": amount} if amount is not None else {})
        return self.http.request("POST", f"/payments/{seg(payment_id)}/refund", json=body,
                                 idempotency_key=idempotency_key or f"refund:{payment_id}")

    def list_payment_instruments(self, customer_id: str) -> list[dict]:
        return self.http.request("GET", "/payment-instruments", params={"customer_id": customer_id}).get("data", [])

    def set_default_instrument(self, token: str, idempotency_key: str | None = None) -> dict:
        return self.http.request("POST", f"/payment-instruments/{seg(token)}/default", json={},
                                 idempotency_key=idempotency_key)
