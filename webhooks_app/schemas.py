"""Body schemas of every receiver, one per event shape we read, checked right after authentication: a
wrongly typed field is a 400 with a short message, never a 500 deeper in. Unknown fields are allowed
(senders add fields); the handlers get the body exactly as it came, once it is known to be sound. Every
length cap is the column the field is stored in (issue 37: a longer string was a 500 on PostgreSQL),
nested fields we read (the payment's metadata) are typed too, and `strict_json` refuses what standard
JSON refuses (NaN, Infinity) and NUL characters, which PostgreSQL cannot store."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator

from billingctl.domain.errors import InvalidInput

Text = Annotated[str, StringConstraints(max_length=512)]
_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"
Id = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=_ID_PATTERN)]  # String(64) columns
LongId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=_ID_PATTERN)]  # String(128)
Ref = Annotated[str, StringConstraints(max_length=64)]  # an order, customer or invoice reference: String(64)
Name = Annotated[str, StringConstraints(max_length=64)]  # a processor or decline code: String(64)
Status = Annotated[str, StringConstraints(max_length=32)]
Currency = Annotated[str, StringConstraints(max_length=3)]
EventType = Annotated[str, StringConstraints(max_length=64)]  # event_inbox.event_type String(64)
Email = Annotated[str, StringConstraints(max_length=320)]  # users.email String(320)
Amount = Annotated[int, Field(ge=0, le=10**12)]


def strict_json(raw: bytes | str):
    """JSON as RFC 8259 defines it: NaN and Infinity refused (Python's parser takes them; PostgreSQL's
    json type does not), and no NUL character in any string or key (PostgreSQL cannot store one)."""
    import json

    def refuse(constant):
        raise ValueError(f"{constant} is not a JSON number")

    body = json.loads(raw, parse_constant=refuse)
    _no_nul(body)
    return body


def _no_nul(value) -> None:
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            if "\x00" in item:
                raise ValueError("a string holds a NUL character")
        elif isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


def _time(value):
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


class Processor(_Open):
    name: Name | None = None
    processorMerchantId: Annotated[str, StringConstraints(max_length=128)] | None = None
    amountRefunded: Amount | None = None
    amountCaptured: Amount | None = None


class PaymentMethod(_Open):
    paymentType: Text | None = None
    paymentMethodToken: Text | None = None
    paymentMethodType: Text | None = None


class StatusReason(_Open):
    code: Name | None = None


class PaymentMetadata(_Open):
    """The metadata we send with a checkout or a charge and read back: each key we read is typed."""
    user_id: Id | None = None
    subscription_id: Id | None = None
    item_price_id: LongId | None = None
    lane: Annotated[str, StringConstraints(max_length=8)] | None = None
    psp: Name | None = None
    processor_merchant_id: Annotated[str, StringConstraints(max_length=128)] | None = None


class Payment(_Open):
    id: Id
    status: Status
    orderId: Ref | None = None
    customerId: Ref | None = None
    amount: Amount | None = None
    currencyCode: Currency | None = None
    date: Any = None
    metadata: PaymentMetadata | None = None
    processor: Processor | None = None
    paymentMethod: PaymentMethod | None = None
    statusReason: StatusReason | None = None

    _date = field_validator("date")(_time)


class PaymentEvent(_Open):
    eventType: EventType
    payment: Payment


class Dispute(_Open):
    eventType: EventType
    paymentId: Id
    processorDisputeId: LongId
    processorId: Text | None = None
    transactionId: Text | None = None
    orderId: Ref | None = None
    # DISPUTE.STATUS (Primer's unified lifecycle): the dispute's type and status, the processor, the amount.
    type: Text | None = None
    status: Text | None = None
    processor: Name | None = None
    amount: Amount | None = None
    currency: Currency | None = None


class WorkflowCallback(_Open):
    workflow_id: LongId
    status: Status
    payment_id: Id | None = None


class Verification(_Open):
    id: Id
    user_id: Id
    status: Text


class EmailAddress(_Open):
    email_address: Email | None = None


class IdentityData(_Open):
    id: Id | None = None
    user_id: Id | None = None
    email: Email | None = None
    email_addresses: list[EmailAddress] | None = None
    client_ip: Text | None = None
    ip_address: Text | None = None


class IdentityEvent(_Open):
    type: EventType
    data: IdentityData


class _Entity(_Open):
    id: Ref
    status: Status | None = None


class ProviderContent(_Open):
    subscription: _Entity | None = None
    invoice: _Entity | None = None
    transaction: _Open | None = None
    credit_note: _Open | None = None


class ProviderEvent(_Open):
    id: Annotated[str, StringConstraints(min_length=1, max_length=128)]  # event_inbox.event_id String(128)
    event_type: EventType
    occurred_at: Any = None
    content: ProviderContent | None = None

    _occurred = field_validator("occurred_at")(_time)


def check(model: type[BaseModel], body: dict) -> dict:
    """The body, once it matches `model`; else InvalidInput naming the first bad field."""
    try:
        model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise InvalidInput(f"invalid {where}: {first.get('msg', 'invalid value')}"[:200]) from None
    return body
