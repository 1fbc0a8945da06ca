"""Body schemas of every receiver, one per event shape we read, checked right after authentication: a
wrongly typed field is a 400 with a short message, never a 500 deeper in. Unknown fields are allowed
(senders add fields); the handlers get the body exactly as it came, once it is known to be sound."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator

from billingctl.domain.errors import InvalidInput

Text = Annotated[str, StringConstraints(max_length=512)]
Id = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")]
Amount = Annotated[int, Field(ge=0, le=10**12)]


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
    name: Text | None = None
    processorMerchantId: Text | None = None
    amountRefunded: Amount | None = None
    amountCaptured: Amount | None = None


class PaymentMethod(_Open):
    paymentType: Text | None = None
    paymentMethodToken: Text | None = None
    paymentMethodType: Text | None = None


class StatusReason(_Open):
    code: Text | None = None


class Payment(_Open):
    id: Id
    status: Text
    orderId: Text | None = None
    customerId: Text | None = None
    amount: Amount | None = None
    currencyCode: Text | None = None
    date: Any = None
    metadata: dict[str, Any] | None = None
    processor: Processor | None = None
    paymentMethod: PaymentMethod | None = None
    statusReason: StatusReason | None = None

    _date = field_validator("date")(_time)


class PaymentEvent(_Open):
    eventType: Text
    payment: Payment


class Dispute(_Open):
    eventType: Text
    paymentId: Id
    processorDisputeId: Id
    processorId: Text | None = None
    transactionId: Text | None = None
    orderId: Text | None = None
    # DISPUTE.STATUS (Primer's unified lifecycle): the dispute's type and status, the processor, the amount.
    type: Text | None = None
    status: Text | None = None
    processor: Text | None = None
    amount: Amount | None = None
    currency: Annotated[str, StringConstraints(max_length=3)] | None = None


class WorkflowCallback(_Open):
    workflow_id: Id
    status: Text
    payment_id: Id | None = None


class Verification(_Open):
    id: Id
    user_id: Id
    status: Text


class IdentityData(_Open):
    id: Id | None = None
    user_id: Id | None = None
    email: Text | None = None
    email_addresses: list[dict[str, Any]] | None = None
    client_ip: Text | None = None
    ip_address: Text | None = None


class IdentityEvent(_Open):
    type: Text
    data: IdentityData


class _Entity(_Open):
    id: Text


class ProviderContent(_Open):
    subscription: _Entity | None = None
    invoice: _Entity | None = None
    transaction: _Open | None = None
    credit_note: _Open | None = None


class ProviderEvent(_Open):
    id: Text
    event_type: Text
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
