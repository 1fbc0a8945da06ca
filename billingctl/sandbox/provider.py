"""The subscription provider's model (shaped like Chargebee): customers, subscriptions, invoices, their
payments and refunds as the provider records them, and the events it lists."""

from __future__ import annotations

from billingctl.sandbox.base import SandboxBase, SandboxError

TERM_CHANGE_STATUSES = ("in_trial", "active", "non_renewing")
PAYABLE_INVOICE_STATUSES = ("payment_due", "not_paid", "posted")
# How far behind the provider's clock a start date may be and still mean "now" (the sandbox's model: a
# request's reading of now is seconds old when it arrives); further back is backdating (decision 115).
PAST_START_TOLERANCE = 60
# Orchestrator payment statuses that are not final: the charge is in flight.
TERM_SECONDS = 30 * 86400


def _on_off(value: str | None, default: str) -> str:
    if value in (None, ""):
        return default
    if value not in ("on", "off"):
        raise SandboxError(400, "auto_collection : invalid value", "param_wrong_value", "auto_collection")
    return value


class ProviderModel(SandboxBase):
    """The provider's side of the sandbox: what its API and its console (finance, support) do."""

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

    def _live(self, kind: str, key: str, not_found: str) -> dict:
        """A stored object, unless deleted: the provider finds no deleted one (it lists them only with
        include_deleted)."""
        found = self.store.get(kind, key)
        if found is None or found.get("deleted"):
            raise SandboxError(404, not_found, "resource_not_found")
        return found

    def subscription(self, subscription_id: str) -> dict:
        return self._live("subscription", subscription_id, f"Subscription {subscription_id} not found")

    def invoice(self, invoice_id: str) -> dict:
        return self._past_due(self._live("invoice", invoice_id, f"Invoice {invoice_id} not found"))

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
        return self._live("transaction", txn_id, f"Sorry, we couldn't find that resource: {txn_id}")

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

