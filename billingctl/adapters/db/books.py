"""Our own books, checked (`billingctl reconcile`) and pruned (the `prune` job): queries that read
across the aggregates by design."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from itertools import groupby

from sqlalchemy import Text, case, delete, func, or_, select, text, true, update

from billingctl.adapters.db.purchases import REVERSALS
from billingctl.adapters.db.repository import Repository
from billingctl.adapters.db.tables import (
    alert_outbox,
    audit_log,
    checkout_session,
    credit_ledger,
    dispute,
    dunning_attempt,
    event_inbox,
    event_poller_state,
    fraud_event,
    invoice,
    orphan_recovery,
    purchase,
    subscription,
    users,
)
from billingctl.domain.lifecycle import DUNNING_ENDED, REVIEW_OPEN

# A subscription billed every period (spec 3): at most one per customer and plan (decision 110).
# Billed each term; a paused subscription is billed again once it resumes (decision 181).
BILLED = ("in_trial", "active", "non_renewing", "paused")
STREAMED = 1000  # rows a check fetches at a time (a server-side cursor on PostgreSQL)


@dataclass(frozen=True)
class Limits:
    """How long follow-up work may take before reconcile names it (the jobs finish well within)."""
    grace: timedelta
    in_flight: timedelta  # a renewal charge in flight (settings.renewal_in_flight_max_hours)
    authorized: timedelta  # an authorization not captured (settings.renewal_authorized_max_minutes)


@dataclass(frozen=True)
class Check:
    """One check of our own books: its query, and each row as a violation. With `group`, the rows that
    share that column are one violation (every id of it named: the payments of an invoice paid twice)."""
    name: str
    query: object
    describe: Callable
    group: str | None = None


def _live_grants(invoices=None):
    """A term's credits granted for a purchase that still stands: one ledger row per grant (a term paid at
    the provider in parts is granted once, by its invoice), of a purchase neither closed nor reversed in
    full (a refunded duplicate is no payment of its invoice any more). Only the purchases on `invoices` (a
    query of their ids) when given."""
    reversed_ = _reversed(None if invoices is None else
                          select(purchase.c.transaction_id).where(purchase.c.invoice_id.in_(invoices)))
    query = (select(purchase.c.transaction_id, purchase.c.invoice_id, purchase.c.user_id, purchase.c.credits,
                   purchase.c.created_at, purchase.c.subscription_id, purchase.c.amount)
            .join(credit_ledger, (credit_ledger.c.payment_id == purchase.c.transaction_id)
                  & (credit_ledger.c.reason == "payment"))
            .outerjoin(reversed_, reversed_.c.payment_id == purchase.c.transaction_id)
            .where(purchase.c.closed_at.is_(None),
                   func.coalesce(reversed_.c.reversed, 0) < purchase.c.credits))
    return query if invoices is None else query.where(purchase.c.invoice_id.in_(invoices))


def _terms_paid_twice(since=None):
    """Pairs of invoices of one subscription whose terms (our copies') share days, each paid in full by a
    purchase that still stands (decisions 204, 258). A term charged less than its invoice's total was
    credited in part at the provider: a person's judgement of the shared days, not named. With `since`, only
    the subscriptions that had a purchase since."""
    grants = _live_grants(None if since is None else select(invoice.c.id).where(invoice.c.subscription_id.in_(
        select(purchase.c.subscription_id).where(purchase.c.created_at >= since)))).subquery()
    terms = (select(grants.c.transaction_id, grants.c.invoice_id, grants.c.user_id, grants.c.created_at,
                    invoice.c.subscription_id, invoice.c.term_start, invoice.c.term_end)
             .join(invoice, invoice.c.id == grants.c.invoice_id)
             .where(invoice.c.term_start.is_not(None), invoice.c.term_end.is_not(None),
                    grants.c.amount >= invoice.c.total_amount)).subquery()
    a, b = terms.alias("paid_first"), terms.alias("paid_then")
    return (select(a.c.subscription_id, a.c.user_id, a.c.invoice_id.label("first_invoice"),
                   a.c.transaction_id.label("first_payment"), b.c.invoice_id, b.c.transaction_id,
                   case((a.c.created_at > b.c.created_at, a.c.created_at), else_=b.c.created_at).label("at"))
            .where(a.c.subscription_id == b.c.subscription_id, a.c.invoice_id < b.c.invoice_id,
                   a.c.term_start < b.c.term_end, b.c.term_start < a.c.term_end)
            .order_by(a.c.subscription_id, a.c.invoice_id, b.c.invoice_id))


def _reversed(payments=None):
    """Each payment's reversed credits and its last reversal; only `payments` (a query of their ids) when given."""
    query = select(credit_ledger.c.payment_id, (-func.sum(credit_ledger.c.amount)).label("reversed"),
                   func.max(credit_ledger.c.created_at).label("last")).where(credit_ledger.c.reason.in_(REVERSALS))
    if payments is not None:
        query = query.where(credit_ledger.c.payment_id.in_(payments))
    return query.group_by(credit_ledger.c.payment_id).subquery()


def _credits_differ(window_users=None):
    """Users whose balance is not their ledger's sum: every user, or only `window_users` (a query of ids),
    each summed over its own ledger rows."""
    if window_users is None:
        sums = (select(credit_ledger.c.user_id, func.sum(credit_ledger.c.amount).label("total"),
                       func.max(credit_ledger.c.created_at).label("last"))
                .group_by(credit_ledger.c.user_id).subquery())
        return (select(users.c.id, users.c.credits, func.coalesce(sums.c.total, 0).label("ledger_sum"),
                       sums.c.last.label("at"))
                .outerjoin(sums, sums.c.user_id == users.c.id).where(users.c.credits != func.coalesce(sums.c.total, 0)))
    own = credit_ledger.c.user_id == users.c.id
    total = select(func.coalesce(func.sum(credit_ledger.c.amount), 0)).where(own).scalar_subquery()
    last = select(func.max(credit_ledger.c.created_at)).where(own).scalar_subquery()
    return (select(users.c.id, users.c.credits, total.label("ledger_sum"), last.label("at"))
            .where(users.c.id.in_(window_users), users.c.credits != total))


def _checks(now, limits: Limits, since=None) -> list[Check]:
    """Every check of our own books. With `since` (an incremental run, decision 133), the checks whose
    tables grow with history read only what was written since (ledger rows, purchases, reversals, closes;
    each violation's `at` says when, so the next window still reaches it while it stands); the others
    read small tables or open rows only."""
    grace = limits.grace

    def recent(column):
        return true() if since is None else column >= since

    payments = select(credit_ledger.c.id, credit_ledger.c.payment_id, credit_ledger.c.user_id, credit_ledger.c.amount,
                      credit_ledger.c.created_at.label("at")
                      ).outerjoin(purchase, purchase.c.transaction_id == credit_ledger.c.payment_id)
    # A window's reversals are those of the payments reversed in it (for the check of what was reversed);
    # a window's users, those it credited or debited: each is summed over its own rows by the index, never
    # the whole ledger grouped (at 1,000,000 rows PostgreSQL merged the ledger's whole user index to find a
    # day's hundred users: 0.4 s).
    reversed_ = _reversed()
    reversed_in_window = reversed_ if since is None else _reversed(select(credit_ledger.c.payment_id).where(
        credit_ledger.c.reason.in_(REVERSALS), credit_ledger.c.created_at >= since))
    ledger_users = select(credit_ledger.c.user_id).where(recent(credit_ledger.c.created_at))
    credits_differ = _credits_differ(ledger_users if since is not None else None)
    # A payment in recovery's own queue is its work until the row ends; one a person holds (exhausted,
    # needs review) is named: whoever owns it, a purchase that is not on a paid invoice is a violation.
    in_recovery = select(orphan_recovery.c.payment_id).where(orphan_recovery.c.status.in_(REVIEW_OPEN))
    live = _live_grants(None if since is None else select(purchase.c.invoice_id).where(
        purchase.c.created_at >= since)).subquery()  # a window's: the invoices paid by its purchases
    twice = select(live.c.invoice_id).where(live.c.invoice_id.is_not(None)).group_by(live.c.invoice_id).having(
        func.count() > 1)
    closed_reversed = reversed_ if since is None else _reversed(select(purchase.c.transaction_id).where(
        purchase.c.closed_at >= since))
    billed = (select(subscription.c.customer_id, subscription.c.item_price_id)
              .where(subscription.c.status.in_(BILLED), subscription.c.item_price_id.is_not(None))
              .group_by(subscription.c.customer_id, subscription.c.item_price_id).having(func.count() > 1).subquery())
    newest = select(func.max(dunning_attempt.c.id)).group_by(dunning_attempt.c.invoice_id)
    pending = (dunning_attempt.c.status == "pending") & dunning_attempt.c.resolved_at.is_(None)
    return [
        Check("ledger_without_purchase",
              payments.where(credit_ledger.c.reason == "payment", recent(credit_ledger.c.created_at), or_(
                  purchase.c.id.is_(None), purchase.c.user_id != credit_ledger.c.user_id,
                  purchase.c.credits != credit_ledger.c.amount)),
              lambda r: {"ledger_id": r.id, "payment_id": r.payment_id, "user_id": r.user_id,
                         "detail": "a credit that matches no purchase"}),
        Check("refund_without_purchase",
              payments.where(credit_ledger.c.reason.in_(REVERSALS), purchase.c.id.is_(None),
                             recent(credit_ledger.c.created_at)),
              lambda r: {"ledger_id": r.id, "payment_id": r.payment_id, "user_id": r.user_id,
                         "detail": "a reversal that matches no purchase"}),
        Check("ledger_unknown_reason", select(credit_ledger.c.id, credit_ledger.c.user_id, credit_ledger.c.reason,
                                              credit_ledger.c.created_at.label("at"))
              .where(credit_ledger.c.reason.not_in(("payment", *REVERSALS)), recent(credit_ledger.c.created_at)),
              lambda r: {"ledger_id": r.id, "user_id": r.user_id, "detail": r.reason}),
        Check("refund_exceeds_credit",
              select(purchase.c.transaction_id, purchase.c.user_id, purchase.c.credits, reversed_in_window.c.reversed,
                     reversed_in_window.c.last.label("at"))
              .join(reversed_in_window, reversed_in_window.c.payment_id == purchase.c.transaction_id)
              .where(reversed_in_window.c.reversed > purchase.c.credits),
              lambda r: {"payment_id": r.transaction_id, "user_id": r.user_id,
                         "detail": f"{r.reversed} reversed of {r.credits}"}),
        Check("credits_differ_from_ledger", credits_differ,
              lambda r: {"user_id": r.id, "detail": f"users.credits={r.credits}, ledger sum={int(r.ledger_sum)}"}),
        # Refunded or closed purchases are not counted: the fix for a double charge is a refund.
        Check("invoice_paid_twice",
              select(live.c.invoice_id, live.c.transaction_id, live.c.user_id, live.c.created_at.label("at"))
              .where(live.c.invoice_id.in_(twice))
              .order_by(live.c.invoice_id, live.c.created_at),
              lambda rows: {"invoice_id": rows[0].invoice_id, "payment_ids": [r.transaction_id for r in rows],
                            "user_id": rows[0].user_id,
                            "detail": f"{len(rows)} settled charges for one subscription period"},
              group="invoice_id"),
        # Two terms of one subscription paid in full and sharing days: the customer paid twice for them.
        Check("term_paid_twice", _terms_paid_twice(since),
              lambda r: {"invoice_id": r.invoice_id, "subscription_id": r.subscription_id, "user_id": r.user_id,
                         "payment_ids": [r.first_payment, r.transaction_id],
                         "detail": f"its term shares days with {r.first_invoice}'s, both paid in full"}),
        Check("two_live_subscriptions",
              select(subscription.c.id, subscription.c.customer_id, subscription.c.item_price_id)
              .join(billed, (billed.c.customer_id == subscription.c.customer_id)
                    & (billed.c.item_price_id == subscription.c.item_price_id))
              .where(subscription.c.status.in_(BILLED))
              .order_by(subscription.c.customer_id, subscription.c.item_price_id, subscription.c.id),
              lambda rows: {"user_id": rows[0].customer_id, "item_price_id": rows[0].item_price_id,
                            "subscription_ids": [r.id for r in rows],
                            "detail": f"{len(rows)} live subscriptions of {rows[0].item_price_id}, each billed"},
              group=("customer_id", "item_price_id")),
        Check("recorded_not_on_provider_invoice",
              select(purchase.c.transaction_id, purchase.c.invoice_id, purchase.c.user_id).where(
                  purchase.c.provider_recorded_at.is_(None), purchase.c.closed_at.is_(None),
                  purchase.c.created_at < now - grace, purchase.c.transaction_id.not_in(in_recovery)),
              lambda r: {"payment_id": r.transaction_id, "invoice_id": r.invoice_id, "user_id": r.user_id,
                         "detail": "recorded by us, not on the provider's invoice"}),
        Check("closed_purchase_not_reversed",
              select(purchase.c.transaction_id, purchase.c.user_id, purchase.c.closed_reason, purchase.c.credits,
                     func.coalesce(closed_reversed.c.reversed, 0).label("r"), purchase.c.closed_at.label("at"))
              .outerjoin(closed_reversed, closed_reversed.c.payment_id == purchase.c.transaction_id)
              .where(purchase.c.closed_at.is_not(None), recent(purchase.c.closed_at),
                     func.coalesce(closed_reversed.c.reversed, 0) < purchase.c.credits),
              lambda r: {"payment_id": r.transaction_id, "user_id": r.user_id,
                         "detail": f"closed ({r.closed_reason}) but only {int(r.r)} of {r.credits} credits reversed"}),
        Check("dispute_lost_not_reversed",
              select(dispute.c.dispute_id, dispute.c.payment_id, purchase.c.user_id, purchase.c.credits,
                     func.coalesce(reversed_.c.reversed, 0).label("r"))
              .join(purchase, purchase.c.transaction_id == dispute.c.payment_id)
              .outerjoin(reversed_, reversed_.c.payment_id == dispute.c.payment_id)
              .where(dispute.c.state == "lost", dispute.c.updated_at < now - grace,
                     func.coalesce(reversed_.c.reversed, 0) < purchase.c.credits),
              lambda r: {"payment_id": r.payment_id, "user_id": r.user_id, "dispute_id": r.dispute_id,
                         "detail": f"dispute lost, only {int(r.r)} of {r.credits} credits reversed"}),
        Check("paid_not_active", select(subscription.c.id, subscription.c.customer_id, subscription.c.activation_error)
              .where(subscription.c.activation_pending_since < now - grace,
                     subscription.c.id.in_(select(purchase.c.subscription_id))),
              lambda r: {"subscription_id": r.id, "user_id": r.customer_id,
                         "detail": f"paid, not active: {r.activation_error or 'pending'}"}),
        Check("credits_after_freeze",
              select(credit_ledger.c.id, credit_ledger.c.user_id, credit_ledger.c.payment_id)
              .join(users, users.c.id == credit_ledger.c.user_id)
              .where(users.c.frozen_at.is_not(None), credit_ledger.c.amount > 0,
                     credit_ledger.c.id > users.c.frozen_ledger_id),  # by the ledger's order (decision 177)
              lambda r: {"ledger_id": r.id, "user_id": r.user_id, "payment_id": r.payment_id,
                         "detail": "credits applied after the account was frozen"}),
        # A renewal charge in flight past its age limit (the renewal tick captures, cancels or escalates it
        # at the limit: past it and the grace, nothing did).
        Check("charge_in_flight_too_long",
              select(dunning_attempt.c.invoice_id, dunning_attempt.c.payment_id, dunning_attempt.c.user_id,
                     dunning_attempt.c.decline_code, dunning_attempt.c.created_at)
              .where(pending, or_(dunning_attempt.c.created_at < now - limits.in_flight - grace,
                                  (dunning_attempt.c.decline_code == "AUTHORIZED")
                                  & (dunning_attempt.c.created_at < now - limits.authorized - grace))),
              lambda r: {"invoice_id": r.invoice_id, "payment_id": r.payment_id, "user_id": r.user_id,
                         "detail": f"renewal charge {r.decline_code or 'PENDING'} "
                                   f"since {r.created_at:%Y-%m-%d %H:%M}"}),
        # Every renewal attempt ends on its outcome: a pending row resolved without the outcome row that
        # follows it, or an invoice paid by a standing purchase whose dunning never recorded it.
        Check("dunning_unfinished",
              select(dunning_attempt.c.invoice_id, dunning_attempt.c.user_id, dunning_attempt.c.status,
                     dunning_attempt.c.resolved_at)
              .where(dunning_attempt.c.id.in_(newest), dunning_attempt.c.status.not_in(DUNNING_ENDED), or_(
                  (dunning_attempt.c.status == "pending") & dunning_attempt.c.resolved_at.is_not(None)
                  & (dunning_attempt.c.resolved_at < now - grace),
                  dunning_attempt.c.invoice_id.in_(select(live.c.invoice_id).where(live.c.created_at < now - grace)))),
              lambda r: {"invoice_id": r.invoice_id, "user_id": r.user_id,
                         "detail": f"renewal attempts end on {r.status}"
                                   + (" (resolved, no outcome row)" if r.resolved_at else ", the invoice is paid")}),
    ]


class Books(Repository):
    def without_jit(self) -> None:
        """For the rest of this transaction, no JIT compilation on PostgreSQL: the checks' correlated sums
        are estimated past `jit_above_cost` (100,000) and compiled on every run, about 0.1 s each, for a
        query that runs in a few milliseconds at 1,000,000 ledger rows (decision 159)."""
        if self.uow.dialect == "postgresql":
            self.execute(text("SET LOCAL jit = off"))

    def paid_by(self, invoice_id: str):
        """The standing purchase whose granted term pays an invoice (transaction_id, amount), the first
        recorded; None when none does. The purchases reconcile's `dunning_unfinished` reads."""
        live = _live_grants([invoice_id]).subquery()
        return self.execute(select(live.c.transaction_id, purchase.c.amount).join(
            purchase, purchase.c.transaction_id == live.c.transaction_id).order_by(purchase.c.id).limit(1)).first()

    def violations(self, now, limits: Limits, since=None):
        """(check, violation, at) for each violation of each check of our own books: every row each check
        finds, streamed (a report lists the first LIMIT of a check and counts them all; a check that read
        one page hid what lay past it behind the cases a person had acknowledged, decision 234); a grouped
        check reads its rows in the order of its groups. `at`: when the row that shows it was written (None
        where the check reads every row each run)."""
        for check in _checks(now, limits, since):
            rows = self.execute(check.query.execution_options(yield_per=STREAMED))
            if check.group is None:
                for row in rows:
                    yield check.name, check.describe(row), row._mapping.get("at")
                continue
            keys = (check.group,) if isinstance(check.group, str) else check.group
            for _, group in groupby(rows, key=lambda r: tuple(getattr(r, k) for k in keys)):
                group = list(group)
                times = [r._mapping.get("at") for r in group if r._mapping.get("at") is not None]
                yield check.name, check.describe(group), max(times) if times else None

    def purchases_of(self, payment_ids: list[str]) -> dict[str, dict]:
        """Our purchase and review row (status and resolution; if any) of each of a page of orchestrator
        payments: one statement each for the page, not two per payment."""
        found: dict[str, dict] = {pid: {"purchase": None, "review": None} for pid in payment_ids}
        for row in self.execute(select(purchase).where(purchase.c.transaction_id.in_(payment_ids))).mappings():
            found[row["transaction_id"]]["purchase"] = dict(row)
        for row in self.execute(select(orphan_recovery.c.payment_id, orphan_recovery.c.status,
                                       orphan_recovery.c.resolution)
                                .where(orphan_recovery.c.payment_id.in_(payment_ids))).mappings():
            found[row["payment_id"]]["review"] = dict(row)
        return found

    def expected_charges(self, payments: dict[str, str | None]) -> dict[str, tuple]:
        """(amount, currency) each payment (id -> order id) was asked for: its checkout's session (a
        checkout's order), else the renewal attempt that charged it (the currency is the invoice's)."""
        orders = {order: pid for pid, order in payments.items() if order}
        expected: dict[str, tuple] = {}
        for row in self.execute(select(checkout_session.c.order_id, checkout_session.c.amount,
                                       checkout_session.c.currency_code)
                                .where(checkout_session.c.order_id.in_(list(orders)))):
            expected[orders[row.order_id]] = (row.amount, row.currency_code)
        rest = [pid for pid in payments if pid not in expected]
        if rest:
            for row in self.execute(select(dunning_attempt.c.payment_id, dunning_attempt.c.amount,
                                           invoice.c.currency_code)
                                    .outerjoin(invoice, invoice.c.id == dunning_attempt.c.invoice_id)
                                    .where(dunning_attempt.c.payment_id.in_(rest),
                                           dunning_attempt.c.amount.is_not(None))
                                    .order_by(dunning_attempt.c.id)):
                expected.setdefault(row.payment_id, (row.amount, row.currency_code))
        return expected

    def checkouts_begun_before(self, order_ids: list[str], since) -> set[str]:
        """Of these orders, the checkouts begun before `since`: a charge of one may lie before a window."""
        return set(self.execute(select(checkout_session.c.order_id).where(
            checkout_session.c.order_id.in_(order_ids), checkout_session.c.created_at < since)).scalars())

    def grants_on(self, invoice_ids: list[str]) -> dict[str, dict]:
        """Of each invoice: the purchases recorded on it, and those of them whose term's credits still
        stand (`_live_grants`)."""
        standing = {i: {"purchases": [], "grants": []} for i in invoice_ids}
        for row in self.execute(select(purchase.c.invoice_id, purchase.c.transaction_id, purchase.c.user_id,
                                       purchase.c.created_at).where(purchase.c.invoice_id.in_(invoice_ids))):
            standing[row.invoice_id]["purchases"].append(row)
        live = _live_grants(invoice_ids).subquery()
        for row in self.execute(select(live.c.invoice_id, live.c.transaction_id)):
            standing[row.invoice_id]["grants"].append(row.transaction_id)
        return standing

    def billed_of(self, customer_ids: list[str]) -> list:
        """Our copies of the billed subscriptions of some customers (id, customer, plan)."""
        return self.execute(select(subscription.c.id, subscription.c.customer_id, subscription.c.item_price_id)
                            .where(subscription.c.customer_id.in_(customer_ids),
                                   subscription.c.status.in_(BILLED))).all()

    def notified_since(self, source: str, event_type: str, since) -> list:
        """(inbox key, received at) of one source's notifications of one type received since `since`."""
        return self.execute(select(event_inbox.c.event_id, event_inbox.c.received_at).where(
            event_inbox.c.source == source, event_inbox.c.event_type == event_type,
            event_inbox.c.received_at >= since)).all()

    def credits_of(self, payment_ids) -> list[tuple[str, int, int]]:
        """(payment id, credits, excess returned) of those of the payments we recorded."""
        return [(r.transaction_id, r.credits, r.returned_excess) for r in self.execute(
            select(purchase.c.transaction_id, purchase.c.credits, purchase.c.returned_excess)
            .where(purchase.c.transaction_id.in_(payment_ids)))]

    def active_created_since(self, since=None) -> list:
        """(id, created at) of our active subscriptions (first copied since `since`: an incremental reconcile
        asks the provider about each one its window did not list)."""
        query = select(subscription.c.id, subscription.c.created_at).where(subscription.c.status == "active")
        if since is not None:
            query = query.where(subscription.c.created_at >= since)
        return self.execute(query).all()

    def owner_of(self, any_id: str) -> str | None:
        """The user an id of ours belongs to: the user itself, a payment, a subscription or an invoice."""
        for query in (select(users.c.id).where(users.c.id == any_id),
                      select(purchase.c.user_id).where(purchase.c.transaction_id == any_id),
                      select(orphan_recovery.c.user_id).where(orphan_recovery.c.payment_id == any_id),
                      select(subscription.c.customer_id).where(subscription.c.id == any_id),
                      select(invoice.c.customer_id).where(invoice.c.id == any_id)):
            found = self.execute(query.limit(1)).scalar()
            if found:
                return found
        return None

    def trace(self, user_id: str, shown: int = 500) -> dict:
        """Everything our books hold about one user, for `billingctl trace` (issue 38 item 12): every row of
        the books its checks read (one user's rows; a page of them told a longer ledger apart from the
        balance, decision 235); of the inbox and the audit log, which only show, the first `shown`, and
        under "not_shown" each section more were left out of, with how many rows of it are shown."""
        not_shown: dict[str, int] = {}

        def rows(query, section: str | None = None):
            if section is None:
                return [dict(r) for r in self.execute(query).mappings()]
            found = [dict(r) for r in self.execute(query.limit(shown + 1)).mappings()]
            if len(found) > shown:
                not_shown[section] = shown
            return found[:shown]

        bought = rows(select(purchase).where(purchase.c.user_id == user_id).order_by(purchase.c.id))
        payments = [b["transaction_id"] for b in bought]
        reviewed = rows(select(orphan_recovery).where(orphan_recovery.c.user_id == user_id))
        payments += [r["payment_id"] for r in reviewed if r["payment_id"] not in payments]
        subscriptions = rows(select(subscription).where(subscription.c.customer_id == user_id))
        keys = [*payments, *(s["id"] for s in subscriptions)]
        inbox = rows(select(event_inbox.c.id, event_inbox.c.source, event_inbox.c.event_id, event_inbox.c.event_type,
                            event_inbox.c.status, event_inbox.c.received_at, event_inbox.c.processed_at)
                     .where(or_(*(event_inbox.c.event_id.contains(k) for k in keys),
                                func.cast(event_inbox.c.payload, Text()).contains(user_id)))
                     .order_by(event_inbox.c.id), "inbox") if keys else []
        return {
            "user": rows(select(users).where(users.c.id == user_id)),
            "purchases": bought, "reviews": reviewed, "subscriptions": subscriptions, "inbox": inbox,
            "ledger": rows(select(credit_ledger).where(credit_ledger.c.user_id == user_id)
                           .order_by(credit_ledger.c.id)),
            "dunning": rows(select(dunning_attempt).where(dunning_attempt.c.user_id == user_id)
                            .order_by(dunning_attempt.c.id)),
            "disputes": rows(select(dispute).where(dispute.c.user_id == user_id)),
            "audit": rows(select(audit_log).where(audit_log.c.target.in_([user_id, *keys])).order_by(audit_log.c.id),
                          "audit"),
            "not_shown": not_shown,
        }

    def attempts_since(self, since):
        """(user id, created at, metadata) of the authorization attempts written since `since`, by user and
        in the order they were written (their ids: the gate counts what was written before a start, and a
        clock stepped back stamps a later attempt earlier, decision 249), streamed (a user's rows are few:
        the quota bounds them)."""
        query = (select(fraud_event.c.user_id, fraud_event.c.created_at, fraud_event.c.metadata)
                 .where(fraud_event.c.event_type == "authorization_attempt", fraud_event.c.created_at > since)
                 .order_by(fraud_event.c.user_id, fraud_event.c.id))
        yield from self.execute(query.execution_options(yield_per=1000))

    def count_ledger(self, since=None) -> int:
        """Ledger rows (written since `since`: what an incremental run read)."""
        query = select(func.count()).select_from(credit_ledger)
        if since is not None:
            query = query.where(credit_ledger.c.created_at >= since)
        return self.execute(query).scalar_one()

    def count_users(self) -> int:
        return self.execute(select(func.count()).select_from(users)).scalar_one()

    def recorded_on_provider_since(self, since):
        """(payment id, invoice id) of purchases marked recorded at the provider since `since`, streamed; not
        one whose credits all went back (refunded or charged back: nothing stands on it, decision 184)."""
        given_back = _reversed(select(purchase.c.transaction_id).where(purchase.c.provider_recorded_at >= since))
        query = select(purchase.c.transaction_id, purchase.c.invoice_id, purchase.c.provider_recorded_at).outerjoin(
            given_back, given_back.c.payment_id == purchase.c.transaction_id).where(
            purchase.c.provider_recorded_at.is_not(None), purchase.c.invoice_id.is_not(None),
            purchase.c.provider_recorded_at >= since,
            or_(purchase.c.credits == 0, func.coalesce(given_back.c.reversed, 0) < purchase.c.credits))
        yield from self.execute(query.execution_options(yield_per=1000))

    @staticmethod
    def _prunable(cutoffs: dict) -> dict:
        """(table, what is old) of each retention target."""
        return {
            "poller_runs": (event_poller_state, event_poller_state.c.created_at < cutoffs["poller_runs"]),
            "inbox_payloads": (event_inbox, (event_inbox.c.status == "processed")
                               & (event_inbox.c.processed_at < cutoffs["inbox_payloads"])
                               & (func.coalesce(func.length(func.cast(event_inbox.c.payload, Text())), 0) > 2)),
            "delivered_outbox": (alert_outbox, (alert_outbox.c.status == "delivered")
                                 & (alert_outbox.c.delivered_at < cutoffs["delivered_outbox"])),
            "audit_log": (audit_log, audit_log.c.created_at < cutoffs["audit_log"]),
        }

    def count_prunable(self, cutoffs: dict) -> dict[str, int]:
        return {name: self.execute(select(func.count()).select_from(table).where(old)).scalar_one()
                for name, (table, old) in self._prunable(cutoffs).items()}

    def prune_batch(self, name: str, cutoffs: dict, batch: int, after: int = 0) -> tuple[int, int]:
        """Prune at most `batch` rows of one target whose id is above `after` (the payloads of inbox events
        are emptied, their rows stay): (rows pruned, the highest id pruned). The next batch starts after
        it, so no batch reads again the rows the ones before it pruned (an emptied payload is still a row
        of the inbox: the batches read the whole target once, not once per batch). Each batch is its
        caller's own short transaction."""
        table, old = self._prunable(cutoffs)[name]
        chosen = select(table.c.id).where(old, table.c.id > after).order_by(table.c.id).limit(batch).scalar_subquery()
        if name == "inbox_payloads":
            statement = update(table).where(table.c.id.in_(chosen)).values(payload={})
        else:
            statement = delete(table).where(table.c.id.in_(chosen))
        ids = self.execute(statement.returning(table.c.id)).scalars().all()
        return len(ids), max(ids, default=after)
