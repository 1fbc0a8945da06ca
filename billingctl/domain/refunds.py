"""The credits a refund takes back (spec section 2: partial refunds reverse their share; nothing is
reversed twice). Pure: the caller supplies the purchase's facts and the orchestrator's cumulative
refunded amount."""

from __future__ import annotations


def share_refunded(amount: int, returned_excess: int, refunded_total: int) -> tuple[int, int]:
    """(refunded share, what paid the term) of a payment: an excess given back because its invoice was
    part-paid at the provider (decision 180) paid no term, so it is not part of either."""
    paying = max(int(amount or 0) - int(returned_excess or 0), 1)
    return min(max(int(refunded_total) - int(returned_excess or 0), 0), paying), paying


def credits_to_reverse(credits: int, amount: int, returned_excess: int, refunded_total: int) -> int:
    """All the credits a payment's refunds so far take back: the same share of its credits."""
    share, paying = share_refunded(amount, returned_excess, refunded_total)
    return (int(credits) * share) // paying


def apart_at_both_consoles(at_orchestrator: int, at_provider: int) -> bool:
    """A payment refunded at both consoles whose totals disagree (decision 218): the orchestrator gave some
    back and the provider's books hold more (refunds recorded there besides the workflow's mirror) or less
    (a mirror that never landed). Equal totals are the mirror alone."""
    return 0 < int(at_orchestrator) != int(at_provider)
