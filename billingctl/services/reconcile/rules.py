"""Reconcile's rules: the checks it names, how long follow-up work may take, how a violation is counted
and what names its subject (what `reconcile ack` takes)."""

from __future__ import annotations

from datetime import timedelta

TOO_RECENT = timedelta(seconds=15)
GRACE = timedelta(hours=1)  # follow-up work (provider record, activation) the jobs finish well within
REFUND_WINDOW = timedelta(days=35)
# A refund the processor has not decided yet excuses a closed purchase's unreversed credits this long
# (Primer: refunds "could take days"; decision 233); past it, the purchase is named again.
REFUND_PENDING_MAX = timedelta(days=7)
LIMIT = 100  # violations listed per check (all are counted)
# The subject of a violation: the first id it names, in this order (what `reconcile ack` names).
SUBJECT_KEYS = ("invoice_id", "payment_id", "subscription_id", "dispute_id", "ledger_id", "user_id", "order_id")
# Every check, from our books and the two others (the runbook's table names each).
CHECKS = (
    "ledger_without_purchase", "refund_without_purchase", "ledger_unknown_reason", "refund_exceeds_credit",
    "credits_differ_from_ledger", "invoice_paid_twice", "term_paid_twice", "two_live_subscriptions",
    "recorded_not_on_provider_invoice",
    "closed_purchase_not_reversed", "dispute_lost_not_reversed", "paid_not_active", "credits_after_freeze",
    "charge_in_flight_too_long", "dunning_unfinished", "quota_over_limit",
    "payment_unrecorded", "payment_recorded_and_refunded", "payment_amount_differs", "order_charged_twice",
    "refund_not_reversed", "refunded_at_both_consoles", "payment_kept_after_refund",
    "payment_on_two_invoices", "invoice_credits_not_one_term", "purchase_on_unpaid_invoice", "subscription_differs",
    "subscription_missing_at_provider",
)


class Findings:
    """The violations of one run: at most LIMIT listed per check, all counted, acknowledged ones apart.
    `hold`: the oldest time at which a counted violation's external record sits (an incremental run's
    window must still reach it next time, so an open violation never drops out of the daily report)."""

    def __init__(self, acknowledged: dict[tuple[str, str], str]):
        self.violations: list[dict] = []
        self.acknowledged: list[dict] = []
        self.counts: dict[str, int] = {}
        self._acks = acknowledged
        self._seen: set[str] = set()
        self.hold = None

    def add(self, check: str, violation: dict, at=None) -> None:
        name = check.split(":")[0]
        found = {"check": name, **violation}
        seen = repr(sorted((k, v) for k, v in found.items() if k != "detail"))
        if seen in self._seen:  # one violation seen in two books (our copy and the provider's)
            return
        self._seen.add(seen)
        reason = self._acks.get((name, subject(found)))
        if reason is not None:
            self.acknowledged.append({**found, "acknowledged": reason})
            return
        if at is not None and (self.hold is None or at < self.hold):
            self.hold = at
        self.counts[check] = self.counts.get(check, 0) + 1
        if self.counts[check] <= LIMIT:
            self.violations.append(found)


def subject(violation: dict) -> str:
    """What `reconcile ack` names: the violation's first id (and its plan, where it names one)."""
    first = next((str(violation[k]) for k in SUBJECT_KEYS if violation.get(k)), "")
    plan = violation.get("item_price_id")
    return f"{first}:{plan}" if plan else first
