"""Product listing and plan lookup from the provider's catalog, cached (calls are the scarcest resource)."""

from __future__ import annotations

from billingctl.domain.plans import Plan, parse_plan

CATALOG_TTL_SECONDS = 600


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
    cached = container.cache.get("catalog")
    if cached is None:
        cached = [p for p in container.provider.list_item_prices() if p.get("status", "active") == "active"]
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
