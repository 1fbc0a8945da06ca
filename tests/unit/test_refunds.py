"""The credits a refund takes back, and when two consoles' refund totals disagree (pure functions)."""

import pytest

from billingctl.domain.refunds import apart_at_both_consoles, credits_to_reverse


@pytest.mark.parametrize(("orchestrator", "provider", "apart"), [
    (0, 0, False),      # nothing given back
    (0, 500, False),    # recorded at the provider alone (a wire refund, a cheque's): its books alone
    (999, 999, False),  # the workflow's mirror of the card refund
    (999, 1332, True),  # more at the provider: a refund recorded there besides the mirror
    (999, 0, True),     # the mirror never landed
    (300, 999, True),
])
def test_totals_apart_at_both_consoles(orchestrator, provider, apart):
    assert apart_at_both_consoles(orchestrator, provider) is apart


@pytest.mark.parametrize(("refunded", "expected"), [(0, 0), (500, 1000), (999, 1998), (5000, 1998)])
def test_a_refund_takes_back_its_share_of_credits_once(refunded, expected):
    assert credits_to_reverse(1998, 999, 0, refunded) == expected


def test_an_excess_returned_for_a_part_paid_invoice_takes_back_nothing():
    assert credits_to_reverse(2000, 1000, 200, 200) == 0
    assert credits_to_reverse(2000, 1000, 200, 600) == 1000  # 400 of the 800 that paid the term
