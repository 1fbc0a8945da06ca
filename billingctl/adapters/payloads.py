"""Typed copies of what the vendors send (issues 34 and 35): parsed once, where the JSON enters (the
orchestrator adapter's answers, the webhook receivers, the inbox's stored events), so services read
attributes that are known to be there and of their type, never vendor dicts.

Field names are ours (snake_case); each is read from the vendor's spelling (Primer's camelCase). Unknown
fields are kept (vendors add fields) and given back by `wire()`. Every length cap is the column the
field is stored in (issue 37)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, ClassVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator

from billingctl.domain.errors import InvalidInput

_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"
Text = Annotated[str, StringConstraints(max_length=512)]
Id = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=_ID_PATTERN)]  # String(64) columns
LongId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=_ID_PATTERN)]  # String(128)
Ref = Annotated[str, StringConstraints(max_length=64)]  # an order, customer or invoice reference: String(64)
Name = Annotated[str, StringConstraints(max_length=64)]  # a processor or decline code: String(64)
MerchantId = Annotated[str, StringConstraints(max_length=128)]
Status = Annotated[str, StringConstraints(max_length=32)]
Currency = Annotated[str, StringConstraints(max_length=3)]
EventType = Annotated[str, StringConstraints(max_length=64)]  # event_inbox.event_type String(64)
Email = Annotated[str, StringConstraints(max_length=320)]  # users.email String(320)
Amount = Annotated[int, Field(ge=0, le=10**12)]


class PayloadInvalid(InvalidInput):
    """A vendor payload that does not have the shape its reference documents (`where` names the field): a
    client's (a webhook, a stored event, an operator's) is invalid input; the adapters turn a vendor's
    answer into ExternalPayloadInvalid."""

    def __init__(self, where: str, message: str, noun: str = ""):
        name = f"{noun} {where}".strip()
        text = f"{name} is missing" if message == "Field required" else f"invalid {name}: {message}"
        super().__init__((text if where else f"{name} is not an object")[:200])
        self.where = where


class Open(BaseModel):
    """A vendor object: unknown fields kept, fields readable by our name or the vendor's."""
    # Each model's validator is built on its first use, not on import: a job that reads no vendor object
    # (an idle poll) never builds one (issue 39 item 5); the web apps build them all at start (`build_all`).
    model_config = ConfigDict(extra="allow", populate_by_name=True, defer_build=True)
    noun: ClassVar[str] = ""  # what a message calls the object ("payment id is missing")

    @classmethod
    def read(cls, data):
        """The typed copy of `data` (already typed: itself); PayloadInvalid naming the first bad field."""
        if isinstance(data, cls):
            return data
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            if not where:
                raise PayloadInvalid("", "", cls.noun or "body") from None
            raise PayloadInvalid(where, first.get("msg", "invalid value"), cls.noun) from None

    def wire(self) -> dict:
        """The object as the vendor sent it (its spelling, its extra fields, nothing we defaulted)."""
        return self.model_dump(by_alias=True, exclude_unset=True, mode="json")


def unix_or_iso(value):
    """A unix time (number or digits) or an ISO 8601 string, as the orchestrator and provider send."""
    if value is None:
        return value
    from billingctl.domain.clock import parse_time

    if isinstance(value, int | float | str) and not isinstance(value, bool):
        try:
            parse_time(value)
            return value
        except (ValueError, OverflowError, OSError):
            pass
    raise ValueError("must be a unix time or an ISO 8601 time")


def _empty_when_null(value):
    return {} if value is None else value


# ---- the orchestrator (Primer) ---------------------------------------------------------------------

class Processor(Open):
    name: Name | None = None
    # Primer spells it processorMerchantId; some answers carry processor_merchant_id.
    merchant_id: MerchantId | None = Field(
        None, validation_alias=AliasChoices("processorMerchantId", "processor_merchant_id", "merchant_id"),
        serialization_alias="processorMerchantId")
    amount_refunded: Amount | None = Field(None, alias="amountRefunded")
    amount_captured: Amount | None = Field(None, alias="amountCaptured")


class PaymentMethod(Open):
    payment_type: Text | None = Field(None, alias="paymentType")
    token: Text | None = Field(None, alias="paymentMethodToken")
    method_type: Text | None = Field(None, alias="paymentMethodType")


class StatusReason(Open):
    code: Name | None = None


class PaymentMetadata(Open):
    """The metadata we send with a checkout or a charge and read back: each key we read is typed."""
    user_id: Id | None = None
    subscription_id: Id | None = None
    item_price_id: LongId | None = None
    lane: Annotated[str, StringConstraints(max_length=8)] | None = None
    psp: Name | None = None
    processor_merchant_id: MerchantId | None = None
    merchant_initiated: bool | None = None


class PaymentTransaction(Open):
    """One of a payment's processor transactions (Primer's `transactions`: the SALE, each REFUND), with the
    processor's status of it (a refund: PENDING, then SETTLED or FAILED)."""
    transaction_type: Name | None = Field(None, validation_alias=AliasChoices("transactionType", "type"),
                                          serialization_alias="transactionType")
    processor_status: Status | None = Field(None, alias="processorStatus")
    amount: Amount | None = None
    date: Any = None

    _date = field_validator("date")(unix_or_iso)


class Payment(Open):
    """Primer's payment, as its API answers and its PAYMENT.* notifications carry it (a list answer holds
    summaries: no customer or payment method; `is_summary`)."""
    noun: ClassVar[str] = "payment"
    id: Id
    status: Status
    order_id: Ref | None = Field(None, alias="orderId")
    customer_id: Ref | None = Field(None, alias="customerId")
    amount: Amount | None = None
    currency_code: Currency | None = Field(None, alias="currencyCode")
    date: Any = None
    metadata: PaymentMetadata = Field(default_factory=PaymentMetadata)
    processor: Processor = Field(default_factory=Processor)
    payment_method: PaymentMethod = Field(default_factory=PaymentMethod, alias="paymentMethod")
    status_reason: StatusReason = Field(default_factory=StatusReason, alias="statusReason")
    transactions: list[PaymentTransaction] = Field(default_factory=list, max_length=1000)

    _date = field_validator("date")(unix_or_iso)
    _nested = field_validator("metadata", "processor", "payment_method", "status_reason", mode="before")(
        _empty_when_null)
    _listed = field_validator("transactions", mode="before")(lambda v: [] if v is None else v)

    @property
    def is_summary(self) -> bool:
        return "customer_id" not in self.model_fields_set or "payment_method" not in self.model_fields_set

    @property
    def user_id(self) -> str | None:
        return self.customer_id or self.metadata.user_id

    @property
    def invoice_id(self) -> str | None:
        """The invoice its order names: a renewal charge's order id is its renewal invoice; a checkout's is
        its subscription id (the first invoice exists only once activation starts the subscription)."""
        order_id = self.order_id or None
        return None if order_id == (self.metadata.subscription_id or None) else order_id

    @property
    def is_renewal(self) -> bool:
        """A merchant-initiated renewal charge: flagged SUBSCRIPTION, or ordered as an invoice (a checkout's
        order is its subscription). It pays its invoice's period; it is never an orphan to re-subscribe."""
        if self.payment_method.payment_type == "SUBSCRIPTION" or self.metadata.merchant_initiated:
            return True
        return bool(self.invoice_id and self.metadata.subscription_id)

    @property
    def charged(self) -> int:
        return int(self.amount or 0)

    @property
    def refunded(self) -> int:
        return int(self.processor.amount_refunded or 0)

    @property
    def captured_in_part(self) -> bool:
        """Captured, but not all of it: PARTIALLY_SETTLED, or settled with less captured than its amount."""
        captured = self.processor.amount_captured
        return self.status == "PARTIALLY_SETTLED" or (
            self.status == "SETTLED" and captured is not None and int(captured) < self.charged)

    @property
    def taken(self) -> int:
        """The money the payment took: of one captured in part, what was captured (the rest never was, and
        no refund can return it), else its amount (decision 236)."""
        return int(self.processor.amount_captured or 0) if self.captured_in_part else self.charged

    @property
    def fully_refunded(self) -> bool:
        return self.refunded >= self.taken > 0

    def _refunds(self, status: str) -> list[PaymentTransaction]:
        return [t for t in self.transactions if t.transaction_type == "REFUND" and t.processor_status == status]

    @property
    def refund_pending(self) -> int:
        """What refunds the processor has not yet settled or refused ask for (amountRefunded counts only
        settled ones)."""
        return sum(int(t.amount or 0) for t in self._refunds("PENDING"))

    @property
    def refund_pending_since(self) -> datetime | None:
        """When the oldest refund the processor has not decided yet was asked for (None: none pending)."""
        from billingctl.domain.clock import parse_time

        asked = [parse_time(t.date) for t in self._refunds("PENDING") if t.date is not None]
        return min(asked) if asked else None

    @property
    def refunding_in_full(self) -> bool:
        """Refunded in full, or the rest asked for and not yet settled or refused by the processor."""
        return self.refund_asked >= self.taken > 0

    @property
    def refund_asked(self) -> int:
        """What of it is refunded or being refunded: refunds made, and those not yet settled or refused."""
        return self.refunded + self.refund_pending

    @property
    def refunds_made(self) -> int:
        """The refunds asked for of this payment, whatever the processor made of them."""
        return sum(1 for t in self.transactions if t.transaction_type == "REFUND")

    @property
    def refunds_failed(self) -> int:
        return len(self._refunds("FAILED"))

    @property
    def made_at(self) -> datetime | None:
        """When the payment was made: Primer's `date` is its creation, not when it settled."""
        from billingctl.domain.clock import parse_time

        return parse_time(self.date)

    @property
    def settled_at(self) -> datetime | None:
        """The time our records keep as a recorded payment's `settled_at`: the payment's `date` (`made_at`), the
        only time Primer's payment carries."""
        return self.made_at

    def but(self, **changes) -> Payment:
        """A copy with some of our fields changed (a validated copy, not a mutation)."""
        return Payment.read(self.wire() | {Payment.model_fields[k].alias or k: v for k, v in changes.items()})


class Dispute(Open):
    """A DISPUTE.* notification (flat: Primer's unified dispute lifecycle, DISPUTE.STATUS, adds the dispute's
    type and status, the processor, the amount)."""
    noun: ClassVar[str] = "dispute"
    event_type: EventType | None = Field(None, alias="eventType")  # the inbox row names it too
    payment_id: Id = Field(alias="paymentId")
    dispute_id: LongId = Field(alias="processorDisputeId")
    processor_id: Text | None = Field(None, alias="processorId")
    transaction_id: Text | None = Field(None, alias="transactionId")
    order_id: Ref | None = Field(None, alias="orderId")
    type: Text | None = None
    status: Text | None = None
    processor: Name | None = None
    amount: Amount | None = None
    currency: Currency | None = None


class ClientSession(Open):
    """The client session a checkout hands to the browser (Primer's POST /client-session answer)."""
    noun: ClassVar[str] = "client session"
    client_token: Text = Field(alias="clientToken")
    order_id: Ref | None = Field(None, alias="orderId")
    client_expiration_date: Any = Field(None, alias="clientExpirationDate")

    _expires = field_validator("client_expiration_date")(unix_or_iso)

    @property
    def expires_at(self) -> datetime | None:
        from billingctl.domain.clock import parse_time

        return parse_time(self.client_expiration_date)


class PaymentMethodData(Open):
    expiration_month: int | None = Field(None, alias="expirationMonth")
    expiration_year: int | None = Field(None, alias="expirationYear")

    _digits = field_validator("expiration_month", "expiration_year", mode="before")(
        lambda value: None if value in ("", None) else value)


class PaymentInstrument(Open):
    """A vaulted payment instrument (Primer's GET /payment-instruments entries)."""
    noun: ClassVar[str] = "payment instrument"
    token: Text
    payment_method_type: Text | None = Field(None, alias="paymentMethodType")
    data: PaymentMethodData = Field(default_factory=PaymentMethodData, alias="paymentMethodData")
    default: bool = False
    deleted: bool = False

    _nested = field_validator("data", mode="before")(_empty_when_null)


# ---- the subscription provider (Chargebee API v2: its field names are already ours) ------------------

UnixTime = Annotated[int, Field(ge=0, le=2**40)]  # the provider's dates: unix seconds


class Coupon(Open):
    coupon_id: Text | None = None


class SubscriptionItem(Open):
    item_price_id: LongId | None = None
    item_type: Text | None = None


class Subscription(Open):
    """The provider's subscription (its status is judged by domain.lifecycle.SUBSCRIPTION, not here: an
    undocumented status is reported there, never a parse error)."""
    noun: ClassVar[str] = "subscription"
    id: Ref
    customer_id: Ref | None = None
    status: Status | None = None
    start_date: UnixTime | None = None
    current_term_start: UnixTime | None = None
    current_term_end: UnixTime | None = None
    created_at: UnixTime | None = None
    updated_at: UnixTime | None = None
    cancelled_at: UnixTime | None = None
    resource_version: int | None = None
    subscription_items: list[SubscriptionItem] = Field(default_factory=list)
    coupons: list[Coupon] = Field(default_factory=list)

    _lists = field_validator("subscription_items", "coupons", mode="before")(lambda v: [] if v is None else v)

    @property
    def item_price_id(self) -> str | None:
        return self.subscription_items[0].item_price_id if self.subscription_items else None

    @property
    def coupon_ids(self) -> list[str]:
        return [c.coupon_id for c in self.coupons if c.coupon_id]


class LineItem(Open):
    entity_id: LongId | None = None
    entity_type: Text | None = None
    date_from: UnixTime | None = None  # the term the line bills
    date_to: UnixTime | None = None


class LinkedPayment(Open):
    txn_id: Ref | None = None
    applied_amount: int | None = None


class IssuedCreditNote(Open):
    """A refundable credit note on an invoice: `refunded` when money went back (decision 212)."""
    cn_id: Ref | None = None
    cn_total: int | None = None
    cn_status: Text | None = None
    cn_date: UnixTime | None = None


class Invoice(Open):
    """The provider's invoice (status judged by domain.lifecycle.INVOICE)."""
    noun: ClassVar[str] = "invoice"
    id: Ref
    status: Status | None = None
    subscription_id: Ref | None = None
    customer_id: Ref | None = None
    total: int | None = None
    amount_due: int | None = None
    amount_paid: int | None = None
    write_off_amount: int | None = None
    amount_adjusted: int | None = None  # adjustment credit notes on it: a person credited part of it
    currency_code: Currency | None = None
    date: UnixTime | None = None
    paid_at: UnixTime | None = None
    updated_at: UnixTime | None = None
    resource_version: int | None = None
    deleted: bool | None = None  # finance deleted it at the provider (`invoice_deleted`): owed by nobody
    line_items: list[LineItem] = Field(default_factory=list)
    linked_payments: list[LinkedPayment] = Field(default_factory=list)
    issued_credit_notes: list[IssuedCreditNote] = Field(default_factory=list)

    _lists = field_validator("line_items", "linked_payments", "issued_credit_notes", mode="before")(
        lambda v: [] if v is None else v)

    @property
    def item_price_id(self) -> str | None:
        return self.line_items[0].entity_id if self.line_items else None

    @property
    def term(self) -> tuple | None:
        """(date_from, date_to) of the term its plan line bills; None when the copy does not say."""
        line = self.line_items[0] if self.line_items else None
        return (line.date_from, line.date_to) if line is not None and line.date_from and line.date_to else None


class LinkedInvoice(Open):
    invoice_id: Ref | None = None
    applied_amount: int | None = None


class LinkedRefund(Open):
    txn_id: Ref | None = None
    txn_status: Text | None = None
    txn_amount: int | None = None


class Transaction(Open):
    """A provider transaction. Its reference number is free text a person may have typed (a cheque
    number): it is never taken as an id of ours unless it looks like one (`payment_reference`)."""
    noun: ClassVar[str] = "transaction"
    id: Ref
    type: Text | None = None
    status: Text | None = None
    amount: int | None = None
    currency_code: Currency | None = None
    date: UnixTime | None = None
    customer_id: Ref | None = None
    subscription_id: Ref | None = None
    reference_number: str | None = None
    id_at_gateway: str | None = None
    payment_method: Text | None = None
    linked_invoices: list[LinkedInvoice] = Field(default_factory=list)
    # A refund's payment (`reference_transaction_id`); a payment's refunds recorded at the provider.
    reference_transaction_id: Ref | None = None
    linked_refunds: list[LinkedRefund] = Field(default_factory=list)

    _lists = field_validator("linked_invoices", "linked_refunds", mode="before")(lambda v: [] if v is None else v)

    @property
    def refunded(self) -> int:
        """What the provider holds as given back of this payment: its successful refunds."""
        return sum(int(r.txn_amount or 0) for r in self.linked_refunds if r.txn_status == "success")

    def payment_reference(self) -> str | None:
        """The payment id of this transaction: its reference (the orchestrator payment id we record it
        with), or, for free text a person typed at the provider (a cheque number with accents or spaces: no
        orchestrator payment has such an id), the provider's own transaction id. The text never becomes an
        identifier of ours: it poisoned every later call that named it (issue 37). None when neither is an
        id."""
        from billingctl.domain.plans import looks_like_id

        reference = self.reference_number or self.id_at_gateway
        if looks_like_id(reference):
            return reference
        return self.id if reference and looks_like_id(self.id) else None


class CreditNote(Open):
    id: Ref | None = None
    type: Text | None = None
    reference_invoice_id: Ref | None = None
    total: int | None = None


class EventContent(Open):
    subscription: Subscription | None = None
    invoice: Invoice | None = None
    transaction: Transaction | None = None
    credit_note: CreditNote | None = None


class EventEnvelope(Open):
    """What the inbox needs of a provider event to hold it (its id, type and time); its content is read in
    full when it is processed (`Event`), so an event whose content cannot be read is held, retried and
    parked with an alert like any other failure, never dropped from the poller's list."""
    noun: ClassVar[str] = "event"
    id: Annotated[str, StringConstraints(min_length=1, max_length=128)]  # event_inbox.event_id String(128)
    event_type: EventType
    occurred_at: Any = None
    content: dict | None = None

    _occurred = field_validator("occurred_at")(unix_or_iso)


class Event(EventEnvelope):
    """A provider event, content included (its webhook body, or an event the inbox holds)."""
    content: EventContent = Field(default_factory=EventContent)

    _nested = field_validator("content", mode="before")(_empty_when_null)


class SubscriptionAnswer(Open):
    """The provider's answer to a call on a subscription: the subscription, and what the call made with it
    (the customer, the invoice a start generated)."""
    subscription: Subscription
    invoice: Invoice | None = None


class InvoiceAnswer(Open):
    """The provider's answer to a call on an invoice (a payment recorded, a void): the invoice as it now is."""
    invoice: Invoice
    transaction: Transaction | None = None


def build_all() -> None:
    """Build every model's validator now, not on its first use: the web apps call it at start, so no request
    pays for it."""
    pending = [Open]
    while pending:
        model = pending.pop()
        pending.extend(model.__subclasses__())
        if not model.__pydantic_complete__:
            model.model_rebuild()
