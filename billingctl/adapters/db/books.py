"""Our own books, checked (`billingctl reconcile`) and pruned (the `prune` job): queries that read
across the aggregates by design."""

from __future__ import annotations

from sqlalchemy import Text, delete, func, or_, select, update

from billingctl.adapters.db.purchases import REVERSALS
from billingctl.adapters.db.repository import Repository
from billingctl.adapters.db.tables import (
    alert_outbox,
    audit_log,
    credit_ledger,
    event_inbox,
    event_poller_state,
    fraud_event,
    orphan_recovery,
    purchase,
    subscription,
    users,
)
from billingctl.domain.lifecycle import REVIEW_HUMAN, REVIEW_OPEN


def _checks(now, grace) -> list[tuple[str, object, callable]]:
    """(check name, query, row -> violation) for every check of our own books."""
    payments = select(credit_ledger.c.id, credit_ledger.c.payment_id, credit_ledger.c.user_id, credit_ledger.c.amount
                      ).outerjoin(purchase, purchase.c.transaction_id == credit_ledger.c.payment_id)
    reversed_ = (select(credit_ledger.c.payment_id, (-func.sum(credit_ledger.c.amount)).label("reversed"))
                 .where(credit_ledger.c.reason.in_(REVERSALS)).group_by(credit_ledger.c.payment_id).subquery())
    sums = (select(credit_ledger.c.user_id, func.sum(credit_ledger.c.amount).label("total"))
            .group_by(credit_ledger.c.user_id).subquery())
    # A payment in the review queue is a person's or recovery's work until its row ends.
    handed_to_recovery = select(orphan_recovery.c.payment_id).where(
        orphan_recovery.c.status.in_((*REVIEW_OPEN, *REVIEW_HUMAN)))
    return [
        ("ledger_without_purchase",
         payments.where(credit_ledger.c.reason == "payment", or_(
             purchase.c.id.is_(None), purchase.c.user_id != credit_ledger.c.user_id,
             purchase.c.credits != credit_ledger.c.amount)),
         lambda r: {"ledger_id": r.id, "payment_id": r.payment_id, "detail": "a credit that matches no purchase"}),
        ("refund_without_purchase", payments.where(credit_ledger.c.reason.in_(REVERSALS), purchase.c.id.is_(None)),
         lambda r: {"ledger_id": r.id, "payment_id": r.payment_id, "detail": "a reversal that matches no purchase"}),
        ("ledger_unknown_reason", select(credit_ledger.c.id, credit_ledger.c.reason).where(
            credit_ledger.c.reason.not_in(("payment", *REVERSALS))),
         lambda r: {"ledger_id": r.id, "detail": r.reason}),
        ("refund_exceeds_credit", select(purchase.c.transaction_id, purchase.c.credits, reversed_.c.reversed)
         .join(reversed_, reversed_.c.payment_id == purchase.c.transaction_id)
         .where(reversed_.c.reversed > purchase.c.credits),
         lambda r: {"payment_id": r.transaction_id, "detail": f"{r.reversed} reversed of {r.credits}"}),
        ("credits_differ_from_ledger", select(users.c.id, users.c.credits,
                                              func.coalesce(sums.c.total, 0).label("ledger_sum"))
         .outerjoin(sums, sums.c.user_id == users.c.id).where(users.c.credits != func.coalesce(sums.c.total, 0)),
         lambda r: {"user_id": r.id, "detail": f"users.credits={r.credits}, ledger sum={int(r.ledger_sum)}"}),
        ("invoice_paid_twice", select(purchase.c.invoice_id, func.count().label("n"))
         .where(purchase.c.invoice_id.is_not(None)).group_by(purchase.c.invoice_id).having(func.count() > 1),
         lambda r: {"invoice_id": r.invoice_id, "detail": f"{r.n} settled charges for one subscription period"}),
        ("recorded_not_on_provider_invoice", select(purchase.c.transaction_id, purchase.c.invoice_id).where(
            purchase.c.provider_recorded_at.is_(None), purchase.c.closed_at.is_(None),
            purchase.c.created_at < now - grace, purchase.c.transaction_id.not_in(handed_to_recovery)),
         lambda r: {"payment_id": r.transaction_id, "invoice_id": r.invoice_id,
                    "detail": "recorded by us, not on the provider's invoice"}),
        ("closed_purchase_not_reversed", select(purchase.c.transaction_id, purchase.c.closed_reason,
                                                purchase.c.credits, func.coalesce(reversed_.c.reversed, 0).label("r"))
         .outerjoin(reversed_, reversed_.c.payment_id == purchase.c.transaction_id)
         .where(purchase.c.closed_at.is_not(None), func.coalesce(reversed_.c.reversed, 0) < purchase.c.credits),
         lambda r: {"payment_id": r.transaction_id, "detail": f"closed ({r.closed_reason}) but only {int(r.r)} of "
                                                              f"{r.credits} credits reversed"}),
        ("paid_not_active", select(subscription.c.id, subscription.c.activation_error).where(
            subscription.c.activation_pending_since < now - grace,
            subscription.c.id.in_(select(purchase.c.subscription_id))),
         lambda r: {"subscription_id": r.id, "detail": f"paid, not active: {r.activation_error or 'pending'}"}),
        ("credits_after_freeze", select(credit_ledger.c.id, credit_ledger.c.user_id, credit_ledger.c.payment_id)
         .join(users, users.c.id == credit_ledger.c.user_id)
         .where(users.c.frozen_at.is_not(None), credit_ledger.c.amount > 0,
                credit_ledger.c.created_at > users.c.frozen_at),
         lambda r: {"ledger_id": r.id, "user_id": r.user_id, "payment_id": r.payment_id,
                    "detail": "credits applied after the account was frozen"}),
    ]


class Books(Repository):
    def violations(self, now, grace, limit: int):
        """(check, violation) for at most `limit` violations of each check of our own books."""
        for check, query, describe in _checks(now, grace):
            for row in self.execute(query.limit(limit)):
                yield check, describe(row)

    def attempts_since(self, since):
        """(user id, created at, metadata) of the authorization attempts written since `since`, by user and
        in the order they were written, streamed (a user's rows are few: the quota bounds them)."""
        query = (select(fraud_event.c.user_id, fraud_event.c.created_at, fraud_event.c.metadata)
                 .where(fraud_event.c.event_type == "authorization_attempt", fraud_event.c.created_at > since)
                 .order_by(fraud_event.c.user_id, fraud_event.c.created_at, fraud_event.c.id))
        yield from self.execute(query.execution_options(yield_per=1000))

    def count_users(self) -> int:
        return self.execute(select(func.count()).select_from(users)).scalar_one()

    def recorded_on_provider_since(self, since):
        """(payment id, invoice id) of purchases marked recorded at the provider since `since`, streamed."""
        query = select(purchase.c.transaction_id, purchase.c.invoice_id).where(
            purchase.c.provider_recorded_at.is_not(None), purchase.c.invoice_id.is_not(None),
            purchase.c.provider_recorded_at >= since)
        yield from self.execute(query.execution_options(yield_per=1000))

    def prune(self, cutoffs: dict, dry_run: bool) -> dict[str, int]:
        """Delete what retention allows (emptying the payloads of long-processed inbox events, whose rows
        stay): `cutoffs` names the age limit of each target. The counts of what was (or would be) pruned."""
        targets = {
            "poller_runs": (event_poller_state, event_poller_state.c.created_at < cutoffs["poller_runs"]),
            "inbox_payloads": (event_inbox, (event_inbox.c.status == "processed")
                               & (event_inbox.c.processed_at < cutoffs["inbox_payloads"])
                               & (func.coalesce(func.length(func.cast(event_inbox.c.payload, Text())), 0) > 2)),
            "delivered_outbox": (alert_outbox, (alert_outbox.c.status == "delivered")
                                 & (alert_outbox.c.delivered_at < cutoffs["delivered_outbox"])),
            "audit_log": (audit_log, audit_log.c.created_at < cutoffs["audit_log"]),
        }
        counts = {}
        for name, (table, old) in targets.items():
            counts[name] = self.execute(select(func.count()).select_from(table).where(old)).scalar_one()
            if dry_run or not counts[name]:
                continue
            if name == "inbox_payloads":
                self.execute(update(table).where(old).values(payload={}))
            else:
                self.execute(delete(table).where(old))
        return counts
