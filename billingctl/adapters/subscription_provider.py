"""Client of the subscription provider (/api/v2): the API key as Bearer or Basic, form-encoded POSTs,
dates as unix seconds, responses wrapped by object name, pagination as a generator (limit 100).
Paths and parameter names are those of the provider's official SDK (tests/integration/test_provider_sdk.py
compares the two on the wire)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from urllib.parse import quote

from billingctl.adapters.http import ResilientClient
from billingctl.adapters.payloads import (
    EventEnvelope,
    Invoice,
    InvoiceAnswer,
    Subscription,
    SubscriptionAnswer,
    Transaction,
)
from billingctl.domain import errors as e

PAGE_LIMIT = 100


def seg(value: str) -> str:
    """One path segment, percent-encoded: an id never changes the path it is placed in."""
    return quote(str(value), safe="")


def _ts(value: datetime | int | None) -> int | None:
    if value is None:
        return None
    return int(value.timestamp()) if isinstance(value, datetime) else int(value)


class SubscriptionProviderClient:
    dependency = "subscription_provider"

    def __init__(self, http: ResilientClient):
        self.http = http

    def now(self, local_now: datetime) -> datetime:
        """The provider's time now (its answers' `Date` header), for a date that means "now" to it
        (a start date): never in its future, whatever our clock says (decision 115)."""
        return self.http.server_now(local_now)

    def knows_its_clock(self) -> bool:
        return self.http.server_offset is not None

    # -- plumbing ---------------------------------------------------------------------------
    def _get(self, path: str, params: dict | None = None) -> dict:
        return self.http.request("GET", f"/api/v2{path}", params=params)

    def _post(self, path: str, data: dict | None = None, idempotency_key: str | None = None) -> dict:
        # Form-encoded even when empty (a cancel, a void), as the provider's SDK sends it.
        return self.http.request("POST", f"/api/v2{path}", data=data or {}, idempotency_key=idempotency_key,
                                 headers={"Content-Type": "application/x-www-form-urlencoded"})

    def paginate(self, path: str, params: dict | None = None, wrapper: str | None = None) -> Iterator[dict]:
        """Every object of a list endpoint, page after page (as the provider sent it: the typed lists below
        read each one); callers never see offsets."""
        params = {k: v for k, v in (params or {}).items() if v is not None}
        params["limit"] = PAGE_LIMIT
        while True:
            page = self._get(path, params)
            for entry in page.get("list", []):
                yield entry[wrapper] if wrapper else entry
            offset = page.get("next_offset")
            if not offset:
                return
            params["offset"] = offset

    # -- subscriptions ------------------------------------------------------------------------
    def _typed(self, model, answer):
        return self.http.typed(model, answer)

    def get_subscription(self, subscription_id: str) -> Subscription:
        return self._typed(Subscription, self._get(f"/subscriptions/{seg(subscription_id)}").get("subscription"))

    def list_subscriptions(self, updated_after: datetime | int | None = None,
                           status: str | None = None, customer_id: str | None = None) -> Iterator[Subscription]:
        return self.http.typed_entries(Subscription, self.paginate(
            "/subscriptions", {"updated_at[after]": _ts(updated_after), "status[is]": status,
                               "customer_id[is]": customer_id, "sort_by[asc]": "updated_at"}, wrapper="subscription"))

    def create_subscription_for_items(self, customer_id: str, item_price_id: str, start_date: datetime | int,
                                      idempotency_key: str | None = None) -> SubscriptionAnswer:
        # Collected by the orchestrator and recorded offline: never collected automatically by the provider,
        # which would refuse (or cancel) a subscription of a customer with no payment method on file.
        return self._typed(SubscriptionAnswer, self._post(
            f"/customers/{seg(customer_id)}/subscription_for_items",
            {"subscription_items[item_price_id][0]": item_price_id, "start_date": _ts(start_date),
             "auto_collection": "off"}, idempotency_key))

    def start_subscription(self, subscription_id: str, start_date: datetime | int,
                           idempotency_key: str | None = None) -> SubscriptionAnswer:
        """Move a future subscription's start to `start_date` (update_for_items): at or before now it
        starts, and the response carries the invoice of its first term."""
        return self._typed(SubscriptionAnswer, self._post(f"/subscriptions/{seg(subscription_id)}/update_for_items",
                                                          {"start_date": _ts(start_date)}, idempotency_key))

    def change_term_end(self, subscription_id: str, term_ends_at: datetime | int,
                        idempotency_key: str | None = None) -> SubscriptionAnswer:
        return self._typed(SubscriptionAnswer, self._post(f"/subscriptions/{seg(subscription_id)}/change_term_end",
                                                          {"term_ends_at": _ts(term_ends_at)}, idempotency_key))

    def cancel_subscription(self, subscription_id: str, idempotency_key: str | None = None) -> SubscriptionAnswer:
        return self._typed(SubscriptionAnswer, self._post(f"/subscriptions/{seg(subscription_id)}/cancel_for_items",
                                                          {}, idempotency_key))

    # -- events -------------------------------------------------------------------------------
    def list_events(self, occurred_after: datetime | int | None = None) -> Iterator[EventEnvelope]:
        return self.http.typed_entries(EventEnvelope, self.paginate(
            "/events", {"occurred_at[after]": _ts(occurred_after), "sort_by[asc]": "occurred_at"}, wrapper="event"))

    def events_page(self, occurred_after: datetime | int | None = None,
                    offset: str | None = None) -> tuple[list[EventEnvelope], str | None]:
        """One page of events and the offset of the next (None on the last); the poller keeps its own cursor.
        Each is read as far as the inbox needs it: its content is read when it is processed."""
        params = {"occurred_at[after]": _ts(occurred_after), "sort_by[asc]": "occurred_at",
                  "limit": PAGE_LIMIT, "offset": offset}
        page = self._get("/events", {k: v for k, v in params.items() if v is not None})
        entries = [entry.get("event") if isinstance(entry, dict) else entry for entry in page.get("list") or []]
        return list(self.http.typed_entries(EventEnvelope, entries)), page.get("next_offset") or None

    # -- invoices -----------------------------------------------------------------------------
    def get_invoice(self, invoice_id: str) -> Invoice:
        return self._typed(Invoice, self._get(f"/invoices/{seg(invoice_id)}").get("invoice"))

    def list_invoices(self, status: str | tuple[str, ...] | None = None, subscription_id: str | None = None,
                      updated_after: datetime | int | None = None) -> Iterator[Invoice]:
        """`status`: one status (`status[is]`), or several in one list (`status[in]`, encoded as the official
        SDK encodes a list filter: Python's repr of the list of strings, which the provider takes)."""
        several = isinstance(status, tuple)
        return self.http.typed_entries(Invoice, self.paginate(
            "/invoices", {"status[is]": None if several else status,
                          "status[in]": str([str(s) for s in status]) if several else None,
                          "subscription_id[is]": subscription_id, "updated_at[after]": _ts(updated_after)},
            wrapper="invoice"))

    def void_invoice(self, invoice_id: str, idempotency_key: str | None = None) -> InvoiceAnswer:
        return self._typed(InvoiceAnswer, self._post(f"/invoices/{seg(invoice_id)}/void", {}, idempotency_key))

    def record_payment(self, invoice_id: str, amount: int, reference_number: str,
                       idempotency_key: str | None = None) -> InvoiceAnswer:
        return self._typed(InvoiceAnswer, self._post(
            f"/invoices/{seg(invoice_id)}/record_payment",
            {"transaction[amount]": amount, "transaction[reference_number]": reference_number,
             "transaction[payment_method]": "other"},
            idempotency_key or f"record_payment:{seg(invoice_id)}:{reference_number}"))

    # -- catalog and customers ----------------------------------------------------------------
    def get_item_price(self, item_price_id: str) -> dict:
        return self._get(f"/item_prices/{seg(item_price_id)}")["item_price"]

    def list_item_prices(self, item_type: str | None = "plan") -> Iterator[dict]:
        return self.paginate("/item_prices", {"item_type[is]": item_type}, wrapper="item_price")

    def get_customer(self, customer_id: str) -> dict:
        return self._get(f"/customers/{seg(customer_id)}")["customer"]

    def create_customer(self, customer_id: str, email: str | None = None,
                        idempotency_key: str | None = None) -> dict:
        data = {"id": customer_id, "auto_collection": "off"}  # payments are taken by the orchestrator
        if email:
            data["email"] = email
        return self._post("/customers", data, idempotency_key or f"customer:{seg(customer_id)}")["customer"]

    # -- transactions ---------------------------------------------------------------------------
    def list_transactions(self, kind: str = "payment", after: datetime | int | None = None) -> Iterator[Transaction]:
        """Transactions of one type (oldest first), page by page."""
        return self.http.typed_entries(Transaction, self.paginate(
            "/transactions", {"type[is]": kind, "date[after]": _ts(after), "sort_by[asc]": "date"},
            wrapper="transaction"))

    def payments_referenced(self, reference_number: str) -> list[Transaction]:
        """The provider's payment transactions recorded with this reference (an orchestrator payment id):
        one request (`reference_number[is]`; a payment has one unless it was recorded twice)."""
        return list(self.http.typed_entries(Transaction, self.paginate(
            "/transactions", {"reference_number[is]": reference_number, "type[is]": "payment"},
            wrapper="transaction")))

    def get_transaction(self, transaction_id: str, include_deleted: bool = False) -> Transaction:
        """`include_deleted`: one the provider deleted (with its subscription, decision 220) is no longer
        found, but its list still holds it when asked (`id[is]`, `include_deleted=true`): read so, one call
        more, only then."""
        try:
            return self._typed(Transaction, self._get(f"/transactions/{seg(transaction_id)}").get("transaction"))
        except e.ExternalNotFound:
            if not include_deleted:
                raise
            answer = self._get("/transactions", {"id[is]": transaction_id, "include_deleted": "true", "limit": 1})
            if not answer.get("list"):
                raise
            return self._typed(Transaction, answer["list"][0].get("transaction"))
