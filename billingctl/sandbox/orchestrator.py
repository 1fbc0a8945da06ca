"""The payment orchestrator's model (shaped like Primer): client sessions, vaulted instruments, payments
through their lifecycle, refunds and disputes, and its signed webhooks to the billing service. Its lane
workflow reports each settled payment to the provider on the same sandbox (`ProviderModel.record_payment`
and `refund_on_provider`), as the deployment the spec describes does."""

from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import json
import logging
import uuid
from datetime import UTC, datetime

from billingctl.sandbox.base import SandboxBase, SandboxError

IN_FLIGHT = ("PENDING", "AUTHORIZED", "SETTLING")
# Primer retries a webhook that gets no 2xx answer ("Any response outside the 2xx range ... is treated as a
# failure and will trigger retries") "up to 5 times with increasing delays. Typical retry schedule: ~10
# seconds, ~60 seconds, ~5 minutes, ~10 minutes, ~15 minutes. After the final retry attempt, the event is
# dropped and will not be retried again" (Configure webhooks: delivery model): about 31 minutes in all.
WEBHOOK_RETRIES = (10, 60, 300, 600, 900)
# Lane workflows route a first payment: SFW to the regular processors, NSFW to the high-risk ones.
WORKFLOW_DEFAULT = {"sfw": "SFW_STRIPE", "nsfw": "NSFW_SEGPAY"}
log = logging.getLogger("billingctl.sandbox")


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


class OrchestratorModel(SandboxBase):
    """The orchestrator's side of the sandbox: what its API, its processors and its dashboard do."""

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
        refused = self.store.meta(f"capture_refused:{payment_id}", None)
        if refused and not again:  # the processor's answer to the capture: the payment ends unsettled
            return self.finish_payment(payment_id, settle=False, failed=refused == "FAILED")
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

    def refuse_capture(self, payment_id: str, status: str = "DECLINED") -> None:
        """The processor will refuse the capture of this authorized payment: the issuer declines it (an
        authorization it no longer honours) or the processor fails it. Primer answers the capture with the
        payment DECLINED or FAILED (its lifecycle's AUTHORIZED -> DECLINED / FAILED), no money moved, and
        sends its PAYMENT.STATUS."""
        if status not in ("DECLINED", "FAILED"):
            raise SandboxError(400, "status must be DECLINED or FAILED")
        self.store.set_meta(f"capture_refused:{payment_id}", status)

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
