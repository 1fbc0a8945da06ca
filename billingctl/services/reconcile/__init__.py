"""Reconcile: the invariant checker, over three sets of books (issue 36).

From our own books (each check one SQL query, `adapters.db.books`; only violations are held):
- every credit-ledger entry matches a purchase or a reversal of one, never more reversed than credited;
  users.credits equals the user's ledger sum;
- no invoice paid by two standing purchases (a refunded or closed duplicate is not counted);
- at most one billed subscription per customer and plan;
- every purchase recorded on the provider's invoice within the grace, whoever owns it (orphan recovery's
  own queue excepted while it works); a closed purchase reversed; a lost dispute reversed;
- no subscription paid but still waiting for activation; no credits after a freeze;
- no renewal charge in flight past its age limit, every renewal attempt ended on its outcome;
- no NSFW authorization-quota window over its limit.
From the orchestrator's books (`orchestrator_books`): every captured payment recorded once or owned by
review, for the amount and currency of its order; no order charged twice; refunds reversed; no payment in
flight past its age limit.
From the provider's books (`provider_books`): one orchestrator payment on at most one invoice, every payment
we marked recorded on one; each paid invoice holds exactly one term's credits and every standing purchase
is on a paid invoice; at most one live subscription per customer and plan; every local active subscription
active there.

Incremental (`window`): each run reads the external lists from a watermark (the last run's start, less an
overlap), so its calls grow with the window, not with history; a full pass runs when asked (`--full`),
when there is no watermark, and at least weekly. A violation a person judged is acknowledged
(`reconcile ack`, `acks`): it is still reported, under `acknowledged`, and no longer counts."""

from __future__ import annotations

from billingctl.domain.batch import BatchResult
from billingctl.services.reconcile.rules import CHECKS, GRACE, LIMIT, REFUND_WINDOW, TOO_RECENT, Findings

__all__ = ["CHECKS", "GRACE", "LIMIT", "REFUND_WINDOW", "TOO_RECENT", "Findings", "reconcile"]


def reconcile(container, since=None, progress=None, full: bool = False) -> dict:
    from billingctl.services.reconcile import acks, orchestrator_books, provider_books, window
    from billingctl.services.reconcile.local_books import check_local

    now = container.clock.now()
    span = window.choose(container, now, since, full)
    found = Findings(acks.current(container))
    checked = check_local(container, now, found, span.since)
    checked["payments"] = orchestrator_books.check(container, now, span, found.add, progress)
    checked["subscriptions_at_provider"] = provider_books.check(container, now, span, found.add, progress)

    total = sum(found.counts.values())
    container.metrics.reconcile_violations.set(total)
    _store_violations(container, total)
    window.advance(container, now, span, found.hold)
    # Each violation is a failed item: the reconcile job exits 5 while any stands.
    return BatchResult({"window": span.describe(), "checked": checked, "violations": found.violations,
                        "counts": found.counts, "acknowledged": found.acknowledged, "ok": not found.counts},
                       done=checked["payments"], failed=len(found.violations), errors=found.violations)


STATE_KEY = "reconcile_violations"


def _store_violations(container, count: int) -> None:
    """The last run's count, for the scrape (billing_reconcile_violations is live state, not a max over
    the processes that ever ran reconcile)."""
    from billingctl.services.cursors import write_value

    write_value(container, STATE_KEY, str(count))
