"""Subscriptions (the local copy of the provider's) and their invoices."""

from __future__ import annotations

from sqlalchemy import func, or_, select, update

from billingctl.adapters.db.repository import Repository
from billingctl.adapters.db.sql import insert_ignore
from billingctl.adapters.db.tables import invoice, purchase, subscription

# A paused one holds its plan: it resumes, and is billed again (decision 181).
STARTED_OR_HELD = ("active", "non_renewing", "paused")


def holds_its_plan():
    """A subscription that holds its plan for its customer (one live subscription per customer and plan,
    decision 110): started or held, or paid and waiting for its activation (decision 178: the provider was
    down when it was paid; the activations job will start it)."""
    paid = select(purchase.c.id).where(purchase.c.subscription_id == subscription.c.id,
                                       purchase.c.closed_at.is_(None)).exists()
    return or_(subscription.c.status.in_(STARTED_OR_HELD), (subscription.c.status == "future") & paid)


class Subscriptions(Repository):
    def plan_holder(self, customer_id: str, item_price_id: str | None) -> str | None:
        """Of a customer's subscriptions that hold a plan (`holds_its_plan`), the one paid last (its newest
        purchase; then the newest id): the one that renews when support made two live (decision 186)."""
        if not item_price_id:
            return None
        paid_last = select(func.max(purchase.c.id)).where(purchase.c.subscription_id == subscription.c.id) \
            .scalar_subquery()
        return self.execute(select(subscription.c.id).where(
            subscription.c.customer_id == customer_id, subscription.c.item_price_id == item_price_id,
            holds_its_plan()).order_by(func.coalesce(paid_last, 0).desc(), subscription.c.id.desc()).limit(1)).scalar()

    def get(self, subscription_id: str):
        return self.execute(select(subscription).where(subscription.c.id == subscription_id)).mappings().first()

    def status(self, subscription_id: str) -> str | None:
        return self.execute(select(subscription.c.status).where(subscription.c.id == subscription_id)).scalar()

    def item_price_id(self, subscription_id: str) -> str | None:
        return self.execute(select(subscription.c.item_price_id).where(
            subscription.c.id == subscription_id)).scalar()

    def of_customer(self, subscription_id: str, user_id: str):
        """The subscription when it belongs to the user, else None."""
        return self.execute(select(subscription).where(subscription.c.id == subscription_id,
                                                       subscription.c.customer_id == user_id)).mappings().first()

    def add(self, values: dict) -> bool:
        """Insert the row unless it exists; True when new."""
        return insert_ignore(self.uow, subscription, values, ["id"])

    def set(self, subscription_id: str, **values) -> None:
        self.execute(update(subscription).where(subscription.c.id == subscription_id).values(**values))

    def move(self, subscription_id: str, expected_status: str, **values) -> bool:
        """A conditional update: only while the row still holds `expected_status` (read in this transaction)."""
        return self.execute(update(subscription).where(subscription.c.id == subscription_id,
                                                       subscription.c.status == expected_status)
                            .values(**values)).rowcount == 1

    def set_if_not_older(self, subscription_id: str, version: int | None, **values) -> bool:
        """Apply a provider copy unless the one applied last has a newer resource_version (a conditional
        update: a racing writer with a newer copy wins). False when it was older."""
        query = update(subscription).where(subscription.c.id == subscription_id)
        if version is not None:
            query = query.where((subscription.c.provider_resource_version.is_(None))
                                | (subscription.c.provider_resource_version <= version))
            values["provider_resource_version"] = version
        return self.execute(query.values(**values)).rowcount == 1

    def all(self) -> dict[str, dict]:
        return {r["id"]: dict(r) for r in self.execute(select(subscription)).mappings()}

    def ids_of_customer(self, user_id: str) -> list[str]:
        return list(self.execute(select(subscription.c.id).where(subscription.c.customer_id == user_id)).scalars())

    def holdings_of_customer(self, user_id: str) -> list[dict]:
        return [dict(r) for r in self.execute(select(subscription.c.id, subscription.c.status,
                                                     subscription.c.item_price_id)
                                              .where(subscription.c.customer_id == user_id)).mappings()]

    def holding_plan(self, user_id: str, item_price_id: str, exclude: str | None) -> list[str]:
        """The user's other subscriptions of the plan that hold it (active, non-renewing, paused, or paid and
        waiting for their activation)."""
        return self.execute(select(subscription.c.id).where(
            subscription.c.customer_id == user_id, subscription.c.item_price_id == item_price_id,
            holds_its_plan(), subscription.c.id != (exclude or ""),
        )).scalars().all()

    def ids_in(self, statuses: tuple[str, ...], updated_since=None) -> list[str]:
        """Subscriptions in one of the statuses (and changed at the provider since, or never seen changed)."""
        query = select(subscription.c.id).where(subscription.c.status.in_(statuses))
        if updated_since is not None:
            query = query.where((subscription.c.provider_updated_at.is_(None))
                                | (subscription.c.provider_updated_at >= updated_since))
        return list(self.execute(query).scalars())

    def with_followups(self, now) -> list[dict]:
        """Subscriptions with follow-up work: an activation to do, or a purchase not yet on its invoice."""
        rows = self.execute(select(subscription.c.id, subscription.c.customer_id,
                                   subscription.c.activation_pending_since, subscription.c.activation_error)
                            .where(or_(subscription.c.activation_pending_since.is_not(None),
                                       subscription.c.id.in_(self.uow.purchases.with_followups_subquery(now))))
                            .order_by(subscription.c.activation_pending_since)).mappings().all()
        return [dict(r) for r in rows]


class Invoices(Repository):
    """The local copy of the provider's invoices. Its status is written only by services.invoices
    (domain.lifecycle.INVOICE): from provider copies, in resource_version order."""

    def get(self, invoice_id: str):
        return self.execute(select(invoice).where(invoice.c.id == invoice_id)).mappings().first()

    def add(self, values: dict) -> bool:
        """Insert the row unless it exists; True when new."""
        return insert_ignore(self.uow, invoice, values, ["id"])

    def update(self, invoice_id: str, expected_status: str | None, version: int | None, **values) -> bool:
        """A conditional update: the row still holds `expected_status` (read in this transaction: a racing
        writer's step is never overwritten unseen) and no copy newer than `version` was applied."""
        query = update(invoice).where(invoice.c.id == invoice_id)
        query = query.where(invoice.c.status.is_(None) if expected_status is None
                            else invoice.c.status == expected_status)
        if version is not None:
            query = query.where((invoice.c.provider_resource_version.is_(None))
                                | (invoice.c.provider_resource_version <= version))
            values["provider_resource_version"] = version
        return self.execute(query.values(**values)).rowcount == 1

    def delete_of_subscription(self, subscription_id: str, now) -> int:
        """The provider deleted the subscription, and its invoices with it (decision 217): no `invoice_deleted`
        is sent for those, so our copies of them, and of the invoices its purchases were for, are noted deleted
        here. Like the flag a copy brings (decision 201), this is not a status. The number noted."""
        of_purchases = select(purchase.c.invoice_id).where(purchase.c.subscription_id == subscription_id,
                                                           purchase.c.invoice_id.is_not(None))
        return self.execute(update(invoice).where(
            or_(invoice.c.subscription_id == subscription_id, invoice.c.id.in_(of_purchases)),
            invoice.c.deleted_at.is_(None)).values(deleted_at=now)).rowcount
