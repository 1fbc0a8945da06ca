"""Client of the payment orchestrator: client sessions, payments, vaulted instruments."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import datetime

from billingctl.adapters.http import ResilientClient
from billingctl.adapters.payloads import ClientSession, Payment, PaymentInstrument
from billingctl.adapters.subscription_provider import seg
from billingctl.domain import errors as e

API_VERSION = "2.4"
log = logging.getLogger("billingctl.orchestrator")




class OrchestratorClient:
    dependency = "orchestrator"

    def __init__(self, http: ResilientClient, charge_timeout: float | None = None):
        self.http = http
        # Primer's API answers within 90 s (a 504 after): a call that moves money waits for that answer,
        # is sent once, and is read back (by order id) before it is ever sent again.
        self.charge_timeout = charge_timeout

    def create_client_session(self, *, order_id: str, customer_id: str, amount: int, currency_code: str,
                              metadata: dict, vault_on_success: bool = True,
                              idempotency_key: str | None = None) -> ClientSession:
        # A checkout is the customer-initiated first payment of a subscription: its card is vaulted for the
        # merchant-initiated renewals that follow (Primer's paymentMethod.paymentType FIRST_PAYMENT).
        body = {"orderId": order_id, "currencyCode": currency_code, "amount": amount, "customerId": customer_id,
                "metadata": metadata, "paymentMethod": {"vaultOnSuccess": vault_on_success,
                                                        "paymentType": "FIRST_PAYMENT"}}
        try:
            answer = self.http.request("POST", "/client-session", json=body, idempotency_key=idempotency_key)
        except e.AlreadyProcessed:
            # Made already, its answer lost (Primer answers a used key 409 and never replays): a session moves
            # no money and the first one expires unused, so a new one is asked for under a key of its own.
            answer = self.http.request("POST", "/client-session", json=body,
                                       idempotency_key=f"{idempotency_key or 'session'}:again")
        return self.http.typed(ClientSession, answer)

    def create_payment(self, *, payment_method_token: str, amount: int, currency_code: str, order_id: str,
                       customer_id: str, metadata: dict, idempotency_key: str | None = None) -> Payment:
        """A merchant-initiated charge on a vaulted token, flagged as the scheduled payment of a subscription
        (Primer's paymentMethod.paymentType SUBSCRIPTION), so the processor sends it as a recurring MIT."""
        body = {"paymentMethodToken": payment_method_token, "amount": amount, "currencyCode": currency_code,
                "orderId": order_id, "customerId": customer_id, "metadata": metadata,
                "paymentMethod": {"paymentType": "SUBSCRIPTION"}}
        return self._payment(self.http.request("POST", "/payments", json=body, idempotency_key=idempotency_key,
                                 timeout=self.charge_timeout, once=True))

    def capture_payment(self, payment_id: str, amount: int | None = None) -> Payment:
        """Capture an AUTHORIZED payment (in full when no amount is given)."""
        body = {"final": True} | ({"amount": amount} if amount is not None else {})
        return self._acted_on(payment_id, "POST", f"/payments/{seg(payment_id)}/capture", json=body,
                              idempotency_key=f"capture:{payment_id}", timeout=self.charge_timeout, once=True)

    def cancel_payment(self, payment_id: str, reason: str = "") -> Payment:
        """Void a payment that has not settled (PENDING or AUTHORIZED)."""
        return self._acted_on(payment_id, "POST", f"/payments/{seg(payment_id)}/cancel", json={"reason": reason},
                              idempotency_key=f"cancel:{payment_id}", timeout=self.charge_timeout, once=True)

    def list_payments(self, status: str = "SETTLED", from_date: datetime | None = None,
                      cursor: str | None = None, limit: int = 100, customer_id: str | None = None,
                      order_id: str | None = None) -> Iterator[Payment]:
        """Payment summaries, page after page. One the orchestrator lists in a shape we cannot read is
        logged (its id) and counted as an external error, and the others are still yielded: one bad entry
        never hides the rest (decision 122)."""
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
            yield from self.http.typed_entries(Payment, page.get("data"))
            cursor = page.get("nextCursor")
            if not cursor:
                return

    def _payment(self, answer) -> Payment:
        return self.http.typed(Payment, answer)

    def _acted_on(self, payment_id: str, method: str, path: str, **request) -> Payment:
        """A capture, cancel or refund of one payment. One whose key Primer has processed already (its answer
        was lost) is read back: the payment as it is now is the answer (decision 123)."""
        try:
            return self._payment(self.http.request(method, path, **request))
        except e.AlreadyProcessed:
            log.info("already processed at the orchestrator: read back", extra={"payment_id": payment_id})
            return self.get_payment(payment_id)

    def payments_of_order(self, order_id: str) -> list[Payment]:
        """Every payment of one order, whatever its status (summaries), oldest first."""
        return list(self.list_payments(status=None, order_id=order_id))

    def get_payment(self, payment_id: str) -> Payment:
        return self._payment(self.http.request("GET", f"/payments/{seg(payment_id)}"))

    def refund_payment(self, payment_id: str, amount: int | None = None, reason: str = "",
                       idempotency_key: str | None = None) -> Payment:
        body = {"reason": reason} | ({"amount": amount} if amount is not None else {})
        return self._acted_on(payment_id, "POST", f"/payments/{seg(payment_id)}/refund", json=body,
                              idempotency_key=idempotency_key or f"refund:{payment_id}")

    def list_payment_instruments(self, customer_id: str) -> list[PaymentInstrument]:
        """The customer's vaulted instruments; one we cannot read is skipped, named and counted."""
        answer = self.http.request("GET", "/payment-instruments", params={"customer_id": customer_id})
        return list(self.http.typed_entries(PaymentInstrument, answer.get("data")))

    def set_default_instrument(self, token: str, idempotency_key: str | None = None) -> dict:
        try:
            return self.http.request("POST", f"/payment-instruments/{seg(token)}/default", json={},
                                     idempotency_key=idempotency_key)
        except e.AlreadyProcessed:
            return {}  # made the default already (its answer was lost)
