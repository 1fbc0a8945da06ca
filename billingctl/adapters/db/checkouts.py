"""Checkout sessions: one per checkout, found by the order id the front end holds or by its invoice."""

from __future__ import annotations

from sqlalchemy import and_, func, or_, select, update

from billingctl.adapters.db.repository import Repository
from billingctl.adapters.db.tables import checkout_session, purchase, subscription


def order_matches(order_id: str):
    return or_(checkout_session.c.order_id == order_id, checkout_session.c.invoice_id == order_id)


class Checkouts(Repository):
    def add(self, **values) -> None:
        self.execute(checkout_session.insert().values(**values))

    def by_order_id(self, order_id: str, user_id: str | None = None):
        query = select(checkout_session).where(order_matches(order_id))
        if user_id is not None:
            query = query.where(checkout_session.c.user_id == user_id)
        return self.execute(query).mappings().first()

    def open_for_plan(self, user_id: str, item_price_id: str, valid_after):
        """The user's newest checkout of the plan still to be paid: its session valid after `valid_after`, its
        subscription still future, no purchase paying it (a second tab gets this one back)."""
        return self.execute(select(checkout_session).join(
            subscription, subscription.c.id == checkout_session.c.subscription_id).where(
            checkout_session.c.user_id == user_id, checkout_session.c.item_price_id == item_price_id,
            checkout_session.c.status == "open", checkout_session.c.expires_at > valid_after,
            subscription.c.status == "future",
            ~select(purchase.c.id).where(purchase.c.subscription_id == checkout_session.c.subscription_id).exists(),
        ).order_by(checkout_session.c.id.desc()).limit(1)).mappings().first()

    def count_open(self, user_id: str, valid_after) -> int:
        """The user's checkouts still to be paid (as `open_for_plan`, of any plan)."""
        return self.execute(select(func.count()).select_from(checkout_session.join(
            subscription, subscription.c.id == checkout_session.c.subscription_id)).where(
            checkout_session.c.user_id == user_id, checkout_session.c.status == "open",
            checkout_session.c.expires_at > valid_after, subscription.c.status == "future",
            ~select(purchase.c.id).where(purchase.c.subscription_id == checkout_session.c.subscription_id).exists(),
        )).scalar_one()

    def lane_of_order(self, order_id: str) -> str | None:
        return self.execute(select(checkout_session.c.lane).where(order_matches(order_id))).scalar()

    def user_has_any(self, user_id: str) -> bool:
        return self.execute(select(checkout_session.c.id).where(checkout_session.c.user_id == user_id)
                            .limit(1)).first() is not None

    def exists_for_subscription(self, subscription_id: str) -> bool:
        return self.execute(select(checkout_session.c.id).where(
            checkout_session.c.subscription_id == subscription_id)).first() is not None

    def cancel(self, subscription_id: str) -> None:
        self.execute(update(checkout_session).where(checkout_session.c.subscription_id == subscription_id)
                     .values(status="cancelled"))

    def expired_unpaid(self, now, pending_after, created_before) -> list[dict]:
        """Pending checkouts (future subscriptions whose start is past `pending_after`) created before
        `created_before`, whose session expired and that no purchase pays."""
        rows = self.execute(
            select(subscription.c.id, subscription.c.customer_id, subscription.c.created_at,
                   checkout_session.c.invoice_id, checkout_session.c.expires_at)
            .join(checkout_session, checkout_session.c.subscription_id == subscription.c.id)
            .where(subscription.c.status == "future", subscription.c.start_date > pending_after,
                   subscription.c.created_at < created_before,
                   and_(checkout_session.c.expires_at.is_not(None), checkout_session.c.expires_at <= now),
                   ~select(purchase.c.id).where(purchase.c.subscription_id == subscription.c.id).exists())
        ).mappings().all()
        return [dict(r) for r in rows]
