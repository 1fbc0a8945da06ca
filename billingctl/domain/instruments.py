"""Vaulted payment instruments: which one a renewal may use (spec section 3, NSFW card substitution)."""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

CARD = "PAYMENT_CARD"


class Expiry(Protocol):
    expiration_month: int | None
    expiration_year: int | None


class PaymentInstrument(Protocol):
    """What a rule reads of a vaulted instrument (the adapters' typed copy has these)."""
    token: str
    payment_method_type: str | None
    data: Expiry
    default: bool
    deleted: bool


def is_expired(instrument: PaymentInstrument, now: datetime) -> bool:
    year, month = instrument.data.expiration_year, instrument.data.expiration_month
    if year is None or month is None:
        return False  # no expiry recorded: let the processor decide
    return (year, month) < (now.year, now.month)


def usable_card(instrument: PaymentInstrument, now: datetime) -> bool:
    """PAYMENT_CARD, not deleted, not expired."""
    return instrument.payment_method_type == CARD and not instrument.deleted and not is_expired(instrument, now)


def stored_instrument(instruments: list[PaymentInstrument]) -> PaymentInstrument | None:
    """The user's stored token: the default instrument, else the first live one."""
    live = [i for i in instruments if not i.deleted]
    return next((i for i in live if i.default), live[0] if live else None)
