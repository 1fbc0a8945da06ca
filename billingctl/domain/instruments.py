"""Vaulted payment instruments: which one a renewal may use (spec section 3, NSFW card substitution)."""

from __future__ import annotations

from datetime import datetime

CARD = "PAYMENT_CARD"


def is_expired(instrument: dict, now: datetime) -> bool:
    data = instrument.get("paymentMethodData") or {}
    try:
        year, month = int(data["expirationYear"]), int(data["expirationMonth"])
    except (KeyError, TypeError, ValueError):
        return False  # no expiry recorded: let the processor decide
    return (year, month) < (now.year, now.month)


def usable_card(instrument: dict, now: datetime) -> bool:
    """PAYMENT_CARD, not deleted, not expired."""
    return instrument.get("paymentMethodType") == CARD and not instrument.get("deleted") and not is_expired(
        instrument, now)


def stored_instrument(instruments: list[dict]) -> dict | None:
    """The user's stored token: the default instrument, else the first live one."""
    live = [i for i in instruments if not i.get("deleted")]
    return next((i for i in live if i.get("default")), live[0] if live else None)
