"""The sandbox's behaviour: one subscription provider and one payment orchestrator sharing one store.

Like the deployment the spec describes, the orchestrator's lane workflow reports each settled
payment to the provider (the invoice is paid with the payment id as reference and the provider
emits payment_succeeded), and signed webhooks are delivered to the billing service."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import uuid
from collections.abc import Callable

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
PROCESSORS = {
    "SFW_STRIPE": "sfw",
    "SFW_ADYEN": "sfw",
    "NSFW_NMI": "nsfw",  # the legacy NMI-type processor
    "NSFW_SEGPAY": "nsfw",
    "NSFW_CCBILL": "nsfw",
}
# Lane workflows route a first payment: SFW to the regular processors, NSFW to the high-risk ones.
WORKFLOW_DEFAULT = {"sfw": "SFW_STRIPE", "nsfw": "NSFW_SEGPAY"}
TERM_SECONDS = 30 * 86400
log = logging.getLogger("billingctl.sandbox")


class SandboxError(Exception):
    def __init__(self, status: int, message: str, api_error_code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = {"message": message, "type": "invalid_request", "api_error_code": api_error_code}
        if param:
            self.body["param"] = param


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
                 deliver: Callable[[str, bytes, dict], int] | None = None):
        self.store = store
        self.webhook_secret = webhook_secret
        self.deliver = deliver
        if not self.store.meta("seeded"):
            self.seed()

    def seed(self) -> None:
        now = int(self.store.now())
        for price in CATALOG:
            self.store.put("item_price", price["id"], {
                **price, "status": "active", "pricing_model": "flat_fee", "currency_code": "USD", "period": 1,
                "period_unit": "month", "item_type": "plan", "updated_at": now})
        self.store.set_meta("seeded", True)

    def now(self) -> int:
        return int(self.store.now())

    # ---- provider: customers, subscriptions, invoices, events ---------------------------------
    def customer(self, customer_id: str, create: bool = False) -> dict:
        found = self.store.get("customer", customer_id)
        if found is None:
            if not create:
                raise SandboxError(404, f"Customer {customer_id} not found", "resource_not_found")
            found = self.store.put("customer", customer_id, {
                "id": customer_id, "email": f"{customer_id}@example.test", "created_at": self.now()})
        return found

    def item_price(self, item_price_id: str) -> dict:
        found = self.store.get("item_price", item_price_id)
        if found is None:
            raise SandboxError(404, f"Item price {item_price_id} not found", "resource_not_found")
        return found

    def subscription(self, subscription_id: str) -> dict:
        found = self.store.get("subscription", subscription_id)
        if found is None:
            raise SandboxError(404, f"Subscription {subscription_id} not found", "resource_not_found")
        return found

    def invoice(self, invoice_id: str) -> dict:
        found = self.store.get("invoice", invoice_id)
        if found is None:
            raise SandboxError(404, f"Invoice {invoice_id} not found", "resource_not_found")
        return found

    def _save_subscription(self, sub: dict) -> dict:
        sub["updated_at"] = self.now()
        sub["resource_version"] = int(self.store.now() * 1000)
        return self.store.put("subscription", sub["id"], sub)

    def emit(self, event_type: str, content: dict, occurred_at: int | None = None) -> dict:
        event = {"id": self.store.next_id("ev"), "occurred_at": occurred_at or self.now(), "source": "api",
                 "api_version": "v2", "event_type": event_type, "webhook_status": "not_configured",
                 "content": content}
        self.store.put("event", event["id"], event)
        return event

    def create_subscription_for_items(self, customer_id: str, item_price_id: str, start_date: int | None) -> dict:
        price = self.item_price(item_price_id)
        customer = self.customer(customer_id, create=True)
        now = self.now()
        sub_id = self.store.next_id("sub")
        future = start_date is not None and start_date > now
        sub = {
            "id": sub_id, "customer_id": customer_id, "status": "future" if future else "active",
            "start_date": start_date or now, "current_term_start": None if future else now,
            "current_term_end": None if future else now + TERM_SECONDS, "created_at": now,
            "currency_code": price["currency_code"], "deleted": False, "coupons": [],
            "subscription_items": [{"item_price_id": item_price_id, "item_type": "plan", "quantity": 1,
                                    "unit_price": price["price"], "amount": price["price"]}],
        }
        self._save_subscription(sub)
        invoice = self._new_invoice(sub, price)
        self.emit("subscription_created", {"subscription": sub, "customer": customer})
        return {"subscription": sub, "customer": customer, "invoice": invoice}

    def _new_invoice(self, sub: dict, price: dict) -> dict:
        invoice = {"id": self.store.next_id("inv"), "subscription_id": sub["id"], "customer_id": sub["customer_id"],
                   "status": "payment_due", "total": price["price"], "amount_paid": 0, "amount_due": price["price"],
                   "currency_code": price["currency_code"], "paid_at": None, "date": self.now(),
                   "updated_at": self.now(),
                   "line_items": [{"entity_type": "plan_item_price", "entity_id": price["id"],
                                   "amount": price["price"]}],
                   "linked_payments": []}
        self.store.put("invoice", invoice["id"], invoice)
        self.emit("invoice_generated", {"invoice": invoice})
        return invoice

    def renew_due(self) -> list[dict]:
        """Active subscriptions whose term ended renew: a new term and a renewal invoice, payment_due."""
        invoices = []
        now = self.now()
        for sub in self.store.all("subscription"):
            if sub["status"] != "active" or not sub.get("current_term_end") or sub["current_term_end"] > now:
                continue
            price = self.item_price(sub["subscription_items"][0]["item_price_id"])
            sub["current_term_start"] = sub["current_term_end"]
            sub["current_term_end"] = sub["current_term_end"] + TERM_SECONDS
            self._save_subscription(sub)
            invoice = self._new_invoice(sub, price)
            invoice["recurring"] = True
            self.store.put("invoice", invoice["id"], invoice)
            self.emit("subscription_renewed", {"subscription": sub, "invoice": invoice})
            invoices.append(invoice)
        return invoices

    def decline_customer(self, customer_id: str, decline: bool = True) -> None:
        """Every merchant-initiated charge of this customer is declined (DO_NOT_HONOR) while set."""
        with self.store.tx() as db:
            db.execute("DELETE FROM objects WHERE kind='declines' AND id=?", (customer_id,))
        if decline:
            self.store.put("declines", customer_id, {"id": customer_id})

    def change_term_end(self, subscription_id: str, term_ends_at: int) -> dict:
        sub = self.subscription(subscription_id)
        if sub["status"] == "cancelled":
            raise SandboxError(400, "Subscription is cancelled", "invalid_state_for_request")
        was_future = sub["status"] == "future"
        sub["current_term_end"] = int(term_ends_at)
        if was_future:
            sub.update(status="active", start_date=self.now(), current_term_start=self.now(),
                       activated_at=self.now())
        self._save_subscription(sub)
        if was_future:
            self.emit("subscription_activated", {"subscription": sub})
        return {"subscription": sub, "customer": self.customer(sub["customer_id"], create=True)}

    def cancel(self, subscription_id: str) -> dict:
        sub = self.subscription(subscription_id)
        if sub["status"] == "cancelled":
            raise SandboxError(400, "Subscription is already cancelled", "invalid_state_for_request")
        sub.update(status="cancelled", cancelled_at=self.now())
        self._save_subscription(sub)
        self.emit("subscription_cancelled", {"subscription": sub})
        return {"subscription": sub, "customer": self.customer(sub["customer_id"], create=True)}

    def void_invoice(self, invoice_id: str) -> dict:
        invoice = self.invoice(invoice_id)
        if invoice["status"] == "paid":
            raise SandboxError(400, "A paid invoice cannot be voided", "invalid_state_for_request")
        invoice.update(status="void", voided_at=self.now(), updated_at=self.now())
        self.store.put("invoice", invoice_id, invoice)
        return {"invoice": invoice}

    def record_payment(self, invoice_id: str, amount: int, reference_number: str) -> dict:
        """Idempotent on the reference: a second report of the same payment changes nothing."""
        invoice = self.invoice(invoice_id)
        existing = self.store.get("transaction_by_ref", reference_number)
        if existing is not None:
            return {"invoice": invoice, "transaction": self.store.get("transaction", existing["id"])}
        if invoice["status"] == "paid":
            raise SandboxError(400, "Invoice is already paid", "invalid_state_for_request")
        if invoice["status"] == "void":
            raise SandboxError(400, "Invoice is void", "invalid_state_for_request")
        now = self.now()
        txn = {"id": self.store.next_id("txn"), "customer_id": invoice["customer_id"],
               "subscription_id": invoice["subscription_id"], "type": "payment", "status": "success",
               "amount": int(amount), "currency_code": invoice["currency_code"], "date": now,
               "payment_method": "other", "gateway": "not_applicable", "id_at_gateway": reference_number,
               "reference_number": reference_number,
               "linked_invoices": [{"invoice_id": invoice_id, "applied_amount": int(amount)}]}
        self.store.put("transaction", txn["id"], txn)
        self.store.put("transaction_by_ref", reference_number, {"id": txn["id"]})
        invoice.update(status="paid", amount_paid=int(amount), amount_due=0, paid_at=now, updated_at=now)
        invoice["linked_payments"] = [{"txn_id": txn["id"], "applied_amount": int(amount),
                                       "id_at_gateway": reference_number}]
        self.store.put("invoice", invoice_id, invoice)
        sub = self.store.get("subscription", invoice["subscription_id"]) or {}
        self.emit("payment_succeeded", {"transaction": txn, "invoice": invoice, "subscription": sub})
        return {"invoice": invoice, "transaction": txn}

    def refund_on_provider(self, reference_number: str, amount: int) -> dict | None:
        ref = self.store.get("transaction_by_ref", reference_number)
        if ref is None:
            return None
        original = self.store.get("transaction", ref["id"])
        invoice_id = original["linked_invoices"][0]["invoice_id"]
        credit_note = {"id": self.store.next_id("cn"), "reference_invoice_id": invoice_id, "type": "refundable",
                       "total": amount, "status": "refunded"}
        refund = {"id": self.store.next_id("txn"), "customer_id": original["customer_id"],
                  "subscription_id": original["subscription_id"], "type": "refund", "status": "success",
                  "amount": amount, "currency_code": original["currency_code"], "date": self.now(),
                  "reference_transaction_id": original["id"], "id_at_gateway": f"ref_{reference_number}",
                  "reference_number": reference_number,
                  "linked_credit_notes": [{"cn_id": credit_note["id"], "applied_amount": amount}]}
        self.store.put("transaction", refund["id"], refund)
        self.store.put("credit_note", credit_note["id"], credit_note)
        self.emit("credit_note_created", {"credit_note": credit_note})
        return self.emit("payment_refunded", {"transaction": refund, "credit_note": credit_note})

    # ---- orchestrator: sessions, instruments, payments ----------------------------------------
    def create_client_session(self, body: dict) -> dict:
        for name in ("orderId", "customerId", "amount", "currencyCode"):
            if body.get(name) in (None, ""):
                raise SandboxError(400, f"{name} is required", "invalid_request", name)
        session = {"clientToken": f"cs_{uuid.uuid4().hex}", "clientExpirationDate": self.now() + 86400,
                   "orderId": body["orderId"], "customerId": body["customerId"], "amount": int(body["amount"]),
                   "currencyCode": body["currencyCode"], "metadata": body.get("metadata") or {},
                   "vaultOnSuccess": bool((body.get("paymentMethod") or {}).get("vaultOnSuccess"))}
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
        payment = {"id": f"pay_{uuid.uuid4().hex[:12]}", "date": self.now(), "status": status, "orderId": order_id,
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
            report_to_provider: bool = True, drop_webhook: bool = False, duplicates: int = 1) -> dict:
        """Settle a checkout session as the shopper completing the payment form would."""
        session = self.store.get("client_session", order_id)
        if session is None:
            raise SandboxError(404, f"No checkout session for order {order_id}", "resource_not_found")
        lane = (session["metadata"] or {}).get("lane", "sfw")
        processor = processor or WORKFLOW_DEFAULT.get(lane, "SFW_STRIPE")
        instrument = self.add_instrument(session["customerId"], method, default=not self.instruments(
            session["customerId"]))
        payment = self._new_payment(order_id=order_id, customer_id=session["customerId"], amount=session["amount"],
                                    currency=session["currencyCode"], metadata=dict(session["metadata"]),
                                    processor=processor, status="SETTLED", instrument=instrument,
                                    payment_type="FIRST_PAYMENT")
        self._after_settle(payment, report_to_provider, drop_webhook, duplicates)
        return payment

    def charge(self, body: dict) -> dict:
        """A merchant-initiated payment (renewal) on a vaulted token, routed to metadata.psp."""
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
        payment = self._new_payment(order_id=body.get("orderId"), customer_id=body.get("customerId"),
                                    amount=body.get("amount", 0), currency=body.get("currencyCode", "USD"),
                                    metadata=metadata, processor=processor, instrument=instrument,
                                    status="DECLINED" if decline else "SETTLED", payment_type="SUBSCRIPTION",
                                    decline_code=decline)
        if not decline:
            self._after_settle(payment, True, False, 1)
        return payment

    def _after_settle(self, payment: dict, report: bool, drop_webhook: bool, duplicates: int) -> None:
        if report and payment.get("orderId") and self.store.get("invoice", payment["orderId"]):
            try:
                self.record_payment(payment["orderId"], payment["amount"], payment["id"])
            except SandboxError:
                pass  # invoice already paid or void: the workflow's report is best effort
        if not drop_webhook:
            for _ in range(max(1, duplicates)):
                self.send_webhook("PAYMENT.STATUS", payment)

    def refund(self, payment_id: str, amount: int | None = None) -> dict:
        payment = self.store.get("payment", payment_id)
        if payment is None:
            raise SandboxError(404, f"Payment {payment_id} not found", "resource_not_found")
        if payment["status"] != "SETTLED":
            raise SandboxError(400, f"Payment {payment_id} is {payment['status']}", "invalid_state_for_request")
        amount = payment["amount"] if amount is None else int(amount)
        already = payment["processor"].get("amountRefunded", 0)
        if already + amount > payment["amount"]:
            raise SandboxError(400, "Refund exceeds the captured amount", "invalid_request")
        payment["processor"]["amountRefunded"] = already + amount
        refunds = payment.setdefault("refunds", [])
        refunds.append({"id": f"re_{uuid.uuid4().hex[:10]}", "amount": amount, "date": self.now()})
        self.store.put("payment", payment_id, payment)
        self.refund_on_provider(payment_id, amount)
        self.send_webhook("PAYMENT.REFUND", payment)
        return payment

    def payments(self, status: str | None = None, from_date: float | None = None) -> list[dict]:
        rows = [p for p in self.store.all("payment") if (status is None or p["status"] == status)]
        if from_date is not None:
            rows = [p for p in rows if p["date"] >= from_date]
        return sorted(rows, key=lambda p: p["date"])

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
        if self.deliver is None:
            return None
        body = self.webhook_body(event_type, payment)
        headers = {"Content-Type": "application/json",
                   "X-Signature-Primary": sign_body(self.webhook_secret, body)}
        path = "/webhooks/orchestrator/disputes" if event_type.startswith("DISPUTE") else \
            "/webhooks/orchestrator/payments"
        try:
            return self.deliver(path, body, headers)
        except Exception as exc:  # a dropped delivery: the pollers are the fallback
            log.warning("sandbox webhook delivery failed: %s: %s", type(exc).__name__, exc)
            return None
