"""Plans: an item price of the provider's catalog read as lane, credits and price (minor units)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from billingctl.domain.errors import InvalidInput

LANES = ("sfw", "nsfw")


@dataclass(frozen=True)
class Plan:
    item_price_id: str
    lane: str
    credits: int
    amount: int
    currency_code: str
    name: str = ""
    period_days: int = 30


def parse_plan(item_price: dict) -> Plan:
    metadata = item_price.get("metadata") or {}
    lane = metadata.get("lane")
    credits = metadata.get("credits")
    if lane not in LANES:
        raise InvalidInput(f"item price {item_price.get('id')} has no valid metadata.lane")
    if not isinstance(credits, int) or isinstance(credits, bool) or credits < 0:
        raise InvalidInput(f"item price {item_price.get('id')} has no valid metadata.credits")
    unit = item_price.get("period_unit", "month")
    period = int(item_price.get("period") or 1)
    days = {"day": 1, "week": 7, "month": 30, "year": 365}.get(unit, 30) * period
    return Plan(item_price["id"], lane, credits, int(item_price["price"]), item_price.get("currency_code", "USD"),
                item_price.get("name", ""), days)


def lane_of_processor(name: str | None, table: dict[str, str]) -> str | None:
    """The lane whose table maps this processor name, or None when no lane maps it."""
    if not name:
        return None
    return table.get(name)


def processor_column(lane: str) -> str:
    return f"{lane}_processor"


def is_unlocked(value: str | None) -> bool:
    """Unlocked means NULL or the empty string (spec section 2)."""
    return value is None or value == ""


_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def looks_like_id(value) -> bool:
    """Ids of the provider and the orchestrator: letters, digits, '.', '_' and '-' (at most 128)."""
    return isinstance(value, str) and bool(_ID.fullmatch(value))  # `$` would accept a trailing newline


def require_id(value, name: str) -> str:
    from billingctl.domain.errors import InvalidInput

    if not looks_like_id(value):
        raise InvalidInput(f"{name} is not a valid id")
    return value
