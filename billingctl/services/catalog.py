"""Product listing and plan lookup from the provider's catalog, cached (calls are the scarcest resource)."""

from __future__ import annotations

import logging

from billingctl.domain.errors import InvalidInput
from billingctl.domain.plans import Plan, parse_plan

CATALOG_TTL_SECONDS = 600
log = logging.getLogger("billingctl.catalog")


def item_price(container, item_price_id: str) -> dict:
    key = f"item_price:{item_price_id}"
    cached = container.cache.get(key)
    if cached is not None:
        return cached
    price = container.provider.get_item_price(item_price_id)
    container.cache.set(key, price, CATALOG_TTL_SECONDS)
    return price


def plan(container, item_price_id: str) -> Plan:
    return parse_plan(item_price(container, item_price_id))


def products(container) -> list[dict]:
    """The active plan item prices that carry our metadata (lane and credits). A real catalog also holds
    addons, charges and plans of other products: those are skipped, and logged once per catalog read."""
    cached = container.cache.get("catalog")
    if cached is None:
        cached, skipped = [], []
        for price in container.provider.list_item_prices(item_type="plan"):
            if price.get("status", "active") != "active" or price.get("item_type", "plan") != "plan":
                continue
            try:
                parse_plan(price)
            except InvalidInput:
                skipped.append(price.get("id"))
                continue
            cached.append(price)
        if skipped:
            log.warning("item prices without valid metadata.lane and metadata.credits are not listed",
                        extra={"item_price_ids": skipped})
        container.cache.set("catalog", cached, CATALOG_TTL_SECONDS)
        for price in cached:
            container.cache.set(f"item_price:{price['id']}", price, CATALOG_TTL_SECONDS)
    return cached


def product_view(price: dict) -> dict:
    """What a user (and an operator) sees of a plan."""
    plan = parse_plan(price)
    return {"item_price_id": plan.item_price_id, "name": plan.name, "amount": plan.amount,
            "currency_code": plan.currency_code, "period": price.get("period", 1),
            "period_unit": price.get("period_unit", "month"), "credits": plan.credits, "lane": plan.lane}
