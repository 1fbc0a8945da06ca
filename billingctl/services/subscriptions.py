"""The user's view of a subscription: from the provider (the source of truth), cached per customer;
a cache invalidation for the customer makes the next read re-query the provider. When the provider is
unavailable the local copy is served, marked stale."""

from __future__ import annotations

import logging

from billingctl.adapters.payloads import Subscription
from billingctl.domain import errors as e
from billingctl.domain.clock import parse_time
from billingctl.domain.plans import require_id

log = logging.getLogger("billingctl.subscriptions")
SUBSCRIPTION_TTL_SECONDS = 300


def _generation(container, customer_id: str) -> int:
    return int(container.cache.get(f"gen:{customer_id}") or 0)


def invalidate_customer(container, customer_id: str) -> dict:
    require_id(customer_id, "customer_id")
    generation = _generation(container, customer_id) + 1
    container.cache.set(f"gen:{customer_id}", generation, 30 * 86400)
    return {"customer_id": customer_id, "invalidated": True, "generation": generation}


def view(remote: Subscription) -> dict:
    return {"id": remote.id, "status": remote.status, "customer_id": remote.customer_id,
            "current_term_end": parse_time(remote.current_term_end), "start_date": parse_time(remote.start_date),
            "coupon_ids": remote.coupon_ids}


def get_for_user(container, user_id: str, subscription_id: str) -> dict:
    from billingctl.domain.plans import looks_like_id

    if not looks_like_id(subscription_id):
        raise e.NotFound("not found")  # cannot be anyone's subscription
    with container.uow() as uow:
        ours = uow.subscriptions.of_customer(subscription_id, user_id)
    if ours is None:
        # Only a subscription we made for this user (at checkout, recovery or sync) is read at the provider:
        # a random or foreign id costs no provider call, so no one can spend the shared budget with them.
        raise e.NotFound("not found")
    key = f"subscription:{user_id}:{_generation(container, user_id)}:{subscription_id}"
    cached = container.cache.get(key)
    breaker_open = container.breakers["subscription_provider"].state() == "open"
    if cached is not None:
        return {**cached, "stale": True} if breaker_open else cached
    try:
        remote = container.provider.get_subscription(subscription_id)
    except e.ExternalNotFound:
        raise e.NotFound("not found") from None
    except e.CircuitOpen:
        raise  # uncached while the breaker is open: "Circuit breaker is open" (503)
    except e.ExternalError as exc:
        return _local_copy(container, user_id, subscription_id, exc)
    if remote.customer_id != user_id:
        raise e.NotFound("not found")  # a foreign id looks exactly like a random one
    result = {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in view(remote).items()}
    container.cache.set(key, result, SUBSCRIPTION_TTL_SECONDS)
    return result


def _local_copy(container, user_id: str, subscription_id: str, exc: e.ExternalError) -> dict:
    with container.uow() as uow:
        row = uow.subscriptions.of_customer(subscription_id, user_id)
    if row is None:
        raise exc
    log.warning("provider unavailable; serving the local copy: %s", exc.message,
                extra={"subscription_id": subscription_id})
    return {"id": row["id"], "status": row["status"], "customer_id": row["customer_id"],
            "current_term_end": row["current_term_end"].isoformat() if row["current_term_end"] else None,
            "start_date": row["start_date"].isoformat() if row["start_date"] else None,
            "coupon_ids": row["coupon_ids"] or [], "stale": True}
