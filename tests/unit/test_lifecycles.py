"""Issue 34: every (state, event) pair of each money aggregate's table (domain.lifecycle): each allowed
transition is taken, each other is refused as stale news or as illegal, and the tables cover every
status the orchestrator documents."""

import itertools

import pytest

from billingctl.domain import lifecycle as lc

pytestmark = pytest.mark.unit

PRIMER_PAYMENT_STATUSES = ("PENDING", "AUTHORIZED", "SETTLING", "PARTIALLY_SETTLED", "SETTLED", "DECLINED", "FAILED",
                           "CANCELLED")


def test_every_status_the_orchestrator_documents_has_a_state_and_nothing_else_does():
    assert sorted(lc.payment_status(s) for s in PRIMER_PAYMENT_STATUSES) == sorted(lc.PAYMENT.states)
    assert lc.payment_status("SOMETHING_NEW") is None and lc.payment_status(None) is None
    for kind, status in itertools.product(lc.DISPUTE_TYPES, lc.DISPUTE_STATUSES):
        assert lc.dispute_state(kind, status) in lc.DISPUTE.states, (kind, status)
    assert lc.dispute_state("DISPUTE", "MAYBE") is None and lc.dispute_state("APPEAL", "OPEN") is None


@pytest.mark.parametrize("machine", lc.LIFECYCLES, ids=lambda m: m.name)
def test_every_pair_is_taken_when_allowed_and_refused_otherwise(machine):
    for source, target in itertools.product((None, *machine.states), machine.states):
        step = machine.step(source, target)
        if target in machine.edges.get(source, ()):
            assert step == lc.Step.APPLY, (source, target)
        elif source == target:
            assert step == lc.Step.SAME, (source, target)
        elif machine.stale_news and source is not None and source in machine.reachable(target):
            assert step == lc.Step.STALE, (source, target)  # older news than what we hold
        elif machine.snapshots and source is not None and target in machine.reachable(source):
            assert step == lc.Step.APPLY, (source, target)  # a copy past steps not read yet (decision 225)
        else:
            assert step == lc.Step.ILLEGAL, (source, target)
        if source is not None:  # the conditional update's IN list is exactly the table's from-states
            direct = target in machine.edges.get(source, ())
            assert direct == (source in machine.sources(target)), (source, target)
    assert machine.step(machine.states[0], "no_such_state") == lc.Step.ILLEGAL


@pytest.mark.parametrize("machine", lc.LIFECYCLES, ids=lambda m: m.name)
def test_final_states_have_no_way_out_and_every_state_is_reachable(machine):
    for state in machine.final:
        assert machine.edges.get(state, ()) == ()
    assert set(machine.states) <= machine.reachable(None)  # type: ignore[arg-type]


def test_the_payment_table_never_takes_captured_money_back_and_reads_contradictions_as_illegal():
    assert lc.PAYMENT.step("captured", "declined") == lc.Step.ILLEGAL
    assert lc.PAYMENT.step("declined", "captured") == lc.Step.ILLEGAL
    assert lc.PAYMENT.step("captured", "pending") == lc.Step.STALE  # a PENDING webhook delivered late
    assert lc.PAYMENT.step("partially_captured", "captured") == lc.Step.APPLY
    assert lc.PAYMENT.step("settling", "cancelled") == lc.Step.ILLEGAL  # a settling payment cannot be voided


def test_the_dunning_table_counts_a_repeated_decline_as_a_new_attempt_and_ends_on_its_finals():
    assert lc.DUNNING.step("declined", "declined") == lc.Step.APPLY
    assert lc.DUNNING.step("pending", "error") == lc.Step.ILLEGAL  # a charge in flight ends only on an outcome
    assert lc.DUNNING.step("pending", "pending") == lc.Step.SAME
    for final in lc.DUNNING.final:
        assert lc.DUNNING.step(final, "pending") != lc.Step.APPLY


def test_a_won_dispute_may_reopen_in_pre_arbitration_and_a_lost_one_is_final():
    assert lc.DISPUTE.step("won", "open") == lc.Step.APPLY
    assert lc.dispute_state("PREARBITRATION", "OPEN") == "open"
    assert lc.DISPUTE.step("lost", "won") == lc.Step.STALE
    assert lc.dispute_state("DISPUTE", "ACCEPTED") == "lost" and lc.dispute_state("RETRIEVAL", "EXPIRED") == "open"


def test_a_decided_dispute_opens_again_only_with_a_later_stage():
    assert lc.dispute_step("won", "DISPUTE", "open", "PREARBITRATION") == lc.Step.APPLY
    assert lc.dispute_step("closed", "RETRIEVAL", "open", "DISPUTE") == lc.Step.APPLY
    assert lc.dispute_step("won", "DISPUTE", "open", "DISPUTE") == lc.Step.STALE  # CHALLENGED retried late
    assert lc.dispute_step("closed", "DISPUTE", "open", "DISPUTE") == lc.Step.STALE
    assert lc.dispute_step("open", "PREARBITRATION", "won", "DISPUTE") == lc.Step.STALE  # an earlier stage's
    assert lc.dispute_step("open", "PREARBITRATION", "open", "RETRIEVAL") == lc.Step.STALE
    assert lc.dispute_step("won", "DISPUTE", "open", None) == lc.Step.STALE  # DISPUTE.OPENED names no stage
    assert lc.dispute_step(None, None, "open", None) == lc.Step.APPLY
    assert lc.dispute_step("open", None, "won", "RETRIEVAL") == lc.Step.APPLY  # opened by DISPUTE.OPENED
    assert lc.dispute_step("open", "DISPUTE", "open", "DISPUTE") == lc.Step.SAME
    assert lc.dispute_step("lost", "DISPUTE", "won", "PREARBITRATION") == lc.Step.STALE  # lost stays final


def test_a_later_stage_may_be_decided_before_its_opening_is_read_never_the_decided_stage_again():
    """Decision 227: deliveries arrive in any order, so a later stage's decision may be read first."""
    assert lc.dispute_step("closed", "RETRIEVAL", "lost", "DISPUTE") == lc.Step.APPLY
    assert lc.dispute_step("closed", "RETRIEVAL", "won", "DISPUTE") == lc.Step.APPLY
    assert lc.dispute_step("won", "DISPUTE", "closed", "PREARBITRATION") == lc.Step.APPLY
    assert lc.dispute_step("closed", "RETRIEVAL", "lost", "RETRIEVAL") == lc.Step.ILLEGAL  # decided twice
    assert lc.dispute_step("won", "DISPUTE", "closed", "DISPUTE") == lc.Step.ILLEGAL
    assert lc.dispute_step("won", "DISPUTE", "lost", "DISPUTE") == lc.Step.APPLY  # as before
    assert lc.dispute_step("lost", "DISPUTE", "open", "PREARBITRATION") == lc.Step.STALE  # its late opening


def test_a_provider_copy_may_skip_steps_but_never_reach_what_no_step_reaches():
    """Decision 225: the provider's subscription and invoice are copies, each the resource at one instant;
    the steps between two copies we read are each allowed, so the jump is; a status no sequence of steps
    reaches from ours contradicts it. Copies fed by notifications (payments, disputes) keep their tables."""
    assert lc.SUBSCRIPTION.snapshots and lc.INVOICE.snapshots
    assert not any(m.snapshots for m in (lc.PAYMENT, lc.DUNNING, lc.DISPUTE, lc.ORPHAN))
    assert lc.SUBSCRIPTION.step("cancelled", "paused") == lc.Step.APPLY  # reactivated, then paused
    assert lc.SUBSCRIPTION.step("future", "paused") == lc.Step.APPLY  # started, then paused
    assert lc.SUBSCRIPTION.step("cancelled", "future") == lc.Step.ILLEGAL  # nothing becomes future again
    assert lc.SUBSCRIPTION.step("transferred", "active") == lc.Step.ILLEGAL  # final
    assert lc.INVOICE.step("paid", "voided") == lc.Step.APPLY  # its payment removed, then voided (decision 188)
    assert lc.INVOICE.step("voided", "paid") == lc.Step.ILLEGAL  # a voided invoice is final
    assert lc.INVOICE.step("paid", "pending") == lc.Step.ILLEGAL


def test_the_diagrams_are_generated_from_the_tables():
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "lifecycles.md").read_text()
    for machine in lc.LIFECYCLES:
        assert machine.mermaid() in text, f"regenerate docs/lifecycles.md: {machine.name} changed"
