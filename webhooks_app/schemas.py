"""Body schemas of every receiver, one per event shape we read, checked right after authentication: a
wrongly typed field is a 400 with a short message, never a 500 deeper in. Unknown fields are allowed
(senders add fields); the handlers get the body exactly as it came, once it is known to be sound. Every
length cap is the column the field is stored in (issue 37: a longer string was a 500 on PostgreSQL),
nested fields we read (the payment's metadata) are typed too, and `strict_json` refuses what standard
JSON refuses (NaN, Infinity) and NUL characters, which PostgreSQL cannot store."""

from __future__ import annotations

import json

from pydantic import Field

from billingctl.adapters.payloads import (
    Dispute,
    Email,
    Event,
    EventType,
    Id,
    LongId,
    Open,
    Payment,
    Status,
    Text,
)


def _refuse(constant):
    raise ValueError(f"{constant} is not a JSON number")


_DECODER = json.JSONDecoder(parse_constant=_refuse)  # built once: json.loads(…, parse_constant=…) builds one a call


def strict_json(raw: bytes | str):
    """JSON as RFC 8259 defines it: NaN and Infinity refused (Python's parser takes them; PostgreSQL's
    json type does not), and no NUL character in any string or key (PostgreSQL cannot store one)."""
    text = raw.decode(json.detect_encoding(raw), "surrogatepass") if isinstance(raw, bytes | bytearray) else raw
    body = _DECODER.decode(text)
    # The parser refuses a raw control character in a string, so a NUL can only come from its escape:
    # without one in the text, no string holds a NUL and the walk is not needed.
    if "\\u0000" in text:
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


class PaymentEvent(Open):
    eventType: EventType
    payment: Payment


class DisputeEvent(Dispute):
    event_type: EventType = Field(alias="eventType")


class WorkflowCallback(Open):
    workflow_id: LongId
    status: Status
    payment_id: Id | None = None


class Verification(Open):
    id: Id
    user_id: Id
    status: Text


class EmailAddress(Open):
    email_address: Email | None = None


class IdentityData(Open):
    id: Id | None = None
    user_id: Id | None = None
    email: Email | None = None
    email_addresses: list[EmailAddress] | None = None
    client_ip: Text | None = None
    ip_address: Text | None = None


class IdentityEvent(Open):
    type: EventType
    data: IdentityData


ProviderEvent = Event  # the provider's webhook body is its event: one schema for the receiver and the handler


def check(model: type[Open], body: dict) -> dict:
    """The body, once it matches `model`; else InvalidInput (PayloadInvalid) naming the first bad field."""
    model.read(body)
    return body
