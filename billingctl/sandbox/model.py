"""The sandbox's behaviour: one subscription provider and one payment orchestrator sharing one store.

Like the deployment the spec describes, the orchestrator's lane workflow reports each settled
payment to the provider (the invoice is paid with the payment id as reference and the provider
emits payment_succeeded), and signed webhooks are delivered to the billing service."""

from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import json
import logging
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

from billingctl.sandbox.store import SandboxStore

CATALOG = [
    {"id": "credits-basic-USD-monthly", "item_id": "credits-basic", "name": "Basic monthly", "price": 999,
     "metadata": {"credits": 1000, "lane": "sfw"}},
    {"id": "credits-pro-USD-monthly", "item_id": "credits-pro", "name": "Pro monthly", "price": 1999,
     "metadata": {"credits": 2000, "lane": "sfw"}},
    {"id": "credits-pro-nsfw-USD-monthly", "item_id": "credits-pro-nsfw", "name": "Pro (NSFW) monthly",
     "price": 2999, "metadata": {"credits": 3000, "lane": "nsfw"}},
    {"id": "credits-max-nsfw-USD-monthly", "item_id": "credits-max-nsfw", "name": "Max (NSFW) monthly",
     "price": 4999, "metadata": {"credits": 6000, "lane": "nsfw"}},
]
# A real catalog also holds addon and charge item prices (and plans of other products) without our
# metadata: product listing must skip them, never fail on them.
FOREIGN_CATALOG = [
    {"id": "extra-storage-USD-monthly", "item_id": "extra-storage", "name": "Extra storage", "price": 299,
     "item_type": "addon"},
    {"id": "setup-fee-USD", "item_id": "setup-fee", "name": "Setup fee", "price": 500, "item_type": "charge",
     "period": None, "period_unit": None},
    {"id": "legacy-team-USD-monthly", "item_id": "legacy-team", "name": "Legacy team plan", "price": 9900,
     "item_type": "plan"},
]
# Subscription statuses the provider accepts change_term_end for (the rest: invalid_state_for_request).
TERM_CHANGE_STATUSES = ("in_trial", "active", "non_renewing")
PAYABLE_INVOICE_STATUSES = ("payment_due", "not_paid", "posted")
# How far behind the provider's clock a start date may be and still mean "now" (the sandbox's model: a
# request's reading of now is seconds old when it arrives); further back is backdating (decision 115).
PAST_START_TOLERANCE = 60
# Orchestrator payment statuses that are not final: the charge is in flight.
IN_FLIGHT = ("PENDING", "AUTHORIZED", "SETTLING")
# Primer retries a webhook that gets no 2xx answer ("Any response outside the 2xx range ... is treated as a
# failure and will trigger retries") "up to 5 times with increasing delays. Typical retry schedule: ~10
# seconds, ~60 seconds, ~5 minutes, ~10 minutes, ~15 minutes. After the final retry attempt, the event is
# dropped and will not be retried again" (Configure webhooks: delivery model): about 31 minutes in all.
WEBHOOK_RETRIES = (10, 60, 300, 600, 900)
# Lane workflows route a first payment: SFW to the regular processors, NSFW to the high-risk ones.
WORKFLOW_DEFAULT = {"sfw": "SFW_STRIPE", "nsfw": "NSFW_SEGPAY"}
TERM_SECONDS = 30 * 86400
log = logging.getLogger("billingctl.sandbox")


class SandboxError(Exception):
    """A refusal, in the provider's error shape; the orchestrator app nests it as its API does."""

    def __init__(self, status: int, message: str, api_error_code: str = "invalid_request", param: str | None = None,
                 error_type: str = "invalid_request"):
        super().__init__(message)
        self.status = status
        self.api_error_code = api_error_code
        self.body = {"message": message, "type": error_type, "api_error_code": api_error_code,
                     "http_status_code": status}
        if param:
            self.body["param"] = param


def _on_off(value: str | None, default: str) -> str:
    if value in (None, ""):
        return default
    if value not in ("on", "off"):
        raise SandboxError(400, "auto_collection : invalid value", "param_wrong_value", "auto_collection")
    return value


def card_expired(instrument: dict, now: float) -> bool:
    from datetime import UTC, datetime

    data = instrument.get("paymentMethodData") or {}
    try:
        year, month = int(data["expirationYear"]), int(data["expirationMonth"])
    except (KeyError, ValueError):
        return False
    today = datetime.fromtimestamp(now, UTC)
    return (year, month) < (today.year, today.month)


def sign_body(secret: str, body: bytes) -> str:
    return base64.b64encode(hmac.new(secret.encode(), body, hashlib.sha256).digest()).decode()


class Sandbox:
    def __init__(self, store: SandboxStore, webhook_secret: str = "",
                 deliver: Callable[[str, bytes, dict], int] | None = None, disputes_secret: str = ""):
        self.store = store
        self.webhook_secret = webhook_secret
        self.disputes_secret = disputes_secret
        self.deliver = deliver
        if not self.store.meta("seeded"):
            self.seed()

    def seed(self) -> None:
        now = int(self.store.now())
        for price in CATALOG + FOREIGN_CATALOG:
            self.store.put("item_price", price["id"], {
                "status": "active", "pricing_model": "flat_fee", "currency_code": "USD", "period": 1,
                "period_unit": "month", "item_type": "plan", "updated_at": now, "object": "item_price", **price})
        self.store.set_meta("seeded", True)

    def now(self) -> int:
        return int(self.store.now())

    # ---- provider: customers, subscriptions, invoices, events ---------------------------------
    def customer(self, customer_id: str) -> dict:
        found = self.store.get("customer", customer_id)
        if found is None:
            raise SandboxError(404, f"Sorry, we couldn't find that resource: {customer_id}", "resource_not_found")
        return found

    def create_customer(self, customer_id: str | None, email: str | None = None,
                        auto_collection: str | None = None) -> dict:
        """POST /customers: an id already taken is refused (duplicate_entry), as the real provider does;
        auto_collection defaults to on, as there."""
        customer_id = customer_id or self.store.next_id("cus")
        auto_collection = _on_off(auto_collection, "on")
        with self.store.tx():
            if self.store.get("customer", customer_id) is not None:
                raise SandboxError(400, f"id : The value {customer_id} is already present.", "duplicate_entry", "id",
                                   error_type="invalid_request")
            customer = {"id": customer_id, "email": email, "auto_collection": auto_collection, "deleted": False,
                        "created_at": self.now(), "updated_at": self.now(), "object": "customer",
                        "net_term_days": 0, "allow_direct_debit": False, "taxability": "taxable",
                        "pii_cleared": "active", "card_status": "no_card", "promotional_credits": 0,
                        "refundable_credits": 0, "excess_payments": 0, "unbilled_charges": 0,
                        "preferred_currency_code": "USD", "resource_version": int(self.store.now() * 1000)}
            self.store.put("customer", customer_id, customer)
        return {"customer": customer}

    def item_price(self, item_price_id: str) -> dict:
        found = self.store.get("item_price", item_price_id)
        if found is None:
            raise SandboxError(404, f"Item price {item_price_id} not found", "resource_not_found")
        return found

    def subscription(self, subscription_id: str) -> dict:
        """A deleted subscription is not found (the provider lists it only with include_deleted)."""
        found = self.store.get("subscription", subscription_id)
        if found is None or found.get("deleted"):
            raise SandboxError(404, f"Subscription {subscription_id} not found", "resource_not_found")
        return found

    def invoice(self, invoice_id: str) -> dict:
        """A deleted invoice is not found (the provider lists it only with include_deleted)."""
        found = self.store.get("invoice", invoice_id)
        if found is None or found.get("deleted"):
            raise SandboxError(404, f"Invoice {invoice_id} not found", "resource_not_found")
        return self._past_due(found)

    def _past_due(self, invoice: dict) -> dict:
        """A posted invoice (payment terms) whose due date has passed unpaid is payment_due ("The invoice
        status will change to Payment Due if the due period has been exceeded"). The provider documents no
        event for it: none is sent, and a client learns it from a read (decision 245)."""
        if invoice.get("status") == "posted" and (invoice.get("due_date") or 0) <= self.now():
            invoice["status"] = "payment_due"
            self._save_invoice(invoice)
        return invoice

    def set_net_term_days(self, customer_id: str, days: int) -> dict:
        """Finance gives a customer payment terms (the customer's `net_term_days`, a console action here;
        our client never sets it): the invoices generated for them afterwards, of subscriptions not
        collected automatically (ours), are posted until `days` days after their date (decision 245)."""
        if int(days) < 0:
            raise SandboxError(400, "net_term_days : cannot be negative", "param_wrong_value", "net_term_days")
        customer = self.customer(customer_id)
        customer.update(net_term_days=int(days), updated_at=self.now(), resource_version=int(self.store.now() * 1000))
        self.store.put("customer", customer_id, customer)
        return {"customer": customer}

    def transaction(self, txn_id: str) -> dict:
        """A deleted transaction (with its subscription) is not found."""
        found = self.store.get("transaction", txn_id)
        if found is None or found.get("deleted"):
            raise SandboxError(404, f"Sorry, we couldn't find that resource: {txn_id}", "resource_not_found")
        return found

    def _save_subscription(self, sub: dict) -> dict:
        sub["updated_at"] = self.now()
        sub["resource_version"] = int(self.store.now() * 1000)
        return self.store.put("subscription", sub["id"], sub)

    def _save_invoice(self, invoice: dict) -> dict:
        """Every change of an invoice, like a subscription's, gets updated_at and a new resource_version
        (milliseconds): the provider's clients order copies by it."""
        invoice["updated_at"] = self.now()
        invoice["resource_version"] = int(self.store.now() * 1000)
        return self.store.put("invoice", invoice["id"], invoice)

    def emit(self, event_type: str, content: dict, occurred_at: int | None = None) -> dict:
        event = {"id": self.store.next_id("ev"), "occurred_at": occurred_at or self.now(), "source": "api",
                 "api_version": "v2", "event_type": event_type, "webhook_status": "not_configured",
                 "content": content}
        self.store.put("event", event["id"], event)
        return event

    def _collectable(self, customer: dict, auto_collection: str) -> None:
        """A subscription collected automatically needs a payment method to invoice: with none (payments
        here are taken by the orchestrator, never stored at the provider) the provider refuses."""
        if auto_collection == "on" and customer.get("card_status", "no_card") == "no_card" \
                and not customer.get("primary_payment_source_id"):
            raise SandboxError(400, "Payment method is not present for this customer", "payment_method_not_present",
                               error_type="payment")

    def create_subscription_for_items(self, customer_id: str, item_price_id: str, start_date: int | None,
                                      auto_collection: str | None = None) -> dict:
        """Only for an existing customer. A future subscription has no invoice: it is invoiced when it starts.
        auto_collection defaults to the customer's."""
        customer = self.customer(customer_id)
        auto_collection = _on_off(auto_collection, customer.get("auto_collection", "on"))
        price = self.item_price(item_price_id)
        if price.get("item_type") != "plan":
            raise SandboxError(400, "subscription_items[item_price_id][0] : must be a plan item price",
                               "param_wrong_value", "subscription_items[item_price_id][0]")
        now = self.now()
        self._not_backdated(start_date, now)
        future = start_date is not None and start_date > now
        if not future:
            self._collectable(customer, auto_collection)
        sub_id = self.store.next_id("sub")
        sub = {
            "id": sub_id, "customer_id": customer_id, "status": "future" if future else "active",
            "start_date": start_date or now, "current_term_start": None if future else now,
            "current_term_end": None if future else now + TERM_SECONDS, "created_at": now,
            "currency_code": price["currency_code"], "deleted": False, "coupons": [], "object": "subscription",
            "billing_period": 1, "billing_period_unit": "month", "auto_collection": auto_collection,
            "due_invoices_count": 0,
            "has_scheduled_changes": False, "channel": "web", "mrr": 0,
            "subscription_items": [{"item_price_id": item_price_id, "item_type": "plan", "quantity": 1,
                                    "unit_price": price["price"], "amount": price["price"],
                                    "object": "subscription_item"}],
        }
        if not future:
            sub["activated_at"] = now
        self._save_subscription(sub)
        self.emit("subscription_created", {"subscription": sub, "customer": customer})
        result = {"subscription": sub, "customer": customer}
        if not future:
            result["invoice"] = self._new_invoice(sub, price)
        return result

    def _not_backdated(self, start_date: int | None, now: float) -> None:
        """The provider refuses a start date in the past unless the site enables backdating, which is off
        by default (its "Backdating subscriptions" setting; `sandbox backdating on`). A start a few seconds
        behind its clock is any request's own reading of "now": up to PAST_START_TOLERANCE it starts now."""
        backdated = start_date is not None and int(start_date) < now - PAST_START_TOLERANCE
        if backdated and not self.store.meta("backdating"):
            raise SandboxError(400, "start_date : cannot be earlier than the current date; backdating is not "
                               "enabled for this site", "param_wrong_value", "start_date")

    def start_future_subscription(self, subscription_id: str, start_date: int) -> dict:
        """update_for_items with start_date: the documented way to move a future subscription's start.
        A start at or before now starts it: a new term and its first invoice, which the response carries."""
        sub = self.subscription(subscription_id)
        if sub["status"] != "future":
            raise SandboxError(400, "start_date : can be changed only for future subscriptions",
                               "invalid_state_for_request", "start_date")
        now = self.now()
        self._not_backdated(start_date, now)
        if start_date > now:
            sub["start_date"] = int(start_date)
            self._save_subscription(sub)
            return {"subscription": sub, "customer": self.customer(sub["customer_id"])}
        self._collectable(self.customer(sub["customer_id"]), sub.get("auto_collection", "on"))
        sub.update(status="active", start_date=now, current_term_start=now, current_term_end=now + TERM_SECONDS,
                   activated_at=now)
        self._save_subscription(sub)
        price = self.item_price(sub["subscription_items"][0]["item_price_id"])
        invoice = self._new_invoice(sub, price)
        self.emit("subscription_started", {"subscription": sub, "invoice": invoice})
        return {"subscription": sub, "customer": self.customer(sub["customer_id"]), "invoice": invoice}

    def _new_invoice(self, sub: dict, price: dict) -> dict:
        invoice = {"id": self.store.next_id("inv"), "subscription_id": sub["id"], "customer_id": sub["customer_id"],
                   "status": "payment_due", "total": price["price"], "amount_paid": 0, "amount_due": price["price"],
                   "currency_code": price["currency_code"], "paid_at": None, "date": self.now(),
                   "updated_at": self.now(),
                   # the term the plan line bills, as the provider's line items say (date_from, date_to)
                   "line_items": [{"entity_type": "plan_item_price", "entity_id": price["id"],
                                   "amount": price["price"], "date_from": sub.get("current_term_start"),
                                   "date_to": sub.get("current_term_end"), "object": "line_item"}],
                   "linked_payments": [], "object": "invoice", "recurring": True, "price_type": "tax_exclusive",
                   "exchange_rate": 1.0, "deleted": False, "sub_total": price["price"], "write_off_amount": 0,
                   "credits_applied": 0, "amount_adjusted": 0, "base_currency_code": price["currency_code"]}
        terms = int((self.store.get("customer", sub["customer_id"]) or {}).get("net_term_days") or 0)
        if terms and sub.get("auto_collection", "on") == "off":  # payment terms: posted until the due date
            invoice.update(status="posted", net_term_days=terms, due_date=self.now() + terms * 86400)
        self._save_invoice(invoice)
        self.emit("invoice_generated", {"invoice": invoice})
        return invoice

    def renew_due(self) -> list[dict]:
        """Active subscriptions whose term ended renew: a new term and a renewal invoice, payment_due (posted
        under payment terms). Non-renewing ones whose term ended are cancelled instead, at the term's end;
        posted invoices past their due date are payment_due."""
        invoices = []
        now = self.now()
        live = [("deleted", "is not", 1)]
        for sub in self.store.page("subscription", [("status", "=", "non_renewing"), *live], None, 0, 1 << 62)[0]:
            if sub["status"] == "non_renewing" and sub.get("current_term_end") and sub["current_term_end"] <= now:
                sub.update(status="cancelled", cancelled_at=sub["current_term_end"])
                self._save_subscription(sub)
                self.emit("subscription_cancelled", {"subscription": sub})
        # Only the active ones are read (the status index): a provider with a long history renews as fast.
        for sub in self.store.page("subscription", [("status", "=", "active"), *live], None, 0, 1 << 62)[0]:
            if sub["status"] != "active" or not sub.get("current_term_end") or sub["current_term_end"] > now:
                continue
            price = self.item_price(sub["subscription_items"][0]["item_price_id"])
            sub["current_term_start"] = sub["current_term_end"]
            sub["current_term_end"] = sub["current_term_end"] + TERM_SECONDS
            self._save_subscription(sub)
            invoice = self._new_invoice(sub, price)
            invoice["recurring"] = True
            self._save_invoice(invoice)
            self.emit("subscription_renewed", {"subscription": sub, "invoice": invoice})
            invoices.append(invoice)
        for invoice in self.store.page("invoice", [("status", "=", "posted"), *live], None, 0, 1 << 62)[0]:
            self._past_due(invoice)
        return invoices

    def decline_customer(self, customer_id: str, decline: bool = True) -> None:
        """Every merchant-initiated charge of this customer is declined (DO_NOT_HONOR) while set."""
        with self.store.tx() as db:
            db.execute("DELETE FROM objects WHERE kind='declines' AND id=?", (customer_id,))
        if decline:
            self.store.put("declines", customer_id, {"id": customer_id})

    def change_term_end(self, subscription_id: str, term_ends_at: int) -> dict:
        """Only in_trial, active and non_renewing subscriptions (a future one is started, not extended)."""
        sub = self.subscription(subscription_id)
        if sub["status"] not in TERM_CHANGE_STATUSES:
            raise SandboxError(400, f"The subscription is in {sub['status']} state. Term end can be changed only "
                               "for in_trial, active and non_renewing subscriptions", "invalid_state_for_request")
        sub["current_term_end"] = int(term_ends_at)
        self._save_subscription(sub)
        return {"subscription": sub, "customer": self.customer(sub["customer_id"])}

    def cancel(self, subscription_id: str, cancel_reason: str | None = None, end_of_term: bool = False) -> dict:
        """A cancel now (the API's default, or the console's). `cancel_reason` is the provider's own, set only
        when it cancels by itself: "not_paid" after its dunning (or its offline-invoice cancel rule).
        `end_of_term` (support's scheduled cancel; our client never sends it): an active subscription becomes
        non_renewing, `cancelled_at` its term's end, when renew_due cancels it instead of renewing it."""
        sub = self.subscription(subscription_id)
        if sub["status"] == "cancelled":
            raise SandboxError(400, "Subscription is already cancelled", "invalid_state_for_request")
        if end_of_term:
            return self._console_step(subscription_id, ("in_trial", "active", "non_renewing"), "Only a subscription "
                                      "with a running term can be cancelled at its end", "non_renewing",
                                      "subscription_cancellation_scheduled", cancelled_at=sub["current_term_end"])
        sub.update(status="cancelled", cancelled_at=self.now())
        if cancel_reason is not None:
            sub["cancel_reason"] = cancel_reason
        self._save_subscription(sub)
        self.emit("subscription_cancelled", {"subscription": sub})
        return {"subscription": sub, "customer": self.customer(sub["customer_id"])}

    def remove_scheduled_cancellation(self, subscription_id: str) -> dict:
        """A cancel scheduled for the term's end is taken back: non_renewing becomes active and renews."""
        return self._console_step(subscription_id, ("non_renewing",), "Only a non_renewing subscription has a "
                                  "scheduled cancellation", "active", "subscription_scheduled_cancellation_removed",
                                  drop=("cancelled_at",))

    def pause(self, subscription_id: str) -> dict:
        """Support pauses a subscription at the provider's console (pause_option immediately). Like the real
        provider, only an active or non-renewing one: a paused one renews no more (renew_due reads active
        ones) until it is resumed."""
        return self._console_step(subscription_id, ("active", "non_renewing"), "Only active and non_renewing "
                                  "subscriptions can be paused", "paused", "subscription_paused", pause_date=self.now())

    def resume(self, subscription_id: str) -> dict:
        """A paused subscription resumed (resume_option immediately): active again; a term that ended while
        it was paused renews at the next renew_due, which invoices it."""
        return self._console_step(subscription_id, ("paused",), "Only paused subscriptions can be resumed", "active",
                                  "subscription_resumed", drop=("pause_date",))

    def _console_step(self, subscription_id: str, allowed: tuple[str, ...], refusal: str, status: str, event: str,
                      drop: tuple[str, ...] = (), **values) -> dict:
        """One step of a subscription at the provider: refused (invalid_state_for_request) from a status
        outside `allowed`; else the new status and values, the `drop`ped fields removed, saved, its event."""
        sub = self.subscription(subscription_id)
        if sub["status"] not in allowed:
            raise SandboxError(400, f"The subscription is in {sub['status']} state. {refusal}",
                               "invalid_state_for_request")
        sub.update(status=status, **values)
        for key in drop:
            sub.pop(key, None)
        self._save_subscription(sub)
        self.emit(event, {"subscription": sub})
        return {"subscription": sub, "customer": self.customer(sub["customer_id"])}

    def reactivate(self, subscription_id: str) -> dict:
        """Support reactivates a cancelled subscription at the provider's console (a general reactivation,
        no reactivate_from). Only a cancelled one, like the provider. Out of term: active again with a new
        term from now, invoiced at once (the invoice is the response's and the `subscription_reactivated`
        event's). In term (the provider cancelled it for non-payment and its term has not ended): the term
        is kept and no invoice is made; the unpaid one is not collected by the reactivation."""
        sub = self.subscription(subscription_id)
        if sub["status"] != "cancelled":
            raise SandboxError(400, f"The subscription is in {sub['status']} state. Only cancelled subscriptions "
                               "can be reactivated", "invalid_state_for_request")
        now = self.now()
        in_term = sub.get("cancel_reason") == "not_paid" and (sub.get("current_term_end") or 0) > now
        if not in_term:
            sub.update(current_term_start=now, current_term_end=now + TERM_SECONDS, activated_at=now)
        sub["status"] = "active"
        sub.pop("cancelled_at", None)
        sub.pop("cancel_reason", None)
        self._save_subscription(sub)
        invoice = None if in_term else self._new_invoice(
            sub, self.item_price(sub["subscription_items"][0]["item_price_id"]))
        self.emit("subscription_reactivated", {"subscription": sub, **({"invoice": invoice} if invoice else {})})
        return {"subscription": sub, "customer": self.customer(sub["customer_id"]),
                **({"invoice": invoice} if invoice else {})}

    def void_invoice(self, invoice_id: str) -> dict:
        """The provider's prerequisites: a payable invoice (payment_due, posted, not_paid) with no payment
        linked to it (a successful or in-progress one must be removed first) and nothing adjusted. Like the
        provider (its `invoice_updated` is "triggered when you make the following changes to the invoice -
        void, delete, ...") the void sends the voided invoice as `invoice_updated` (decision 200)."""
        invoice = self.invoice(invoice_id)
        if invoice["status"] not in ("payment_due", "posted", "not_paid"):
            raise SandboxError(400, f"The invoice is in {invoice['status']} state. Only payment_due, posted and "
                               "not_paid invoices can be voided", "invalid_state_for_request")
        if any(p.get("txn_status") in ("success", "in_progress") for p in invoice.get("linked_payments") or []):
            raise SandboxError(400, "The invoice has payments linked to it. Remove them before voiding the invoice",
                               "invalid_state_for_request")
        if int(invoice.get("amount_adjusted") or 0):
            raise SandboxError(400, "The invoice has adjustments. It cannot be voided", "invalid_state_for_request")
        invoice.update(status="voided", voided_at=self.now())
        self._save_invoice(invoice)
        self.emit("invoice_updated", {"invoice": invoice})
        return {"invoice": invoice}

    def offline_dunning_ends(self, invoice_id: str, cancel_subscription: bool = False) -> dict:
        """The provider's dunning for offline payments (a site setting, for subscriptions with auto collection
        off, as ours are) reaches its end on an unpaid invoice and takes its final action: the invoice is
        marked not_paid ("If an invoice has been partially paid, it cannot be marked as Voided or Not Paid,
        but the subscription will be cancelled": one with a payment applied stays as it is), and with
        `cancel_subscription` the subscription is cancelled for non-payment (`cancel_reason` not_paid).
        `invoice_updated` carries the invoice, `subscription_cancelled` the subscription (decision 244). The
        provider's offline dunning reminds and acts on Payment Due invoices only: one posted under payment
        terms is refused until its due date has passed (it is payment_due then)."""
        invoice = self.invoice(invoice_id)
        if invoice["status"] != "payment_due":  # a posted invoice is not due yet: its dunning starts at its due date
            raise SandboxError(400, f"The invoice is in {invoice['status']} state: no dunning runs on it",
                               "invalid_state_for_request")
        if not int(invoice.get("amount_paid") or 0):
            invoice["status"] = "not_paid"
            self._save_invoice(invoice)
            self.emit("invoice_updated", {"invoice": invoice})
        answer = {"invoice": invoice}
        sub = self.store.get("subscription", invoice.get("subscription_id") or "")
        if cancel_subscription and sub is not None and sub["status"] in ("active", "non_renewing"):
            answer["subscription"] = self.cancel(sub["id"], cancel_reason="not_paid")["subscription"]
        return answer

    def delete_invoice(self, invoice_id: str) -> dict:
        """Finance deletes an invoice (the provider's delete, a console action here; its reference says to void
        instead, but deleting is allowed). The provider's prerequisites: no payment linked to it (a successful
        or in-progress one must be removed first) and nothing adjusted. The invoice keeps its status, is
        marked `deleted`, is no longer found (a list shows it only with include_deleted) and is sent as
        `invoice_deleted` (decision 201)."""
        invoice = self.invoice(invoice_id)
        if any(p.get("txn_status") in ("success", "in_progress") for p in invoice.get("linked_payments") or []):
            raise SandboxError(400, "The invoice has payments linked to it. Remove them before deleting the invoice",
                               "invalid_state_for_request")
        if int(invoice.get("amount_adjusted") or 0) or invoice.get("adjustment_credit_notes"):
            raise SandboxError(400, "The invoice has adjustments. It cannot be deleted", "invalid_state_for_request")
        invoice["deleted"] = True
        self._save_invoice(invoice)
        self.emit("invoice_deleted", {"invoice": invoice})
        return {"invoice": invoice}

    def delete_subscription(self, subscription_id: str) -> dict:
        """Support deletes a subscription (the provider's `POST /subscriptions/{id}/delete`, a console action
        here; its reference suggests cancelling or pausing instead to keep the data). "All the invoices
        belonging to the subscription are deleted", and all its credit notes and transactions: each is marked
        `deleted` and no longer found (a list shows it only with include_deleted), and the subscription with
        them; nothing renews it. Sent as `subscription_deleted` (decision 215)."""
        sub = self.subscription(subscription_id)
        for kind in ("invoice", "credit_note", "transaction"):
            for row in self.store.all(kind):
                if row.get("subscription_id") == subscription_id and not row.get("deleted"):
                    row["deleted"] = True
                    if kind == "invoice":
                        self._save_invoice(row)
                    else:
                        self.store.put(kind, row["id"], row)
        sub["deleted"] = True
        self._save_subscription(sub)
        customer = self.customer(sub["customer_id"])
        self.emit("subscription_deleted", {"subscription": sub, "customer": customer})
        return {"subscription": sub, "customer": customer}

    def record_payment(self, invoice_id: str, amount: int, reference_number: str,
                       payment_method: str = "other") -> dict:
        """An offline payment on a payable invoice. Like the real provider it does not look at the
        reference number: a paid, void or pending invoice is refused (invalid_state_for_request); an amount
        short of the amount due is a partial payment, which leaves the invoice payable for the rest."""
        invoice = self.invoice(invoice_id)
        if invoice["status"] not in PAYABLE_INVOICE_STATUSES:
            raise SandboxError(400, f"The invoice is in {invoice['status']} state. Payments can be recorded only "
                               "for invoices with an amount due", "invalid_state_for_request")
        if int(amount) > int(invoice["amount_due"]):
            raise SandboxError(400, "transaction[amount] : cannot be more than the amount due",
                               "param_wrong_value", "transaction[amount]")
        now = self.now()
        txn = {"id": self.store.next_id("txn"), "customer_id": invoice["customer_id"],
               "subscription_id": invoice["subscription_id"], "type": "payment", "status": "success",
               "amount": int(amount), "currency_code": invoice["currency_code"], "date": now,
               "payment_method": payment_method, "gateway": "not_applicable", "reference_number": reference_number,
               "object": "transaction", "deleted": False, "base_currency_code": invoice["currency_code"],
               "linked_invoices": [{"invoice_id": invoice_id, "applied_amount": int(amount), "applied_at": now,
                                    "invoice_date": invoice["date"], "invoice_total": invoice["total"],
                                    "invoice_status": "paid"}]}
        self.store.put("transaction", txn["id"], txn)
        self.store.put("transaction_by_ref", reference_number, {"id": txn["id"]})
        # A payment short of the amount due is a partial payment: the invoice stays payable for the rest.
        due = int(invoice["amount_due"]) - int(amount)
        invoice.update(amount_paid=int(invoice.get("amount_paid") or 0) + int(amount), amount_due=due,
                       updated_at=now)
        if due == 0:
            invoice.update(status="paid", paid_at=now)
        # The real invoice links the transaction by id only: the gateway reference is on the transaction.
        invoice["linked_payments"] = [*(invoice.get("linked_payments") or []),
                                      {"txn_id": txn["id"], "applied_amount": int(amount), "applied_at": now,
                                       "txn_status": "success", "txn_date": now, "txn_amount": int(amount)}]
        self._save_invoice(invoice)
        sub = self.store.get("subscription", invoice["subscription_id"]) or {}
        self.emit("payment_succeeded", {"transaction": txn, "invoice": invoice, "subscription": sub})
        return {"invoice": invoice, "transaction": txn}

    def _excess_payments(self, customer_id: str, change: int) -> None:
        """The customer's excess payments (a payment's unused amount) move by `change`."""
        customer = self.customer(customer_id)
        customer["excess_payments"] = int(customer.get("excess_payments") or 0) + change
        self.store.put("customer", customer_id, customer)

    def write_off(self, invoice_id: str) -> dict:
        """Finance writes off an invoice the customer did not pay (the provider's write_off, a console action
        here): refused unless payable; it becomes paid with nothing paid, its amount due written off through
        an adjustment credit note (`credit_note_created`, `invoice_updated`)."""
        invoice = self.invoice(invoice_id)
        if invoice["status"] not in PAYABLE_INVOICE_STATUSES:
            raise SandboxError(400, f"The invoice is in {invoice['status']} state. Only invoices with an amount "
                               "due can be written off", "invalid_state_for_request")
        amount = int(invoice["amount_due"])
        return self._adjust(invoice, amount, "Write Off", "write_off", adjusted=False, write_off_amount=amount)

    def create_credit_note(self, reference_invoice_id: str, total: int, type_: str = "adjustment",
                           create_reason_code: str | None = None) -> dict:
        """An adjustment credit note on an invoice with an amount due (the provider's create-a-credit-note
        with `type` adjustment; finance's console action, our client never calls it): the invoice's
        amount_due falls by `total` and its amount_adjusted rises by it; an invoice adjusted to nothing
        due is paid. Only `adjustment` notes on payable invoices, for at most the amount due, are modelled."""
        if type_ != "adjustment":
            raise SandboxError(400, "the sandbox models adjustment credit notes only", "param_wrong_value", "type")
        invoice = self.invoice(reference_invoice_id)
        if invoice["status"] not in PAYABLE_INVOICE_STATUSES:
            raise SandboxError(400, f"The invoice is in {invoice['status']} state. An adjustment credit note can be "
                               "created only for an invoice with an amount due", "invalid_state_for_request")
        if not 0 < int(total) <= int(invoice["amount_due"]):
            raise SandboxError(400, "total should be more than zero and at most the invoice's amount due",
                               "param_wrong_value", "total")
        return self._adjust(invoice, int(total), create_reason_code or "Other", "other")

    def _adjust(self, invoice: dict, amount: int, reason: str, reason_code: str, adjusted: bool = True,
                **values) -> dict:
        """One adjustment credit note of `amount` on a payable invoice (`credit_note_created`,
        `invoice_updated`): nothing left due makes it paid. A write-off counts as written off, not adjusted."""
        now = self.now()
        note = {"id": self.store.next_id("cn"), "reference_invoice_id": invoice["id"], "type": "adjustment",
                "create_reason_code": reason, "total": amount, "status": "adjusted", "date": now,
                "customer_id": invoice["customer_id"], "subscription_id": invoice["subscription_id"],
                "currency_code": invoice["currency_code"], "object": "credit_note"}
        self.store.put("credit_note", note["id"], note)
        due = int(invoice["amount_due"]) - amount
        invoice.update(amount_due=due, amount_adjusted=int(invoice.get("amount_adjusted") or 0) + amount * adjusted,
                       adjustment_credit_notes=[*(invoice.get("adjustment_credit_notes") or []), {
                           "cn_id": note["id"], "cn_total": amount, "cn_status": "adjusted",
                           "cn_reason_code": reason_code, "cn_date": now}], **values)
        if due == 0:
            invoice.update(status="paid", paid_at=now)
        self._save_invoice(invoice)
        self.emit("credit_note_created", {"credit_note": note})
        self.emit("invoice_updated", {"invoice": invoice})
        return {"invoice": invoice, "credit_note": note}

    def remove_payment(self, invoice_id: str, txn_id: str) -> dict:
        """Finance removes a payment from an invoice (the provider's remove_payment, a console action here):
        no money moves. The amount goes to the customer's excess payments and the transaction's unused
        amount; the invoice owes it again. A paid invoice with no due date ahead becomes payment_due when it
        is not collected automatically, else not_paid (no dunning is modelled); its `invoice_updated` event
        carries the copy. Refused like the provider: a transaction not applied to the invoice, one not
        successful, or an invoice with refunded credit notes."""
        invoice = self.invoice(invoice_id)
        linked = [p for p in invoice.get("linked_payments") or [] if p["txn_id"] == txn_id]
        txn = self.store.get("transaction", txn_id)
        if not linked or txn is None:
            raise SandboxError(400, "transaction[id] : is not applied to this invoice", "param_wrong_value",
                               "transaction[id]")
        if txn["status"] not in ("success", "in_progress", "needs_attention"):
            raise SandboxError(400, f"A {txn['status']} transaction cannot be removed", "invalid_state_for_request")
        if any(cn.get("reference_invoice_id") == invoice_id and cn.get("status") in ("refunded", "refund_due")
               for cn in self.store.all("credit_note")):
            raise SandboxError(400, "The invoice has refunds issued", "invalid_state_for_request")
        amount, now = int(linked[0]["applied_amount"]), self.now()
        invoice["linked_payments"] = [p for p in invoice["linked_payments"] if p["txn_id"] != txn_id]
        invoice.update(amount_paid=int(invoice["amount_paid"]) - amount,
                       amount_due=int(invoice["amount_due"]) + amount, updated_at=now)
        if invoice["status"] == "paid":
            due = invoice.get("due_date")
            sub = self.store.get("subscription", invoice["subscription_id"]) or {}
            invoice["status"] = "posted" if due and due > now else \
                "payment_due" if sub.get("auto_collection", "on") == "off" else "not_paid"
            invoice.pop("paid_at", None)
        txn.update(amount_unused=int(txn.get("amount_unused") or 0) + amount,
                   linked_invoices=[i for i in txn.get("linked_invoices") or [] if i["invoice_id"] != invoice_id])
        self.store.put("transaction", txn_id, txn)
        self._excess_payments(invoice["customer_id"], amount)
        self._save_invoice(invoice)
        self.emit("invoice_updated", {"invoice": invoice})
        return {"invoice": invoice, "transaction": txn}

    def apply_payments(self, invoice_id: str, txn_id: str) -> dict:
        """Finance applies a payment's unused amount (the customer's excess payments) to a payable invoice
        (the provider's apply_payments, a console action here), up to its amount due; `invoice_updated`."""
        invoice, txn = self.invoice(invoice_id), self.transaction(txn_id)
        if invoice["status"] not in PAYABLE_INVOICE_STATUSES:
            raise SandboxError(400, f"The invoice is in {invoice['status']} state", "invalid_state_for_request")
        if int(txn.get("amount_unused") or 0) <= 0:
            raise SandboxError(400, "transactions[id][0] : has no unused amount", "param_wrong_value",
                               "transactions[id][0]")
        amount, now = min(int(txn["amount_unused"]), int(invoice["amount_due"])), self.now()
        invoice.update(amount_paid=int(invoice["amount_paid"]) + amount,
                       amount_due=int(invoice["amount_due"]) - amount)
        if invoice["amount_due"] == 0:
            invoice.update(status="paid", paid_at=now)
        invoice["linked_payments"] = [*invoice["linked_payments"],
                                      {"txn_id": txn_id, "applied_amount": amount, "applied_at": now,
                                       "txn_status": txn["status"], "txn_date": txn["date"],
                                       "txn_amount": txn["amount"]}]
        txn.update(amount_unused=int(txn["amount_unused"]) - amount,
                   linked_invoices=[*(txn.get("linked_invoices") or []),
                                    {"invoice_id": invoice_id, "applied_amount": amount, "applied_at": now,
                                     "invoice_date": invoice["date"], "invoice_total": invoice["total"],
                                     "invoice_status": invoice["status"]}])
        self.store.put("transaction", txn_id, txn)
        self._excess_payments(invoice["customer_id"], -amount)
        self._save_invoice(invoice)
        self.emit("invoice_updated", {"invoice": invoice})
        return {"invoice": invoice}

    def refund_on_provider(self, reference_number: str, amount: int) -> dict | None:
        """The orchestrator's workflow mirrors a refund: a refund transaction against the payment's. A payment
        applied to an invoice is refunded through a refundable credit note on it; one finance removed from its
        invoice (`remove_payment`) is refunded from its unused amount, lowering the customer's excess
        payments, with no credit note. Nothing while the workflow's steps are switched off (`workflow_reports`:
        a workflow edited at the orchestrator's console, or its step failing, as for its record of a payment)."""
        ref = self.store.get("transaction_by_ref", reference_number)
        if ref is None or not self.store.meta("workflow_reports", True):
            return None
        original = self.store.get("transaction", ref["id"])
        if original.get("deleted"):
            return None  # deleted with its subscription: the provider holds no payment to mirror against
        if not original.get("linked_invoices"):
            return self._refund_unused(original, amount, "other", self.now(), reference_number)
        invoice = self.invoice(original["linked_invoices"][0]["invoice_id"])
        return self._refund_note(invoice, [(original, int(amount))], "other", self.now(), reference_number)[1][-1]

    def record_refund(self, invoice_id: str, amount: int | None, payment_method: str, date: int | None,
                      reference_number: str | None = None) -> dict:
        """Finance records a refund made outside the provider (a wire, a cheque) on a paid invoice: the
        provider's `POST /invoices/{id}/record_refund`, a console action here; our client never calls it. As
        there: `transaction[payment_method]` and `transaction[date]` are required, the date neither before
        the invoice's nor in the future; the amount (all that is refundable when omitted) at most what was
        paid less what refundable credit notes already gave back. A refundable credit note with status
        `refunded` is created, and one refund transaction for each payment it is allocated to, in the order
        they were applied (`reference_transaction_id` names the payment; the payment lists it in its
        `linked_refunds`); sent as `credit_note_created` and one `payment_refunded` per refund transaction."""
        invoice = self.invoice(invoice_id)
        if not payment_method:
            raise SandboxError(400, "transaction[payment_method] : cannot be blank", "param_wrong_value",
                               "transaction[payment_method]")
        now = self.now()
        if date is None:
            raise SandboxError(400, "transaction[date] : cannot be blank", "param_wrong_value", "transaction[date]")
        if int(date) > now or int(date) < int(invoice["date"]):
            raise SandboxError(400, "transaction[date] : should be on or after the invoice date and not in the future",
                               "param_wrong_value", "transaction[date]")
        allocations = []
        for link in invoice.get("linked_payments") or []:
            txn = self.store.get("transaction", link["txn_id"])
            if txn is not None and txn["status"] == "success":
                given = sum(int(r["txn_amount"]) for r in txn.get("linked_refunds") or []
                            if r["txn_status"] == "success")
                allocations.append((txn, max(int(link["applied_amount"]) - given, 0)))
        refundable = min(sum(room for _, room in allocations), int(invoice.get("amount_paid") or 0) - sum(
            int(n["cn_total"]) for n in invoice.get("issued_credit_notes") or [] if n["cn_status"] == "refunded"))
        if refundable <= 0:
            raise SandboxError(400, "The invoice has no refundable amount", "invalid_state_for_request")
        left = refundable if amount is None else int(amount)
        if not 0 < left <= refundable:
            raise SandboxError(400, f"transaction[amount] : cannot be more than the refundable amount {refundable}",
                               "param_wrong_value", "transaction[amount]")
        shares = []
        for txn, room in allocations:
            if left and room:
                shares.append((txn, min(room, left)))
                left -= shares[-1][1]
        note, refunds = self._refund_note(invoice, shares, payment_method, int(date), reference_number)
        return {"invoice": self.invoice(invoice_id), "credit_note": note, "transaction": refunds[0]["content"][
            "transaction"]}

    def record_transaction_refund(self, txn_id: str, amount: int | None, payment_method: str | None,
                                  date: int | None, reference_number: str | None = None) -> dict:
        """Finance records a refund made outside the provider of a payment's unused amount (one removed from
        its invoice: the customer's excess payments): the provider's `POST /transactions/{id}/record_refund`,
        "applicable only for transactions of type = payment", the amount (all of `amount_unused` when
        omitted) at most `amount_unused`; `payment_method` and `date` required. A console action here; sent
        as `payment_refunded` (decision 212)."""
        txn = self.transaction(txn_id)
        if txn.get("type") != "payment":
            raise SandboxError(400, "Refund can be recorded only for transactions of type payment",
                               "invalid_state_for_request")
        for name, value in (("payment_method", payment_method), ("date", date)):
            if value in (None, ""):
                raise SandboxError(400, f"{name} : cannot be blank", "param_wrong_value", name)
        if int(date) > self.now():
            raise SandboxError(400, "date : cannot be in the future", "param_wrong_value", "date")
        unused = int(txn.get("amount_unused") or 0)
        if unused <= 0:
            raise SandboxError(400, "The transaction has no unused amount to refund", "invalid_state_for_request")
        amount = unused if amount is None else int(amount)
        if not 0 < amount <= unused:
            raise SandboxError(400, "amount : cannot be more than amount_unused", "param_wrong_value", "amount")
        return self._refund_unused(txn, amount, payment_method, int(date), reference_number)["content"]

    def _refund_unused(self, txn: dict, amount: int, method: str, date: int, reference: str | None) -> dict:
        """A refund of a payment's unused amount, lowering the customer's excess payments; no credit note."""
        given = min(int(amount), int(txn.get("amount_unused") or 0))
        txn["amount_unused"] = int(txn.get("amount_unused") or 0) - given
        self._excess_payments(txn["customer_id"], -given)
        refund = self._refund_txn(txn, amount, method, date, reference)
        return self.emit("payment_refunded", {"transaction": refund})

    def _refund_txn(self, payment: dict, amount: int, method: str, date: int, reference: str | None) -> dict:
        """One refund transaction of a payment (its `reference_transaction_id`), listed in the payment's
        `linked_refunds`."""
        refund = {"id": self.store.next_id("txn"), "customer_id": payment["customer_id"],
                  "subscription_id": payment["subscription_id"], "type": "refund", "status": "success",
                  "amount": int(amount), "currency_code": payment["currency_code"], "date": date,
                  "payment_method": method, "reference_transaction_id": payment["id"],
                  "reference_number": reference, "object": "transaction"}
        payment["linked_refunds"] = [*(payment.get("linked_refunds") or []), {
            "txn_id": refund["id"], "txn_status": "success", "txn_date": date, "txn_amount": int(amount)}]
        self.store.put("transaction", payment["id"], payment)
        self.store.put("transaction", refund["id"], refund)
        return refund

    def _refund_note(self, invoice: dict, shares: list[tuple[dict, int]], method: str, date: int,
                     reference: str | None) -> tuple[dict, list[dict]]:
        """A refundable credit note (status refunded) on a paid invoice, and a refund transaction for each
        (payment, amount); the invoice lists the note in its `issued_credit_notes`."""
        refunds = [self._refund_txn(txn, amount, method, date, reference) for txn, amount in shares]
        total = sum(amount for _, amount in shares)
        note = {"id": self.store.next_id("cn"), "reference_invoice_id": invoice["id"], "type": "refundable",
                "total": total, "amount_refunded": total, "status": "refunded", "date": date,
                "customer_id": invoice["customer_id"], "subscription_id": invoice["subscription_id"],
                "currency_code": invoice["currency_code"], "object": "credit_note",
                "linked_refunds": [{"txn_id": r["id"], "applied_amount": r["amount"], "applied_at": date,
                                    "txn_status": "success", "txn_date": date, "txn_amount": r["amount"]}
                                   for r in refunds]}
        for refund in refunds:
            refund["linked_credit_notes"] = [{"cn_id": note["id"], "applied_amount": refund["amount"]}]
            self.store.put("transaction", refund["id"], refund)
        self.store.put("credit_note", note["id"], note)
        invoice["issued_credit_notes"] = [*(invoice.get("issued_credit_notes") or []), {
            "cn_id": note["id"], "cn_reason_code": "other", "cn_date": date, "cn_total": total,
            "cn_status": "refunded"}]
        self._save_invoice(invoice)
        self.emit("credit_note_created", {"credit_note": note})
        return note, [self.emit("payment_refunded", {"transaction": refund, "credit_note": note})
                      for refund in refunds]

    # ---- orchestrator: sessions, instruments, payments ----------------------------------------
    def create_client_session(self, body: dict) -> dict:
        for name in ("orderId", "customerId", "amount", "currencyCode"):
            if body.get(name) in (None, ""):
                raise SandboxError(400, f"{name} is required", "invalid_request", name)
        session = {"clientToken": f"cs_{uuid.uuid4().hex}", "clientExpirationDate": self.now() + 86400,
                   "orderId": body["orderId"], "customerId": body["customerId"], "amount": int(body["amount"]),
                   "currencyCode": body["currencyCode"], "metadata": body.get("metadata") or {},
                   "vaultOnSuccess": bool((body.get("paymentMethod") or {}).get("vaultOnSuccess")),
                   # Kept as the client sent it (None when it sent none): the sandbox invents no field.
                   "paymentType": (body.get("paymentMethod") or {}).get("paymentType")}
        self.store.put("client_session", body["orderId"], session)
        return session

    def add_instrument(self, customer_id: str, kind: str = "PAYMENT_CARD", *, expired: bool = False,
                       deleted: bool = False, default: bool = False) -> dict:
        token = self.store.next_id("tok")
        data = ({"email": f"{customer_id}@example.test"} if kind != "PAYMENT_CARD" else
                {"last4Digits": "4242", "expirationMonth": "12", "expirationYear": "2020" if expired else "2035"})
        instrument = {"token": token, "tokenType": "MULTI_USE", "paymentMethodType": kind, "customerId": customer_id,
                      "paymentMethodData": data, "default": default, "deleted": deleted}
        if default:
            self._clear_default(customer_id)
        self.store.put("instrument", token, instrument)
        return instrument

    def _clear_default(self, customer_id: str) -> None:
        for other in self.instruments(customer_id):
            if other["default"]:
                other["default"] = False
                self.store.put("instrument", other["token"], other)

    def instruments(self, customer_id: str) -> list[dict]:
        return [i for i in self.store.all("instrument") if i["customerId"] == customer_id]

    def set_default(self, token: str) -> dict:
        instrument = self.store.get("instrument", token)
        if instrument is None or instrument["deleted"]:
            raise SandboxError(404, f"Payment instrument {token} not found", "resource_not_found")
        self._clear_default(instrument["customerId"])
        instrument["default"] = True
        return self.store.put("instrument", token, instrument)

    def _new_payment(self, *, order_id, customer_id, amount, currency, metadata, processor, status, instrument,
                     payment_type, decline_code=None) -> dict:
        mid = f"mid_{processor}_1" if processor else None
        payment = {"id": f"pay_{uuid.uuid4().hex[:12]}", "date": self.now(), "dateUpdated": self.now(),
                   "status": status, "orderId": order_id,
                   "customerId": customer_id, "amount": int(amount), "currencyCode": currency,
                   "processor": {"name": processor, "processorMerchantId": mid,
                                 "amountCaptured": int(amount) if status == "SETTLED" else 0, "amountRefunded": 0},
                   "metadata": metadata,
                   "paymentMethod": {"paymentType": payment_type,
                                     "paymentMethodToken": instrument["token"] if instrument else None,
                                     "paymentMethodType": instrument["paymentMethodType"] if instrument else None,
                                     "isVaulted": bool(instrument)}}
        if decline_code:
            payment["statusReason"] = {"declineType": "HARD_DECLINE", "code": decline_code}
        self.store.put("payment", payment["id"], payment)
        return payment

    def pay(self, order_id: str, *, processor: str | None = None, method: str = "PAYMENT_CARD",
            report_to_provider: bool = True, drop_webhook: bool = False, duplicates: int = 1,
            capture: bool = True) -> dict:
        """Settle a checkout session as the shopper completing the payment form would. The checkout's
        workflow authorizes, then captures, and Primer reports each status the payment takes ("PENDING,
        then AUTHORIZED, then SETTLED, depending on how your workflow is set up"): AUTHORIZED (nothing
        captured yet), then SETTLED. `capture=False`: the workflow's capture step failed, and the payment
        stays AUTHORIZED until someone captures or cancels it."""
        session = self.store.get("client_session", order_id)
        if session is None:
            raise SandboxError(404, f"No checkout session for order {order_id}", "resource_not_found")
        lane = (session["metadata"] or {}).get("lane", "sfw")
        processor = processor or WORKFLOW_DEFAULT.get(lane, "SFW_STRIPE")
        instrument = self.add_instrument(session["customerId"], method, default=not self.instruments(
            session["customerId"]))
        payment = self._new_payment(order_id=order_id, customer_id=session["customerId"], amount=session["amount"],
                                    currency=session["currencyCode"], metadata=dict(session["metadata"]),
                                    processor=processor, status="AUTHORIZED", instrument=instrument,
                                    payment_type=session.get("paymentType"))
        if not drop_webhook:
            self.send_webhook("PAYMENT.STATUS", copy.deepcopy(payment))
        if not capture:
            return payment
        payment.update(status="SETTLED", dateUpdated=self.now())
        payment["processor"]["amountCaptured"] = payment["amount"]
        self.store.put("payment", payment["id"], payment)
        self._after_settle(payment, report_to_provider, drop_webhook, duplicates)
        return payment

    def decline_checkout(self, order_id: str, *, code: str = "DO_NOT_HONOR", processor: str | None = None,
                         drop_webhook: bool = False) -> dict:
        """The shopper's card is declined in the payment form: one more DECLINED payment for the session
        (each try is a payment of its own, as at the real orchestrator), reported by PAYMENT.STATUS."""
        session = self.store.get("client_session", order_id)
        if session is None:
            raise SandboxError(404, f"No checkout session for order {order_id}", "resource_not_found")
        lane = (session["metadata"] or {}).get("lane", "sfw")
        payment = self._new_payment(order_id=order_id, customer_id=session["customerId"], amount=session["amount"],
                                    currency=session["currencyCode"], metadata=dict(session["metadata"]),
                                    processor=processor or WORKFLOW_DEFAULT.get(lane, "SFW_STRIPE"),
                                    status="DECLINED", instrument=None, payment_type=session.get("paymentType"),
                                    decline_code=code)
        if not drop_webhook:
            self.send_webhook("PAYMENT.STATUS", payment)
        return payment

    def charge(self, body: dict, drop_webhook: bool = False) -> dict:
        """A merchant-initiated payment (renewal) on a vaulted token, routed to metadata.psp. Its status is
        reported by PAYMENT.STATUS whatever it is, as Primer does ("when a payment's status has been updated
        ... you should expect a status of PENDING, then AUTHORIZED, then SETTLED"): a charge answered in
        flight or declined too, not only one that settles."""
        metadata = body.get("metadata") or {}
        instrument = self.store.get("instrument", body.get("paymentMethodToken") or "")
        processor = metadata.get("psp") or None
        lane = metadata.get("lane", "sfw")
        decline = None
        if instrument is None or instrument["deleted"]:
            decline = "INVALID_PAYMENT_METHOD"
        elif not processor:
            decline = "NO_PROCESSOR"
        elif lane == "nsfw" and instrument["paymentMethodType"] != "PAYMENT_CARD":
            decline = "PAYMENT_METHOD_NOT_SUPPORTED"
        elif instrument["paymentMethodType"] == "PAYMENT_CARD" and card_expired(instrument, self.now()):
            decline = "EXPIRED_CARD"
        elif self.store.get("declines", body.get("customerId") or ""):
            decline = "DO_NOT_HONOR"
        in_flight = self.store.meta("async_charges") if not decline else None
        partial = in_flight == "PARTIALLY_SETTLED"
        status = "DECLINED" if decline else ("AUTHORIZED" if partial else (in_flight or "SETTLED"))
        payment = self._new_payment(order_id=body.get("orderId"), customer_id=body.get("customerId"),
                                    amount=body.get("amount", 0), currency=body.get("currencyCode", "USD"),
                                    metadata=metadata, processor=processor, instrument=instrument,
                                    status=status, decline_code=decline,
                                    payment_type=(body.get("paymentMethod") or {}).get("paymentType"))
        if status == "SETTLED":
            self._after_settle(payment, True, drop_webhook, 1)
        elif not drop_webhook:  # Primer reports every status a payment takes, in flight or declined
            self.send_webhook("PAYMENT.STATUS", payment)
        if partial:
            return self.finish_payment(payment["id"], captured=max(1, payment["amount"] // 2),
                                       drop_webhook=drop_webhook)
        if in_flight in IN_FLIGHT and self.store.meta("settles_in_transit", False):
            # The processor settles the charge as soon as it is answered, and Primer's notification of the
            # settle (delivered "within seconds", by another connection) is handled before the caller reads
            # the answer, which still says what the payment was when it was sent.
            answered = copy.deepcopy(payment)
            self.finish_payment(payment["id"], settle=True, drop_webhook=drop_webhook)
            return answered
        return payment

    def async_charges(self, status: str | None, settles_in_transit: bool = False) -> None:
        """While set (PENDING, AUTHORIZED or SETTLING), merchant-initiated charges answer that status and
        stay in flight until `finish_payment` settles or declines them; PARTIALLY_SETTLED makes each charge
        capture half of its amount at once (a processor's partial capture). `settles_in_transit`: each is
        answered in flight but settles, and its PAYMENT.STATUS SETTLED is delivered, before the answer
        reaches the caller."""
        if status is not None and status not in (*IN_FLIGHT, "PARTIALLY_SETTLED"):
            raise SandboxError(400, f"status must be one of {', '.join(IN_FLIGHT)}, PARTIALLY_SETTLED")
        self.store.set_meta("async_charges", status)
        self.store.set_meta("settles_in_transit", bool(settles_in_transit and status in IN_FLIGHT))

    def _payment(self, payment_id: str) -> dict:
        payment = self.store.get("payment", payment_id)
        if payment is None:
            raise SandboxError(404, f"Payment {payment_id} not found", "resource_not_found")
        return payment

    def capture(self, payment_id: str, amount: int | None = None, final: bool = True) -> dict:
        """POST /payments/{id}/capture: an AUTHORIZED payment captured in full (SETTLED) or in part
        (PARTIALLY_SETTLED); no payload captures what is left. Primer's `final`: "after a final capture, no
        subsequent captures are allowed", so a payment captured in part by a capture that was not final
        may be captured again, up to its amount (SETTLED once all of it is). Anything else is refused."""
        payment = self._payment(payment_id)
        again = payment["status"] == "PARTIALLY_SETTLED" and self.store.meta(f"capture_open:{payment_id}", False)
        if payment["status"] != "AUTHORIZED" and not again:
            raise SandboxError(400, f"Payment {payment_id} is {payment['status']}: only an AUTHORIZED payment, or "
                                    "one captured in part by a capture that was not final, can be captured",
                               "invalid_state_for_request")
        before = payment["processor"].get("amountCaptured", 0) if again else 0
        left = payment["amount"] - before
        amount = left if amount is None else int(amount)
        if not 0 < amount <= left:
            raise SandboxError(400, "amount must be positive and at most what is authorized and not captured",
                               "invalid_request", "amount")
        self.store.set_meta(f"capture_open:{payment_id}", not final and before + amount < payment["amount"])
        if not again:
            return self.finish_payment(payment_id, captured=amount)
        payment["dateUpdated"] = self.now()
        payment["processor"]["amountCaptured"] = before + amount
        if before + amount < payment["amount"]:
            self.store.put("payment", payment_id, payment)
            self.send_webhook("PAYMENT.STATUS", payment)
            return payment
        payment["status"] = "SETTLED"
        self.store.put("payment", payment_id, payment)
        self._after_settle(payment, True, False, 1)
        return payment

    def cancel_payment(self, payment_id: str) -> dict:
        """POST /payments/{id}/cancel: voids a payment that has not settled (PENDING or AUTHORIZED)."""
        payment = self._payment(payment_id)
        if payment["status"] not in ("PENDING", "AUTHORIZED"):
            raise SandboxError(400, f"Payment {payment_id} is {payment['status']}: only a PENDING or AUTHORIZED "
                                    "payment can be cancelled", "invalid_state_for_request")
        payment["status"] = "CANCELLED"
        payment["dateUpdated"] = self.now()
        self.store.put("payment", payment_id, payment)
        self.send_webhook("PAYMENT.STATUS", payment)
        return payment

    def progress_payment(self, payment_id: str, status: str, drop_webhook: bool = False) -> dict:
        """An in-flight payment takes its next in-flight status (Primer: PENDING, then AUTHORIZED, then
        SETTLING), never an earlier one; the PAYMENT.STATUS webhook follows."""
        payment = self._payment(payment_id)
        if payment["status"] not in IN_FLIGHT or status not in IN_FLIGHT or \
                IN_FLIGHT.index(status) <= IN_FLIGHT.index(payment["status"]):
            raise SandboxError(400, f"Payment {payment_id} is {payment['status']}: it cannot move to {status}",
                               "invalid_state_for_request")
        payment["status"] = status
        payment["dateUpdated"] = self.now()
        self.store.put("payment", payment_id, payment)
        if not drop_webhook:
            self.send_webhook("PAYMENT.STATUS", payment)
        return payment

    def finish_payment(self, payment_id: str, settle: bool = True, drop_webhook: bool = False,
                       captured: int | None = None, failed: bool = False) -> dict:
        """An in-flight payment reaches its final status; the PAYMENT.STATUS webhook follows. `captured`
        below the amount settles it in part (PARTIALLY_SETTLED, which the workflow does not report)."""
        payment = self._payment(payment_id)
        if payment["status"] not in IN_FLIGHT:
            raise SandboxError(400, f"Payment {payment_id} is {payment['status']}, not in flight",
                               "invalid_state_for_request")
        partial = captured is not None and captured < payment["amount"]
        payment["dateUpdated"] = self.now()
        if settle and partial:
            payment["status"] = "PARTIALLY_SETTLED"
            payment["processor"]["amountCaptured"] = int(captured)
            self.store.put("payment", payment_id, payment)
            if not drop_webhook:
                self.send_webhook("PAYMENT.STATUS", payment)
            return payment
        if settle:
            payment["status"] = "SETTLED"
            payment["processor"]["amountCaptured"] = payment["amount"]
        elif failed:  # a processor error, not the issuer's decision
            payment["status"] = "FAILED"
            payment["statusReason"] = {"type": "ERROR", "code": "PROCESSOR_ERROR"}
        else:
            payment["status"] = "DECLINED"
            payment["statusReason"] = {"declineType": "SOFT_DECLINE", "code": "DO_NOT_HONOR"}
        self.store.put("payment", payment_id, payment)
        if settle:
            self._after_settle(payment, True, drop_webhook, 1)
        elif not drop_webhook:
            self.send_webhook("PAYMENT.STATUS", payment)
        return payment

    def _after_settle(self, payment: dict, report: bool, drop_webhook: bool, duplicates: int) -> None:
        # The workflow's "record payment at the provider" step; a test may switch it off (a workflow edited
        # at the orchestrator's console, or its step failing).
        report = report and self.store.meta("workflow_reports", True)
        if report and payment.get("orderId") and self.store.get("invoice", payment["orderId"]):
            try:
                self.record_payment(payment["orderId"], payment["amount"], payment["id"])
            except SandboxError:
                pass  # invoice already paid or void: the workflow's report is best effort
        if not drop_webhook:
            for _ in range(max(1, duplicates)):
                self.send_webhook("PAYMENT.STATUS", payment)

    def refund(self, payment_id: str, amount: int | None = None, reason: str | None = None) -> dict:
        payment = self.store.get("payment", payment_id)
        if payment is None:
            raise SandboxError(404, f"Payment {payment_id} not found", "resource_not_found")
        # Primer's Payments API (v2.4, "Refund a payment"): a settled payment, or what was captured of a
        # partially captured one (PARTIALLY_SETTLED); without an amount, all that was captured.
        if payment["status"] not in ("SETTLED", "PARTIALLY_SETTLED"):
            raise SandboxError(400, f"Payment {payment_id} is {payment['status']}", "invalid_state_for_request")
        captured = (payment["processor"].get("amountCaptured", 0) if payment["status"] == "PARTIALLY_SETTLED"
                    else payment["amount"])
        amount = captured if amount is None else int(amount)
        already = payment["processor"].get("amountRefunded", 0)
        if already + amount + sum(t["amount"] for t in self._refunds_pending(payment)) > captured:
            raise SandboxError(400, "Refund exceeds the captured amount", "invalid_request")
        # A refund is a REFUND transaction of the payment (Primer's `transactions`); the processor takes
        # it at once, or later (`async_refunds`): PENDING until its final state, SETTLED or FAILED, which
        # the PAYMENT.REFUND notification reports ("Payment Refund" webhook, v2.4). Only a settled refund
        # counts in amountRefunded: the money went back.
        outcome = self.store.meta("async_refunds")
        txn = {"id": f"re_{uuid.uuid4().hex[:10]}", "transactionType": "REFUND", "amount": amount,
               "currencyCode": payment["currencyCode"], "date": self.now(), "processorName":
               payment["processor"].get("name"), "processorStatus": "PENDING" if outcome else "SETTLED"}
        payment.setdefault("transactions", []).append(txn)
        payment.setdefault("refunds", []).append({"id": txn["id"], "amount": amount, "date": self.now(),
                                                  "reason": reason})
        if outcome is None:
            return self._refund_settled(payment, txn)
        self.store.put("payment", payment_id, payment)
        self.store.put("refund_due", txn["id"], {"id": txn["id"], "payment_id": payment_id, "outcome": outcome,
                                                 "due": self.now()})
        return payment

    @staticmethod
    def _refunds_pending(payment: dict) -> list[dict]:
        return [t for t in payment.get("transactions") or []
                if t.get("transactionType") == "REFUND" and t.get("processorStatus") == "PENDING"]

    def _refund_settled(self, payment: dict, txn: dict) -> dict:
        txn["processorStatus"] = "SETTLED"
        payment["processor"]["amountRefunded"] = payment["processor"].get("amountRefunded", 0) + txn["amount"]
        payment["dateUpdated"] = self.now()
        self.store.put("payment", payment["id"], payment)
        self.refund_on_provider(payment["id"], txn["amount"])
        self.send_webhook("PAYMENT.REFUND", payment)
        return payment

    def async_refunds(self, outcome: str | None) -> None:
        """While set, each refund is answered PENDING and reaches `outcome` (SETTLED, or FAILED: the
        processor refused it, the money stays with us) when the sandbox's clock next moves
        (`finish_refunds`); None: refunds settle at once."""
        if outcome is not None and outcome not in ("SETTLED", "FAILED"):
            raise SandboxError(400, "outcome must be SETTLED or FAILED")
        self.store.set_meta("async_refunds", outcome)

    def finish_refunds(self) -> list[str]:
        """Each pending refund due reaches its final state, reported by PAYMENT.REFUND: the payment's ids."""
        done = []
        for due in sorted(self.store.all("refund_due"), key=lambda r: (r["due"], r["id"])):
            if due["due"] > self.now() or self.store.take("refund_due", due["id"]) is None:
                continue
            payment = self._payment(due["payment_id"])
            txn = next(t for t in payment["transactions"] if t["id"] == due["id"])
            if due["outcome"] == "SETTLED":
                self._refund_settled(payment, txn)
            else:
                txn["processorStatus"] = "FAILED"
                payment["dateUpdated"] = self.now()
                self.store.put("payment", payment["id"], payment)
                self.send_webhook("PAYMENT.REFUND", payment)
            done.append(payment["id"])
        return done

    def payments(self, status: str | None = None, from_date: float | None = None) -> list[dict]:
        """Payments made since `from_date`, oldest first; `status` is one status or several, comma-separated
        (Primer's list takes an array of statuses as a comma-separated list)."""
        wanted = set(status.split(",")) if status else None
        rows = [p for p in self.store.all("payment") if (wanted is None or p["status"] in wanted)]
        if from_date is not None:
            rows = [p for p in rows if p["date"] >= from_date]
        return sorted(rows, key=lambda p: p["date"])

    @staticmethod
    def summary(payment: dict) -> dict:
        """What the orchestrator's payment list holds: no customerId, no paymentMethod, no refunded
        amount (read GET /payments/{id} for those)."""
        processor = payment.get("processor") or {}
        return {"id": payment["id"], "date": payment["date"],
                "dateUpdated": payment.get("dateUpdated", payment["date"]), "status": payment["status"],
                "orderId": payment.get("orderId"), "amount": payment["amount"],
                "currencyCode": payment["currencyCode"], "metadata": payment.get("metadata") or {},
                "processor": {"name": processor.get("name"),
                              "processorMerchantId": processor.get("processorMerchantId")}}

    def open_dispute(self, payment_id: str) -> dict:
        """A chargeback: DISPUTE.OPENED in the orchestrator's flat shape (no payment object, no signedAt)."""
        payment = self.store.get("payment", payment_id)
        if payment is None:
            raise SandboxError(404, f"Payment {payment_id} not found", "resource_not_found")
        body = {"eventType": "DISPUTE.OPENED", "processorId": (payment.get("processor") or {}).get("name"),
                "processorDisputeId": f"dp_{uuid.uuid4().hex[:10]}", "paymentId": payment_id,
                "transactionId": f"tr_{payment_id}", "orderId": payment.get("orderId"),
                "primerAccountId": "acc_sandbox"}
        self._keep_dispute(body, "DISPUTE", "OPEN")
        status = self._deliver_raw("/webhooks/orchestrator/disputes", json.dumps(body).encode())
        return {"dispute": body, "delivered": status}

    def dispute_status(self, payment_id: str, status: str, kind: str = "DISPUTE",
                       dispute_id: str | None = None) -> dict:
        """A DISPUTE.STATUS notification (Primer's unified dispute lifecycle: a type and a status, one
        notification per change), for a new or an existing processor dispute id."""
        payment = self._payment(payment_id)
        body = {"eventType": "DISPUTE.STATUS", "version": "2.4", "type": kind, "status": status,
                "primerAccountId": "acc_sandbox", "transactionId": f"tr_{payment_id}",
                "orderId": payment.get("orderId"), "paymentId": payment_id,
                "processor": (payment.get("processor") or {}).get("name"),
                "processorDisputeId": dispute_id or f"dp_{uuid.uuid4().hex[:10]}",
                "receivedAt": datetime.fromtimestamp(self.now(), UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "amount": payment["amount"], "currency": payment["currencyCode"]}
        self._keep_dispute(body, kind, status)
        code = self._deliver_raw("/webhooks/orchestrator/disputes", json.dumps(body).encode())
        return {"dispute": body, "delivered": code}

    def _keep_dispute(self, body: dict, kind: str, status: str) -> None:
        """The processor's side of a dispute, whether or not its notification arrives: its latest type and
        status. The sandbox's own record, kept for tests (Primer's API has no dispute resource)."""
        self.store.put("dispute", body["processorDisputeId"], {"id": body["processorDisputeId"], "paymentId":
                                                                body["paymentId"], "type": kind, "status": status})

    def charged_back(self) -> set[str]:
        """The payments whose money a chargeback returned: a dispute lost, or accepted or let expire by
        the merchant (a retrieval is an inquiry and returns nothing)."""
        return {d["paymentId"] for d in self.store.all("dispute") if d["status"] == "LOST"
                or (d["type"] != "RETRIEVAL" and d["status"] in ("ACCEPTED", "EXPIRED"))}

    # ---- webhooks to the billing service -------------------------------------------------------
    def webhook_body(self, event_type: str, payment: dict) -> bytes:
        body = {"eventType": event_type, "date": self.now(), "notificationConfig": {"id": "nc_sandbox"},
                "version": "2.4", "signedAt": str(self.now()), "payment": payment}
        return json.dumps(body).encode()

    def hold_webhooks(self, hold: bool = True) -> None:
        """While held, deliveries queue up; `release_webhooks` sends them in a chosen order."""
        self.store.set_meta("hold_webhooks", hold)

    def release_webhooks(self, order: str = "reverse") -> list[int | None]:
        held = self.store.meta("held_webhooks", [])
        self.store.set_meta("held_webhooks", [])
        self.store.set_meta("hold_webhooks", False)
        if order == "reverse":
            held.reverse()
        return [self._deliver_signed(h["event_type"], h["payment"]) for h in held]

    def send_webhook(self, event_type: str, payment: dict) -> int | None:
        if self.store.meta("hold_webhooks", False):
            with self.store.tx():
                held = self.store.meta("held_webhooks", [])
                held.append({"event_type": event_type, "payment": payment})
                self.store.set_meta("held_webhooks", held)
            return None
        return self._deliver_signed(event_type, payment)

    def _deliver_signed(self, event_type: str, payment: dict) -> int | None:
        return self._deliver_raw("/webhooks/orchestrator/payments", self.webhook_body(event_type, payment))

    def _deliver_raw(self, path: str, body: bytes, attempt: int = 0) -> int | None:
        """One delivery attempt; one that gets no 2xx answer is retried later (`redeliver_due`)."""
        if self.deliver is None:
            return None
        secret = self.disputes_secret if path.endswith("/disputes") else self.webhook_secret
        headers = {"Content-Type": "application/json", "X-Signature-Primary": sign_body(secret, body)}
        try:
            status = self.deliver(path, body, headers)
        except Exception as exc:  # no answer at all (refused, timed out): a failed attempt too
            log.warning("sandbox webhook delivery failed: %s: %s", type(exc).__name__, exc)
            status = None
        if status is None or not 200 <= status < 300:
            self._retry_later(path, body, attempt)
        return status

    def _retry_later(self, path: str, body: bytes, attempt: int) -> None:
        if attempt >= len(WEBHOOK_RETRIES):
            log.warning("sandbox webhook given up after %d attempts: %s", attempt + 1, path)
            return
        retry_id = self.store.next_id("dlv")
        due = self.now() + WEBHOOK_RETRIES[attempt]
        self.store.put("webhook_retry", retry_id, {"id": retry_id, "path": path, "body": body.decode(),
                                                   "attempt": attempt + 1, "due": due})

    def redeliver_due(self) -> list[int | None]:
        """Send again each failed delivery whose retry is due, oldest first, signed afresh (a payment
        notification's `signedAt` is the attempt's time: the receiver accepts it within 5 minutes). Time
        passes in the sandbox only when it is moved, so whoever moves it calls this (the tests' clock
        helpers, `billingctl sandbox clock`); each retry is taken by one process."""
        self.finish_refunds()
        now = self.now()
        codes = []
        for retry in sorted(self.store.all("webhook_retry"), key=lambda r: (r["due"], r["id"])):
            if retry["due"] > now or self.store.take("webhook_retry", retry["id"]) is None:
                continue
            body = json.loads(retry["body"])
            if "signedAt" in body:
                body["signedAt"] = str(int(now))
            codes.append(self._deliver_raw(retry["path"], json.dumps(body).encode(), retry["attempt"]))
        return codes
