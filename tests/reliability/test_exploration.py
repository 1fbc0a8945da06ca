"""Model-based exploration of the whole system in process (issue 36, item 4): a Hypothesis stateful test
chooses histories of customers, the outside world, operators, jobs, faults and clocks that disagree, on
PostgreSQL with the sandbox in process, and after each audit step checks the invariants from the outside
world's books (what the orchestrator charged, what the provider holds as paid and live) and ours, with
`reconcile` required to agree (no false clean, no false alarm). At every moment, no aggregate was asked
for a step outside its table (domain.lifecycle): the code counts and alerts such a step, and a history
that makes one is a finding.

The customers and the world are the month simulation's model (`tests/simulation/test_month.py`), each of
its actions a rule with Hypothesis choosing the action, its order and every choice inside it; the rules it
lacks are here: two browser tabs checking out one plan at once, a payment entered at the provider, partial
settles, refunds that take time and may be refused, dispute outcomes, a freeze that voids invoices, an
unfreeze, an operator resolving or retrying an orphan, recording or refunding any payment, activating
any subscription and replaying any stored event, `sync-all`, each job on its own, and our clock moving
ahead of or behind the sandbox's.

Each history runs on the embedded container (the sandbox in process) or on production's (the NSFW quota
enforced, Redis, the sandbox over HTTP, a customer under quota pressure: the renewal that meets a full
quota). `make test` runs EXPLORE_EXAMPLES (8) histories on each; `make explore` runs 2,000."""

from __future__ import annotations

import os
import random
import threading
from collections import Counter
from contextlib import nullcontext
from datetime import UTC
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import func, select

from billingctl.adapters.db.tables import dunning_attempt, event_inbox, purchase, subscription
from billingctl.bootstrap import Container
from billingctl.domain import errors as e
from billingctl.domain import lifecycle
from billingctl.domain.clock import ManualClock
from billingctl.sandbox.model import IN_FLIGHT, SandboxError
from billingctl.services import alerts, checkout, events, orphans, payments, renewals, webhook_events
from billingctl.services.sync import sync_all
from billingctl.services.users import freeze, unfreeze
from tests.conftest import _truncate_postgres
from tests.helpers import assert_books_hold_at_every_moment, table_away
from tests.simulation.test_month import PLANS, Model, renewal_charge

pytestmark = pytest.mark.reliability
EXAMPLES = int(os.environ.get("EXPLORE_EXAMPLES", 8))
LONG_RUN = EXAMPLES > 8  # `make explore` or a run by hand: random, each history afresh; `make test`'s is derandomized
# Two containers: the embedded one (the sandbox in process), and production's (tests.helpers.ProductionStack:
# the NSFW quota enforced, real secrets, Redis, the sandbox reached over HTTP) with a customer under quota
# pressure. EXPLORE_MODE (in_process or production) runs one of them only, as a long run does.
MODES = [m for m in ("in_process", "production") if os.environ.get("EXPLORE_MODE", m) == m]
STEPS = int(os.environ.get("EXPLORE_STEPS", 30))
USERS = ("ex_0", "ex_1", "ex_2")
JOBS = {"poll": events.poll, "orphans": orphans.run_orphans, "activations": payments.retry_pending,
        "renewals": renewals.run_renewals, "cleanup": checkout.cleanup_expired, "deliver": alerts.deliver_outbox,
        "sync-all": lambda c: sync_all(c, None)}
SPANS = (16, 61, 15 * 60, 4 * 3600, 86400, 31 * 86400)  # a renewal falls due after a month
RUNNING = ("active", "non_renewing")  # a term that ends: renewed, or cancelled when support scheduled it
SKEWS = (-90, -7, 0, 7, 90)  # seconds our clock runs ahead of the sandbox's (negative: behind)
# What the processor does with a renewal charge (`Exploration.ticks`): its first, each retry's, and the
# retry of one the quota blocked.
PROCESSOR = ("answers", "answers later", "moves it on", "PENDING", "AUTHORIZED", "declines", "is unreachable",
             "finds no payment method", "meets a lock it cannot read", "loses its answer",
             "settles before its answer", "settles in part")
FIGURES = {"examples": 0, "steps": 0, "audits": 0, "payments": 0, "refunds": 0, "refused_refunds": 0,
           "excesses_returned": 0, "payments_removed": 0, "charges_hung": 0, "hung_charges_ended": 0,
           "invoices_voids": 0, "invoices_deletes": 0, "invoices_credits": 0, "refunds_at_provider": 0,
           "subscriptions_deleted": 0, "replays": 0, "quota_refusals": 0, "quota_blocked": 0}
CONTEXT: dict = {}
STEPS_SEEN: Counter = Counter()  # (lifecycle, from, to, step) of every step an aggregate was asked to take
HISTORY_EDGES: set = set()  # the edges the current history applied
# Each step drawn with a seed, as the rule drew it (its words and its seed, one of 2**32): Hypothesis makes
# histories by copying steps it ran, with their arguments, elsewhere in a history or into the next one (and
# draws a boundary value such as 0 more often than chance), so the run names how many of them differ.
SEEDED_STEPS: Counter = Counter()
# A step outside a table is an error the code counts and alerts; in a history it is a finding. (Decision 188's
# paid -> voided, a void read before the removal of the invoice's payment, is a copy past a step not yet read:
# applied, decision 225.)
ILLEGAL_NOW: list = []  # the steps outside a table the current history asked for


def _record_steps(monkeypatch) -> None:
    """Every transition the code asks a table for, counted, so that the run can name the edges of each table
    (domain.lifecycle) no history reached: the world lacks an action there, and a crossing may hide."""
    step = lifecycle.Lifecycle.step

    def counted(machine, source, target):
        result = step(machine, source, target)
        STEPS_SEEN[machine.name, source, target, result] += 1
        if result == lifecycle.Step.ILLEGAL:
            ILLEGAL_NOW.append(f"{machine.name}: {source} -> {target}")
        if result == lifecycle.Step.APPLY and source is not None:
            HISTORY_EDGES.add((machine.name, source, target))
        return result

    monkeypatch.setattr(lifecycle.Lifecycle, "step", counted)


def _fresh_histories_only(monkeypatch) -> None:
    """A long run draws each history afresh (decision 242). Once its health checks are over (ten histories),
    Hypothesis runs up to five copies of every history it draws, each with one step replaced by a copy of
    another, its arguments with it (`ConjectureRunner.generate_mutations_from`, no setting turns it off): in a random
    embedded run of 2026-12-03, 368 of 1,790 steps drawn with a seed were distinct after 113 histories, and
    the 40 minutes of a long run went mostly to histories already run but for one step. The targeted search
    (`target` in `teardown`) and the shrinking of a failure are untouched; `make test`'s 8 histories never
    reach the copies. If Hypothesis renames the method, this fails loudly rather than running the copies."""
    from hypothesis.internal.conjecture.engine import ConjectureRunner

    monkeypatch.setattr(ConjectureRunner, "generate_mutations_from", lambda runner, data: None)


def _naive_utc(moment):
    return moment.astimezone(UTC).replace(tzinfo=None) if moment.tzinfo else moment


def _edges_report() -> list[str]:
    """One line per table: how many of its edges between states the histories applied (a row's opening is
    an insert some paths make without asking the table), the ones they never did, and any step outside the
    table (each also counted and alerted by the code)."""
    lines = []
    for machine in lifecycle.LIFECYCLES:
        edges = [(s, t) for s, targets in machine.edges.items() if s is not None for t in targets]
        applied = {(s, t) for (name, s, t, r) in STEPS_SEEN if name == machine.name and r == lifecycle.Step.APPLY}
        missed = [f"{s}->{t}" for s, t in edges if (s, t) not in applied]
        illegal = sorted(f"{s or 'new'}->{t}" for (name, s, t, r) in STEPS_SEEN
                         if name == machine.name and r == lifecycle.Step.ILLEGAL)
        lines.append(f"  {machine.name}: {len(edges) - len(missed)} of {len(edges)} edges applied"
                     + (f"; never: {', '.join(missed)}" if missed else "")
                     + (f"; outside the table: {', '.join(illegal)}" if illegal else ""))
    return lines


def _summary() -> str:
    """The run's figures and its transitions; with EXPLORE_REPORT set, also written to that file after each
    history, so that a long run stopped by hand still says what it reached."""
    return (f"exploration: {FIGURES['examples']} histories, {FIGURES['steps']} steps (of the "
            f"{SEEDED_STEPS.total()} drawn with a seed, {len(SEEDED_STEPS)} distinct), {FIGURES['audits']} audits, "
            f"{FIGURES['payments']} payments at the orchestrator, {FIGURES['refunds']} refunds "
            f"({FIGURES['refused_refunds']} refused by the processor), {FIGURES['excesses_returned']} card payments "
            f"that paid the rest of an invoice paid in part at the provider, {FIGURES['payments_removed']} payments "
            f"finance removed from their invoice, {FIGURES['charges_hung']} renewal charges the processor never "
            f"answered ({FIGURES['hung_charges_ended']} ended by our age limit), {FIGURES['invoices_voids']} "
            f"unpaid invoices finance voided, {FIGURES['invoices_deletes']} it deleted and "
            f"{FIGURES['invoices_credits']} it credited, {FIGURES['refunds_at_provider']} refunds it recorded "
            f"at the provider, {FIGURES['subscriptions_deleted']} subscriptions support deleted there, "
            f"{FIGURES['replays']} events an operator replayed, {FIGURES['quota_refusals']} checkouts the quota "
            f"refused and {FIGURES['quota_blocked']} renewal attempts it blocked (production only)\n"
            "transitions the histories asked of each table:\n" + "\n".join(_edges_report()))


def _dispute_ended(kind: str, status: str) -> bool:
    """A dispute no processor takes further: lost (a chargeback or pre-arbitration accepted or let expire),
    or closed at its last stage. A retrieval that expired may still become a chargeback, and so may one
    accepted or cancelled (closed -> open, by the next stage); a won one may go to pre-arbitration."""
    state = lifecycle.dispute_state(kind, status)
    return state == "lost" or (state == "closed" and kind == lifecycle.DISPUTE_TYPES[-1])


class Exploration(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        FIGURES["examples"] += 1
        ILLEGAL_NOW.clear()
        _truncate_postgres(CONTEXT["db_url"])
        tmp = Path(CONTEXT["tmp"]) / f"history-{FIGURES['examples']}"
        tmp.mkdir()
        self.stack = None
        if CONTEXT.get("production"):
            import redis

            from tests.helpers import ProductionStack
            from tests.simulation.test_month import ProductionModel

            client = redis.Redis.from_url(CONTEXT["redis_url"])
            client.flushdb()  # no breaker, budget or cache of the last history
            client.close()

            def production_settings(**kw):
                return CONTEXT["make_settings"](http_max_attempts=2, provider_rate_limit=1_000_000, **kw)

            self.stack = ProductionStack(production_settings, CONTEXT["db_url"], tmp, clock=ManualClock(),
                                         redis_url=CONTEXT["redis_url"]).__enter__()
            self.c = self.stack.container
            self.stack.sandbox.disputes_secret = self.c.settings.secret("orchestrator_disputes_secret")
            self.m = ProductionModel(random.Random(0), self.c, users=list(USERS))
            self.m.production_sandbox = self.stack.sandbox
        else:
            self.c = Container(CONTEXT["make_settings"](
                database_url=CONTEXT["db_url"], sandbox_db=str(tmp / "sandbox.db"), http_max_attempts=2,
                provider_rate_limit=1_000_000), clock=ManualClock())
            self.m = Model(random.Random(0), self.c, users=list(USERS))
        self.c.provider.http.sleep = self.c.orchestrator.http.sleep = lambda s: None
        self.m.advance(0)
        self.steps = 0
        self.audited_at = 0  # the step of the last audit
        HISTORY_EDGES.clear()

    def teardown(self):
        try:
            if self.steps:
                self.audit()
            # Hypothesis climbs towards histories that walk more of the tables' edges (targeted search):
            # drawn uniformly, a history of 30 steps seldom reaches an edge that needs three actions in order.
            target(float(len(HISTORY_EDGES)), label="table edges applied")
        finally:
            statuses = Counter(t["processorStatus"] for p in self.m.sandbox.store.all("payment")
                               for t in p.get("transactions") or [] if t["transactionType"] == "REFUND")
            FIGURES["refused_refunds"] += statuses["FAILED"]
            FIGURES["refunds"] += sum(statuses.values())
            FIGURES["payments"] += len(self.m.sandbox.store.all("payment"))
            with self.c.uow() as uow:  # card payments that paid the rest of an invoice a cheque paid in part
                FIGURES["excesses_returned"] += uow.execute(select(func.count()).select_from(purchase).where(
                    purchase.c.returned_excess > 0)).scalar_one()
                FIGURES["quota_blocked"] += uow.execute(select(func.count()).select_from(dunning_attempt).where(
                    dunning_attempt.c.status == "quota_blocked")).scalar_one()
            FIGURES["quota_refusals"] += sum(1 for line in self.m.trace if "refused (quota_exhausted)" in line)
            FIGURES["payments_removed"] += sum(1 for line in self.m.trace if "finance removes" in line
                                               and "refused" not in line)
            for verb in ("voids", "deletes", "credits"):
                FIGURES[f"invoices_{verb}"] += sum(1 for line in self.m.trace if f"finance {verb} inv" in line
                                                   and "refused" not in line)
            FIGURES["refunds_at_provider"] += sum(1 for line in self.m.trace if "finance records a refund of" in line)
            FIGURES["subscriptions_deleted"] += len(self.m.deleted)
            FIGURES["replays"] += sum(1 for line in self.m.trace if "  events replay " in line)
            FIGURES["charges_hung"] += len(self.m.hung)
            FIGURES["hung_charges_ended"] += sum(1 for p in self.m.sandbox.payments() if p["id"] in self.m.hung
                                                 and p["status"] not in ("PENDING", "AUTHORIZED"))
            if self.stack is not None:
                self.stack.__exit__(None, None, None)
            else:
                self.c.close()
            if report := os.environ.get("EXPLORE_REPORT"):
                Path(report).write_text(_summary() + "\n")

    def step(self, seed: int, text: str) -> random.Random:
        FIGURES["steps"] += 1
        if seed:
            SEEDED_STEPS[text, seed] += 1
        self.steps += 1
        self.m.rng.seed(seed)
        self.m.note(text)
        return self.m.rng

    @initialize(skew=st.sampled_from(SKEWS))
    def clocks(self, skew):
        """The history starts with our clock `skew` seconds from the sandbox's. Before, the skew took effect
        at the first step that moved time: a step back of up to 90 s in the middle of the history that no
        step names. A breaker opened before that step stays open 90 s longer on our clock; one history of 60
        (2026-11-27, skew -90, not reproduced by replaying its printed steps) failed its quiet hours on an
        open breaker, which this step back would explain."""
        self.m.skew = skew
        self.m.advance(0)

    # ---- the customers and the outside world (the month's model) -------------------------------------
    # Checking out, paying and refunding are rules of their own: as three of the world's fourteen actions,
    # drawn with two dozen other rules, histories of 50 steps held 13 payments in 47 histories (2026-11-27),
    # and the money paths were hardly explored.
    @rule(seed=st.integers(0, 2**32))
    def customer_checks_out(self, seed):
        self.step(seed, "world: checkout")
        self.m.checkout()

    @precondition(lambda self: self.m.open_checkouts)
    @rule(seed=st.integers(0, 2**32))
    def customer_pays(self, seed):
        self.step(seed, "world: pay")
        self.m.pay()

    @rule(seed=st.integers(0, 2**32))
    def customer_buys(self, seed):
        """The common path: a checkout paid at once (its delivery lost, duplicated or reordered, as `pay`)."""
        self.step(seed, "world: checkout and pay")
        self.m.checkout()
        self.m.pay()

    @precondition(lambda self: self.stack is not None)
    @rule(seed=st.integers(0, 2**32))
    def quota_pressure(self, seed):
        """Production only: a customer keeps starting NSFW checkouts declined in the payment form, and may
        pay for one plan: its renewals then meet a full quota."""
        self.step(seed, "world: quota pressure")
        self.m.pressure()

    @rule(seed=st.integers(0, 2**32))
    def refund_at_the_orchestrator(self, seed):
        """Support refunds a payment, in full or in part, at the orchestrator's console."""
        self.step(seed, "world: refund")
        self.m.refund()

    def act(self, action: str, seed: int) -> None:
        self.step(seed, f"world: {action}")
        getattr(self.m, action)()

    # The month's other actions, one rule per actor: as one rule of twenty actions, each was drawn about once
    # in 560 steps, and 306 histories (2026-11-28) never paused, resumed or reactivated a subscription.
    @rule(action=st.sampled_from(["abandon", "pay_late", "expire_card", "remove_payment_methods", "payment_terms"]),
          seed=st.integers(0, 2**32))
    def world(self, action, seed):
        self.act(action, seed)

    @rule(action=st.sampled_from(["declines", "outage", "dispute", "charges_in_flight", "finish_charges",
                                  "hang_charge"]), seed=st.integers(0, 2**32))
    def the_processor(self, action, seed):
        self.act(action, seed)

    CONSOLE = ("cancel_at_provider", "pause_at_provider", "resume_at_provider", "reactivate_at_provider",
               "cancel_unpaid_at_provider", "cancel_at_term_end_at_provider",
               "remove_scheduled_cancellation_at_provider", "change_term_end_at_provider", "write_off")

    # The console action that brings a subscription to the state another applies to, and those that apply to
    # a running term (active or non_renewing).
    LEADS_TO = {"resume_at_provider": "pause_at_provider",
                "remove_scheduled_cancellation_at_provider": "cancel_at_term_end_at_provider",
                "reactivate_at_provider": "cancel_at_provider"}
    ON_A_RUNNING_TERM = ("pause_at_provider", "cancel_at_term_end_at_provider", "change_term_end_at_provider",
                         "cancel_at_provider")

    @rule(action=st.sampled_from(CONSOLE), seed=st.integers(0, 2**32))
    def support_at_the_providers_console(self, action, seed):
        """Support's action; when no subscription is in a state it applies to, first the action that brings
        one there (a pause before a resume, a scheduled cancel before taking it back, a cancel before a
        reactivation; a customer subscribing first when no term is running), and the action itself seconds
        to hours later, the jobs running between; else another that applies.
        Each needs its own state: drawn blind, 107 histories of 36 steps never scheduled a cancel at a
        term's end, took one back or resumed a paused subscription (2026-11-28); with any other action
        instead, 30 embedded histories of 2026-12-03 scheduled one cancel at a term's end, took none back,
        paused and resumed once and applied none of the subscription's steps out of non_renewing, while
        the fallback cancelled a subscription 25 times (a checkout's, still future, as often as not)."""
        rng = self.step(seed, f"world: {action}")
        if action == "cancel_unpaid_at_provider":
            self.an_unpaid_renewal(rng)
        chain = [action]  # the action, then what leads to it, then what leads to that
        while chain[-1] in self.LEADS_TO:
            chain.append(self.LEADS_TO[chain[-1]])
        done = next((i for i, name in enumerate(chain) if self.console(name)), None)
        if done is None and chain[-1] in self.ON_A_RUNNING_TERM and self.running_subscriptions() and \
                self.console(chain[-1]):
            done = len(chain) - 1
        if done is not None:
            for name in reversed(chain[:done]):  # support comes back to it later: the jobs run meanwhile
                self.m.advance(rng.choice(SPANS[:4]))
                self.m.jobs()
                self.console(name)
            return
        others = [a for a in self.CONSOLE if a not in chain]
        rng.shuffle(others)
        any(self.console(name) for name in others)

    def an_unpaid_renewal(self, rng: random.Random) -> None:
        """A renewal invoice of an active subscription left due, for the provider's dunning to end on
        (`cancel_unpaid_at_provider`, decision 244); with none, a running term ends and its customer's issuer
        declines the renewal (as "declines": until the world says otherwise). Drawn blind, the action found
        no such invoice in 31 production histories of 2026-12-03: an audit ends every retry schedule."""
        active = {s["id"] for s in self.m.subscriptions() if s["status"] == "active"}
        if any(i["status"] == "payment_due" and i["subscription_id"] in active for i in self.m.payable()):
            return
        running = [s for s in self.running_subscriptions() if s["status"] == "active"]
        if running:
            sub = rng.choice(running)
            self.m.note(f"  {sub['id']}'s renewal is declined first")
            self.ticks("declines", rng, sub["customer_id"],
                       max(sub["current_term_end"] - self.m.sandbox.now(), 0) + 61)

    def console(self, name: str) -> bool:
        """Support's action `name`, if a subscription or invoice is in a state it applies to."""
        noted = len(self.m.trace)
        getattr(self.m, name)()
        return len(self.m.trace) > noted

    def running_subscriptions(self) -> list[dict]:
        """The subscriptions whose term runs; with none, a customer subscribes first (a checkout paid, its
        notification delivered, the jobs run)."""
        running = [s for s in self.m.subscriptions() if s["status"] in RUNNING]
        if not running:
            self.m.note("  a customer subscribes first")
            self.m.checkout()
            self.m.pay("deliver")
            self.m.advance(61)
            self.m.jobs()
            running = [s for s in self.m.subscriptions() if s["status"] in RUNNING]
        return running

    @rule(action=st.sampled_from(["freeze", "cancel_by_operator"]), seed=st.integers(0, 2**32))
    def an_operator(self, action, seed):
        self.act(action, seed)

    @rule(user=st.sampled_from(USERS), plan=st.sampled_from(PLANS))
    def two_tabs(self, user, plan):
        """One customer checks out one plan from two browser tabs at once."""
        self.step(0, f"two tabs {user} {plan}")
        answers, errors = [], []
        barrier = threading.Barrier(2)

        def tab():
            try:
                barrier.wait(10)
                answers.append(checkout.create_checkout(self.c, user, plan))
            except e.BillingError as exc:
                errors.append(exc.code)

        threads = [threading.Thread(target=tab) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len({a["order_id"] for a in answers}) <= 1, answers  # one checkout, whichever tab asked
        self.m.open_checkouts.extend(answers[:1])

    @rule(seed=st.integers(0, 2**32), part=st.sampled_from([1, 4]), late=st.booleans())
    def payment_entered_at_the_provider(self, seed, part, late):
        """Finance records a cheque on an unpaid invoice at the provider's console: for what is due, or for
        a quarter of it (decision 180). `late`: on an invoice the provider's offline dunning has ended
        (not_paid, its subscription kept or cancelled; one is made first when none is): drawn among every
        unpaid invoice, none of the 237 production histories of the forty-second session's last run paid one."""
        rng = self.step(seed, "cheque at the provider" + ("" if part == 1 else f" for 1/{part} of what is due")
                        + (" after the provider's dunning ended" if late else ""))
        if late and not any(i["status"] == "not_paid" for i in self.m.payable()):
            self.an_unpaid_renewal(rng)
            self.m.cancel_unpaid_at_provider()
            self.m.advance(rng.choice(SPANS[:4]))
            self.m.jobs()
        due = [i for i in self.m.payable() if i["status"] in (("not_paid",) if late else ("payment_due", "not_paid"))]
        if due:
            invoice = rng.choice(due)
            self.m.sandbox.record_payment(invoice["id"], max(invoice["amount_due"] // part, 1),
                                          f"cheque {rng.randint(1, 999)}")

    @rule(seed=st.integers(0, 2**32), how=st.sampled_from(["void_unpaid", "delete_unpaid"]))
    def finance_ends_an_unpaid_invoice(self, seed, how):
        """Finance voids or deletes an unpaid invoice at the provider's console, whatever is in flight for it
        (decisions 200, 201): a rule of its own, since as one world action in twenty no deletion was reached
        in 310 histories."""
        self.step(seed, f"world: {how}")
        getattr(self.m, how)()

    @rule(seed=st.integers(0, 2**32), divisor=st.sampled_from([1, 3]))
    def finance_credits_an_unpaid_invoice(self, seed, divisor):
        """Finance credits all or a third of an unpaid invoice at the provider's console, whatever is in
        flight for it (decision 204)."""
        self.step(seed, f"world: credit 1/{divisor} of an unpaid invoice")
        self.m.credit_unpaid(divisor)

    @rule(seed=st.integers(0, 2**32))
    def support_deletes_a_subscription(self, seed):
        """Support deletes a subscription at the provider's console, with its invoices and transactions,
        whatever its state and whatever is in flight for it (decision 215): a rule of its own, since as one
        console action in ten it was drawn twice in 267 histories."""
        self.step(seed, "world: delete_at_provider")
        self.m.delete_at_provider()

    @rule(seed=st.integers(0, 2**32))
    def finance_removes_a_payment(self, seed):
        """Finance removes one of our payments from its paid invoice at the provider's console (decision
        184): a rule of its own, since one world action in twenty reached it in about one history in forty."""
        self.step(seed, "world: remove_payment")
        self.m.remove_payment()

    @rule(seed=st.integers(0, 2**32))
    def finance_refunds_at_the_provider(self, seed):
        """Finance pays a customer back by wire and records it on the paid invoice at the provider's console
        (decision 212)."""
        self.step(seed, "world: refund recorded at the provider")
        self.m.refund_at_provider()

    @rule(count=st.integers(1, 6))
    def provider_refuses_records(self, count):
        """The provider fails its next `count` payment records and nothing else: a paid checkout is activated
        and invoiced, and its record on the invoice waits (the window in which finance may enter a cheque on
        the invoice, decisions 179 and 180)."""
        self.step(0, f"provider fails record_payment x{count}")
        self.m.sandbox.store.add_fault("provider", "503", path="record_payment", count=count)

    @rule(seed=st.integers(0, 2**32))
    def partial_settles(self, seed):
        self.step(seed, "renewal charges settle in part")
        self.m.sandbox.async_charges("PARTIALLY_SETTLED")

    @rule(seed=st.integers(0, 2**32), fresh=st.booleans())
    def the_workflow_captures_in_parts(self, seed, fresh):
        """The workflow captures an authorized payment in parts, the first capture not its last (Primer's
        `final`): the payment is PARTIALLY_SETTLED, held for review, then captured in full (decision 226) or
        more of it, still in part (decision 238).
        `fresh`, or nothing authorized: a customer pays a new checkout whose workflow only authorizes first."""
        self.step(seed, "the workflow captures in parts")
        if fresh or not self.m.sandbox.payments("AUTHORIZED"):
            self.m.checkout()
            self.m.pay("uncaptured")
        self.m.capture_in_parts()

    @rule(seed=st.integers(0, 2**32), status=st.sampled_from(["DECLINED", "FAILED"]), fresh=st.booleans())
    def the_processor_refuses_a_capture(self, seed, status, fresh):
        """The processor will refuse the capture of an authorized payment (a checkout's whose workflow only
        authorized, or a renewal charge answered AUTHORIZED): whoever captures it next, the workflow or our
        jobs past the authorization limit, finds it DECLINED or FAILED (decision 261). No history of the
        forty-second session's runs (568) moved a payment from authorized to declined or failed.
        `fresh`, or nothing authorized: a customer pays a new checkout whose workflow only authorizes first."""
        rng = self.step(seed, f"the processor will refuse a capture ({status})")
        if fresh or not self.m.sandbox.payments("AUTHORIZED"):
            self.m.checkout()
            self.m.pay("uncaptured")
        authorized = sorted(self.m.sandbox.payments("AUTHORIZED"), key=lambda p: p["id"])
        if authorized:
            payment = rng.choice(authorized)
            self.m.sandbox.refuse_capture(payment["id"], status)
            self.m.note(f"  the processor will refuse {payment['id']}'s capture")

    @rule(outcome=st.sampled_from(["SETTLED", "FAILED"]))
    def refunds_take_time(self, outcome):
        """From now on (but while the books are read), each refund is answered pending and reaches `outcome`
        when time next passes: the processor settles it, or refuses it (decision 174)."""
        self.step(0, f"refunds pending, then {outcome}")
        self.m.sandbox.async_refunds(outcome)

    @rule(seed=st.integers(0, 2**32), kind=st.sampled_from(["DISPUTE", "RETRIEVAL", "PREARBITRATION"]),
          outcome=st.sampled_from(["OPEN", "LOST", "WON", "ACCEPTED", "CHALLENGED", "EXPIRED", "CANCELLED"]))
    def dispute_outcome(self, seed, kind, outcome):
        """A DISPUTE.STATUS notification of any type and status Primer documents: a new dispute of a settled
        payment, or the next step of one of its disputes that has not ended (a retrieval that becomes a
        chargeback, a won chargeback taken to pre-arbitration)."""
        self.dispute_notification(seed, kind, outcome, moves_on=None)

    @rule(seed=st.integers(0, 2**32), kind=st.sampled_from(["DISPUTE", "RETRIEVAL", "PREARBITRATION"]),
          outcome=st.sampled_from(["OPEN", "LOST", "WON", "ACCEPTED", "CHALLENGED", "EXPIRED", "CANCELLED"]))
    def a_dispute_moves_on(self, seed, kind, outcome):
        """The next step of a dispute that has not ended (one opens first when none is going): a rule of its
        own, since the one rule drawn about once in a hundred steps moved no open dispute to won in 506
        histories (2026-11-28)."""
        self.dispute_notification(seed, kind, outcome, moves_on=True)

    def dispute_notification(self, seed, kind, outcome, moves_on: bool | None):
        rng = self.step(seed, f"dispute {kind} {outcome}")
        settled = self.m.sandbox.payments("SETTLED")
        if not settled:  # a customer pays first: with the checkout rules off for a history (Hypothesis's
            # swarm), 8 dispute steps in 15 embedded histories found nothing to dispute (2026-12-03)
            self.m.checkout()
            self.m.pay()
            settled = self.m.sandbox.payments("SETTLED")
            if not settled:  # refused, declined, or only authorized
                return
        # Half the time (always, `moves_on`) the next step of a dispute still going, whichever payment it is
        # on: chosen after a random payment, it was one in 484 histories that never moved an open dispute on
        # (2026-11-28).
        going = [(d["paymentId"], d["id"]) for d in self.m.sandbox.store.all("dispute")
                 if not _dispute_ended(d["type"], d["status"])]
        if moves_on and not going:  # one opens first: 115 histories with this rule still moved none to won
            body = self.m.sandbox.dispute_status(rng.choice(settled)["id"], "OPEN", kind="RETRIEVAL"
                                                 if kind == "RETRIEVAL" else "DISPUTE")["dispute"]
            self.m.note(f"  dispute {body['processorDisputeId']} opens on {body['paymentId']}")
            going = [(body["paymentId"], body["processorDisputeId"])]
        payment_id, dispute_id = (rng.choice(going) if going and (moves_on or rng.random() < 0.5)
                                  else (rng.choice(settled)["id"], None))
        if dispute_id is not None:  # the processor's next step: never back to an earlier stage (decision 214)
            held = self.m.sandbox.store.get("dispute", dispute_id)
            stages = lifecycle.DISPUTE_TYPES
            stage = max(stages.index(kind), stages.index(held["type"]))
            decided = lifecycle.dispute_state(held["type"], held["status"]) != "open"
            if decided and stage == stages.index(held["type"]):
                if stage + 1 == len(stages):
                    return  # a decided pre-arbitration opens no further stage
                # A decided stage moves on only as the next one (a won chargeback taken further, a closed
                # retrieval become a chargeback), whose news may come first as its decision (deliveries
                # arrive in any order: decision 227).
                stage += 1
            kind = stages[stage]
            self.m.note(f"  dispute {dispute_id}: {held['type']} {held['status']} -> {kind} {outcome}")
        self.m.sandbox.dispute_status(payment_id, outcome, kind=kind, dispute_id=dispute_id)

    # ---- operators -------------------------------------------------------------------------------------
    @rule(user=st.sampled_from(USERS), void=st.booleans())
    def operator_freezes(self, user, void):
        self.step(0, f"operator freezes {user}{' --void-invoices' if void else ''}")
        try:
            freeze(self.c, user, "exploration", "explorer", void_invoices=void)
        except e.BillingError:
            pass
        self.m.froze(user)  # frozen even when voiding an invoice failed afterwards

    @rule(user=st.sampled_from(USERS))
    def operator_unfreezes(self, user):
        self.step(0, f"operator unfreezes {user}")
        try:
            unfreeze(self.c, user, "exploration", "explorer")
        except e.BillingError:
            pass
        self.m.unfroze(user)

    @rule(seed=st.integers(0, 2**32), action=st.sampled_from(["refund", "create-subscription", "mark-handled"]))
    def operator_resolves_an_orphan(self, seed, action):
        rng = self.step(seed, f"operator resolves an orphan: {action}")
        rows = orphans.list_orphans(self.c)
        open_rows = [r for r in rows if r["status"] in ("retrying", "exhausted", "needs_review")]
        if open_rows:
            try:
                orphans.resolve(self.c, rng.choice(open_rows)["payment_id"], action, "exploration", "explorer")
            except e.BillingError:
                pass

    @rule(seed=st.integers(0, 2**32), action=st.sampled_from(["record", "refund"]))
    def operator_acts_on_a_payment(self, seed, action):
        """`billingctl payments record ID` (without --yes) or `billingctl payments refund ID --reason R --yes`
        on any payment the orchestrator holds, whatever its status and whoever holds it here."""
        rng = self.step(seed, f"operator: payments {action}")
        known = self.m.sandbox.payments()
        if known:
            payment = rng.choice(known)
            self.m.note(f"  payments {action} {payment['id']} ({payment['status']})")
            try:
                if action == "record":
                    payments.record_payment_by_id(self.c, payment["id"], confirmed=False)
                else:
                    payments.refund_by_operator(self.c, payment["id"], "exploration", "explorer")
            except e.BillingError:
                pass

    @rule(seed=st.integers(0, 2**32))
    def operator_replays_an_event(self, seed):
        """`billingctl events replay ID --reason R --yes` on any event the inbox holds, from any source and
        however old: a replay is older news the moment anything happened since (decision 214)."""
        rng = self.step(seed, "operator replays an event")
        with self.c.uow() as uow:
            stored = uow.execute(select(event_inbox.c.id, event_inbox.c.event_id)).all()
        if stored:
            inbox_id, event_id = rng.choice(sorted(stored))
            self.m.note(f"  events replay {inbox_id} ({event_id})")
            try:
                webhook_events.replay(self.c, inbox_id, "exploration", "explorer")
            except e.BillingError:
                pass

    @rule(seed=st.integers(0, 2**32))
    def recovery_meets_a_long_outage(self, seed):
        """The provider answers 503 for hours while orphan recovery retries on its schedule (1 minute,
        doubling, capped at 30): a payment waiting for recovery runs out of attempts (`exhausted`, alerted)
        and waits for a person, whose retry or resolution the operators' rules make. Every run's report to
        2026-11-29 listed the steps out of `exhausted` as never applied: no outage lasted the schedule's
        2.5 hours. With no payment waiting for recovery, one outlives its checkout first."""
        self.step(seed, "the provider is down for hours while recovery retries")
        if not any(r["status"] == "retrying" for r in orphans.list_orphans(self.c)) and \
                not self.a_payment_outlives_its_checkout():  # what recovery retries
            return
        self.m.sandbox.store.add_fault("provider", "503", count=-1)
        for _ in range(11):
            self.m.advance(31 * 60)
            try:
                orphans.run_orphans(self.c)
            except e.BillingError:
                pass
        self.m.sandbox.store.clear_faults()  # the outage ends (and any fault another rule left with it)
        self.m.note("  the provider is back")

    def a_payment_outlives_its_checkout(self) -> bool:
        """A customer checks out, support cancels the subscription still waiting for its payment, and the
        customer then pays the form they kept open: a payment for a cancelled subscription, which orphan
        recovery retries (re-subscribe, or refund). Waiting for an orphan to arise of itself, the long
        outage found too few to retry: no step out of `exhausted` in 285 production histories (2026-12-02)
        nor in 310 embedded ones (2026-12-03)."""
        self.m.note("  a payment outlives its checkout")
        waiting = len(self.m.open_checkouts)
        self.m.checkout()
        if len(self.m.open_checkouts) == waiting:  # refused (the quota, a frozen customer, a plan held)
            return False
        co = self.m.open_checkouts.pop()
        held = self.m.sandbox.store.get("subscription", co["subscription_id"]) or {}
        if held.get("status") != "future" or held.get("deleted"):
            # A second tab's checkout given back (decision 110), its subscription since deleted or started
            # at the provider: nothing for support to cancel.
            self.m.note(f"  {co['subscription_id']} is no longer future at the provider")
            return False
        self.m.sandbox.cancel(co["subscription_id"])
        self.m.note(f"  cancel at provider {co['subscription_id']} (future)")
        self.m.advance(61)
        self.m.jobs()  # our copy learns of the cancel
        return self.m.pay("deliver", co) is not None

    @rule(seed=st.integers(0, 2**32))
    def operator_retries_an_orphan(self, seed):
        """`billingctl orphans retry ID`, whatever the orphan's state."""
        rng = self.step(seed, "operator retries an orphan")
        rows = orphans.list_orphans(self.c)
        if rows:
            try:
                orphans.retry(self.c, rng.choice(rows)["payment_id"], "explorer")
            except e.BillingError:
                pass

    @rule(seed=st.integers(0, 2**32))
    def operator_activates(self, seed):
        """`billingctl subscriptions activate ID` on any subscription we hold, pending or not."""
        rng = self.step(seed, "operator activates a subscription")
        with self.c.uow() as uow:
            ids = sorted(uow.execute(select(subscription.c.id)).scalars())
        if ids:
            try:
                payments.activate_subscription(self.c, rng.choice(ids))
            except e.BillingError:
                pass

    # ---- the jobs and the clocks -------------------------------------------------------------------------
    @rule(job=st.sampled_from(sorted(JOBS)))
    def job(self, job):
        self.step(0, f"job {job}")
        try:
            JOBS[job](self.c)
        except e.BillingError:
            pass  # visible (exit 4/5); the next run resumes
        self.m.catch_hung()

    @rule(seconds=st.sampled_from(SPANS))
    def time_passes(self, seconds):
        self.step(0, f"{seconds} s pass")
        self.m.advance(seconds)

    @rule(seed=st.integers(0, 2**32), processor=st.sampled_from(PROCESSOR),
          retries=st.lists(st.sampled_from(PROCESSOR), max_size=4))
    def a_renewal_falls_due(self, seed, processor, retries):
        """Time runs to the end of a live subscription's term and the jobs run, as a tick does. PENDING or
        AUTHORIZED: the processor leaves the renewal charge they start so for ever, and only our age limit
        ends it (decisions 189 and 190). Through `time_passes` alone a renewal fell due in few histories,
        and a hung charge in none of 1,058 (2026-11-27). "answers later": the charge is reported in flight
        (PENDING, AUTHORIZED or SETTLING) and ends when the processor finishes it (`finish_charges`, or the
        quiet hours): the step from an in-flight row to its end, which 180 histories of 50 steps never took
        (2026-11-28) while in-flight answers were one action of the processor's six. "declines" (the
        customer's issuer, until the world says otherwise) and "is unreachable" (the orchestrator answers
        503 to the tick's requests): the dunning's retry steps, which 130 histories hardly reached. "moves it
        on": the charge is answered PENDING and the processor moves it on while the ticks run (AUTHORIZED,
        SETTLING, then settled in full or in part, declined or failed: `Model.finish_charges`), where 187
        histories had applied no step between two statuses in flight (2026-11-28): an audit settles every
        charge in flight, and it is drawn far more often than the processor's own rule. "finds no payment
        method": the customer removed every method vaulted for them (dunning `failed`). "meets a lock it
        cannot read": the table of processor locks fails while the tick runs (renamed away, as in
        tests/integration/test_renewals.py), so the renewal is `aborted` and whatever else the jobs write there
        fails and is retried; 333 histories had never applied a step into or out of `aborted`. "loses its
        answer": the charge is made but its answer is lost (a 500 after the effect), so the attempt ends
        `error` and the next reads the order back (or its notification ended the dunning first, decision
        231); 545 histories had applied no step out of `error`. "settles before its answer": the charge is
        answered PENDING, but it settles at once and its notification ends the dunning before the tick
        writes that answer (decision 232), which the sandbox could not do before 2026-12-01. "settles in
        part": captured in part (`held`). `retries`: what the processor does with each of the schedule's
        retries that then run (`retries_run`): 254 histories (2026-11-29) applied 7 of the dunning's 47
        edges, an audit ending every schedule before its retries. With no live subscription a customer
        subscribes first: Hypothesis turns rules off for a whole history (swarm testing), and with the
        checkout rules off the renewal was never drawn: 108 embedded histories of 2026-12-01 fell due none."""
        rng = self.step(seed, f"a renewal falls due; its processor {processor}")
        running = self.running_subscriptions()
        if not running:
            return
        sub = rng.choice(running)
        self.m.note(f"  {sub['id']}'s term ends")
        self.ticks(processor, rng, sub["customer_id"], max(sub["current_term_end"] - self.m.sandbox.now(), 0) + 61)
        self.retries_run(rng, sub, retries)

    @rule(seed=st.integers(0, 2**32), days=st.sampled_from([15, 30]),
          then=st.sampled_from(["falls due", "cheque", "void", "credit", "delete", "a returning checkout"]),
          processor=st.sampled_from(PROCESSOR))
    def a_term_renews_under_payment_terms(self, seed, days, then, processor):
        """Finance gives a customer with an active term payment terms of `days` days (decision 245) and the
        term ends: its renewal invoice is posted, owed at its due date, and the ticks leave it until then.
        Before that date, `then`: finance enters the customer's cheque on it, voids, credits or deletes it;
        or the customer checks out another plan under the terms (its first invoice posted too, paid by the
        checkout's payment before its due date); or the date passes and the ticks collect it, the processor
        doing `processor` with the charge. As one world action in five (`payment_terms`), 169 production
        histories of 2026-12-04 left no posted invoice but by a credit: `posted -> payment_due`, `-> voided`
        and `paid -> posted` were never applied."""
        rng = self.step(seed, f"a term renews under payment terms of {days} days; then {then}")
        running = [s for s in self.running_subscriptions() if s["status"] == "active"]
        if not running:
            return
        sub = rng.choice(running)
        customer = sub["customer_id"]
        self.m.sandbox.set_net_term_days(customer, days)
        self.m.note(f"  finance gives {customer} payment terms of {days} days; {sub['id']}'s term ends")
        self.m.advance(max(sub["current_term_end"] - self.m.sandbox.now(), 0) + 61)
        self.m.jobs()
        posted = [i for i in self.m.payable() if i["status"] == "posted" and i["subscription_id"] == sub["id"]]
        if then == "falls due" or not posted:
            self.ticks(processor, rng, customer, days * 86400 + 61)
            return
        invoice, due = posted[0]["id"], posted[0]["amount_due"]
        finance = {"cheque": lambda: self.m.sandbox.record_payment(invoice, due, f"cheque {rng.randint(1, 999)}"),
                   "void": lambda: self.m.sandbox.void_invoice(invoice),
                   "credit": lambda: self.m.sandbox.create_credit_note(invoice, due),
                   "delete": lambda: self.m.sandbox.delete_invoice(invoice)}
        if then in finance:
            try:
                finance[then]()
            except SandboxError as exc:
                self.m.note(f"  finance: {then} on {invoice} refused ({exc.api_error_code})")
            else:
                self.m.note(f"  finance: {then} on {invoice}")
        else:  # a returning checkout
            plan = rng.choice([p for p in PLANS if p != sub["subscription_items"][0]["item_price_id"]])
            self.m.note(f"  {customer} checks out {plan} under the terms")
            try:
                co = checkout.create_checkout(self.c, customer, plan)
            except e.BillingError as exc:
                self.m.note(f"  checkout {customer} {plan}: refused ({exc.code})")
            else:
                self.m.pay("deliver", co)
        self.m.advance(rng.choice(SPANS[:4]))
        self.m.jobs()

    def ticks(self, processor: str, rng: random.Random, customer: str, wait: int) -> None:
        """`wait` seconds pass and the jobs run, the processor doing `processor` with the renewal charges the
        ticks start (`a_renewal_falls_due`'s choices, and "settles in part": the charge is captured in part,
        `held`)."""
        answers_before = self.m.sandbox.store.meta("async_charges")
        if processor in ("answers later", "moves it on"):
            self.m.sandbox.async_charges("PENDING" if processor == "moves it on" else rng.choice(IN_FLIGHT))
        elif processor == "settles before its answer":
            self.m.sandbox.async_charges(rng.choice(IN_FLIGHT), settles_in_transit=True)
        elif processor == "settles in part":
            self.m.sandbox.async_charges("PARTIALLY_SETTLED")
        elif processor == "declines":
            self.m.sandbox.decline_customer(customer)
        elif processor == "is unreachable":
            self.m.sandbox.store.add_fault("orchestrator", "503", count=6)
        elif processor == "loses its answer":
            # a charge is sent once (adapters/orchestrator.py): its one answer lost
            self.m.sandbox.store.add_fault("orchestrator", "error_after_effect", method="POST", path="/payments")
        elif processor == "finds no payment method":
            self.m.remove_payment_methods(customer)
        elif processor in ("PENDING", "AUTHORIZED"):
            self.m.hang_the_next_charge(processor)
        self.m.advance(wait)
        with table_away(self.c.engine, "user_credits") if processor == "meets a lock it cannot read" else nullcontext():
            self.m.jobs()
        if processor in ("answers later", "moves it on", "settles before its answer", "settles in part"):
            self.m.sandbox.async_charges(answers_before)
        if processor == "moves it on":
            self.moves_on(rng)

    def retries_waiting(self) -> list:
        """(invoice, customer, when) of each renewal whose dunning waits for its next attempt."""
        newest = select(func.max(dunning_attempt.c.id)).group_by(dunning_attempt.c.invoice_id)
        with self.c.uow() as uow:
            return [tuple(r) for r in uow.execute(
                select(dunning_attempt.c.invoice_id, dunning_attempt.c.user_id, dunning_attempt.c.next_attempt_at)
                .where(dunning_attempt.c.id.in_(newest), dunning_attempt.c.status.in_(lifecycle.RETRYABLE),
                       dunning_attempt.c.next_attempt_at.is_not(None))
                .order_by(dunning_attempt.c.invoice_id))]

    @precondition(lambda self: self.retries_waiting())
    @rule(seed=st.integers(0, 2**32), processor=st.sampled_from(PROCESSOR))
    def a_retry_falls_due(self, seed, processor):
        """Time runs to a waiting renewal's next attempt and the jobs run, the processor doing `processor`
        with its charge: the retry as a step of its own, so that the world, operators and jobs act between
        a renewal's attempts (a freeze, a refund, a dispute, support at the provider). Inside
        `a_renewal_falls_due` alone the retries followed one another with nothing between, and that rule
        was drawn in one history in ten (Hypothesis draws among three dozen rules, each history with some
        turned off): 260 embedded histories of 2026-12-01 applied 14 of the dunning's 47 edges."""
        rng = self.step(seed, f"a renewal's retry falls due; its processor {processor}")
        invoice, customer, at = rng.choice(self.retries_waiting())
        self.can_pay_again(customer, processor)
        self.m.note(f"  {invoice}'s next attempt")
        wait = _naive_utc(at) - _naive_utc(self.c.clock.now())
        self.ticks(processor, rng, customer, max(int(wait.total_seconds()), 0) + 61)

    def retries_run(self, rng: random.Random, sub: dict, retries: list[str]) -> None:
        """The retry schedule's attempts (1, 24, 72, 120 hours apart) run with the ticks, the processor doing
        the next of `retries` with each: the issuer declines again ("declines"), or the card works and the
        customer has a payment method again ("finds no payment method": they removed it again), and the
        charge meets what the processor does. Before, one retry in three found the customer able to pay
        and one in seven the orchestrator down, from the step's seed: runs of 2026-12-01 (148 production
        histories, 108 embedded) applied 7 and 0 of the dunning's 47 edges."""
        customer = sub["customer_id"]
        for wait, processor in zip(self.c.settings.renewal_retry_hours, retries, strict=False):
            self.can_pay_again(customer, processor)
            self.m.note(f"  {wait} h on, its retry; the processor {processor}")
            self.ticks(processor, rng, customer, wait * 3600 + 61)

    def can_pay_again(self, customer: str, processor: str) -> None:
        """Before a retry: the cause of the last failure is gone, but what `processor` brings back."""
        if processor != "declines":
            self.m.sandbox.decline_customer(customer, decline=False)
        if processor != "finds no payment method" and \
                not any(not i["deleted"] for i in self.m.sandbox.instruments(customer)):
            self.m.sandbox.add_instrument(customer, default=True)

    def moves_on(self, rng: random.Random) -> None:
        """The processor moves each renewal charge in flight to a later status in flight, perhaps once more,
        then ends it (settled in full or in part, declined or failed), each webhook perhaps lost, the ticks
        running between. Left to `Model.finish_charges` (half the charges, each to one of five ends), 115
        histories took no step between two statuses in flight (2026-11-28)."""
        for round_no in range(3):
            for payment in self.m.sandbox.payments():
                if payment["status"] not in IN_FLIGHT or payment["id"] in self.m.hung or not renewal_charge(payment):
                    continue
                later = IN_FLIGHT[IN_FLIGHT.index(payment["status"]) + 1:]
                drop = rng.random() < 0.2
                if later and round_no < 2 and rng.random() < 0.8:
                    self.m.move_charge(payment, rng.choice(later), drop)
                else:
                    self.m.move_charge(payment, rng.choice(["settled", "settled in part", "declined", "failed"]), drop)
            self.m.advance(rng.choice((61, 15 * 60)))
            self.m.jobs()

    @precondition(lambda self: self.stack is not None)
    @rule(seed=st.integers(0, 2**32), then=st.sampled_from(["the window fills again", *PROCESSOR]))
    def a_renewal_meets_a_full_quota(self, seed, then):
        """Production only: the quota-pressure customer tries the payment form again and again (declined
        each time) just before its subscription's term ends, the renewal takes the slot kept for it and is
        declined, and its retry an hour later finds the daily window full: `quota_blocked` (spec, the
        quota's rule 2). 121 production histories had blocked no renewal (2026-11-28): the pressure's
        attempts and a renewal's retry seldom fall in one day. `then`: what meets the retry once the window
        frees (drawn by Hypothesis: chosen from the step's seed, which Hypothesis draws as 0 more often than
        not, one history of 2026-12-01 met the same end 20 times over)."""
        rng = self.step(seed, "a renewal meets a full quota")
        heavy = self.m.HEAVY
        for _ in range(6):  # the customer pays for one plan at last (one time in five)
            subs = [s for s in self.m.subscriptions() if s["status"] in RUNNING and s["customer_id"] == heavy]
            if subs:
                break
            self.m.pressure()
            self.m.jobs()
        if not subs:
            return
        sub = rng.choice(subs)
        self.m.sandbox.decline_customer(heavy)  # until the world says otherwise, as "declines"
        self.m.advance(max(sub["current_term_end"] - self.m.sandbox.now() - 600, 0))
        for _ in range(3):
            self.m.pressure()
        self.m.note(f"  {sub['id']}'s term ends; its renewal is declined")
        self.m.advance(661)
        self.m.jobs()
        self.m.advance(3660)  # the first retry's wait
        self.m.jobs()
        # Then the retry the block scheduled, once the window's oldest attempt leaves it: runs of 2026-11-29
        # blocked 8,280 renewal attempts and applied almost no step out of `quota_blocked` (the next slot
        # frees hours on, past the history's other steps).
        with self.c.uow() as uow:
            newest = uow.execute(select(dunning_attempt.c.status, dunning_attempt.c.next_attempt_at)
                                 .where(dunning_attempt.c.user_id == heavy)
                                 .order_by(dunning_attempt.c.id.desc()).limit(1)).first()
        if newest is None or newest.status != "quota_blocked" or newest.next_attempt_at is None:
            return
        self.m.note(f"  its retry waits for the window; then its processor {then}")
        self.can_pay_again(heavy, then)
        frees = _naive_utc(newest.next_attempt_at) - _naive_utc(self.c.clock.now())
        if then == "the window fills again":
            self.m.advance(max(int(frees.total_seconds()), 0) + 61)
            for _ in range(3):
                self.m.pressure()
            self.m.jobs()
        else:
            self.ticks(then, rng, heavy, max(int(frees.total_seconds()), 0) + 61)

    @rule(skew=st.sampled_from(SKEWS))
    def our_clock_drifts(self, skew):
        self.step(0, f"our clock {skew:+} s from the sandbox's")
        self.c.clock.advance(skew - self.m.skew)
        self.m.stepped_back += max(self.m.skew - skew, 0)
        self.m.skew = skew

    # ---- the books -----------------------------------------------------------------------------------------
    # Three steps of the world at least between two audits: drawn freely, the audit (which settles everything
    # in flight and ends every retry schedule) was a third of the rules run in the embedded runs of 2026-11-29,
    # and 254 histories applied 7 of the dunning's 47 edges. Every history still ends with one.
    @precondition(lambda self: self.steps - self.audited_at >= 3)
    @rule()
    def audit(self):
        """Faults clear and the jobs run until nothing moves; then the outside world's books and ours agree,
        and reconcile agrees with them."""
        FIGURES["audits"] += 1
        self.audited_at = self.steps
        refunds = self.m.sandbox.store.meta("async_refunds")
        self.m.settle_quietly()
        try:
            self.m.check()
        except AssertionError as failure:
            raise AssertionError(f"{failure}\n" + "\n".join(self.m.trace[-60:])) from None
        self.m.sandbox.async_refunds(refunds)  # the processor keeps its ways after the books are read

    @invariant()
    def every_moment(self):
        assert not ILLEGAL_NOW, f"steps outside their table (counted and alerted): {ILLEGAL_NOW}"
        assert_books_hold_at_every_moment(self.c)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_histories_the_machine_chooses_keep_every_book(db_url, make_settings, tmp_path, record_property,
                                                        monkeypatch, request, mode):
    CONTEXT.update(db_url=db_url, make_settings=make_settings, tmp=tmp_path, production=mode == "production")
    if CONTEXT["production"]:
        CONTEXT["redis_url"] = request.getfixturevalue("redis_url")
    FIGURES.update(dict.fromkeys(FIGURES, 0))  # each container's run reports its own figures and edges
    STEPS_SEEN.clear()
    SEEDED_STEPS.clear()
    _record_steps(monkeypatch)
    if LONG_RUN:
        _fresh_histories_only(monkeypatch)
    run_state_machine_as_test(Exploration, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, derandomize=not LONG_RUN,
        database=None, suppress_health_check=list(HealthCheck)))
    for name, value in FIGURES.items():
        record_property(name, value)
    record_property("seeded_steps", SEEDED_STEPS.total())
    record_property("distinct_seeded_steps", len(SEEDED_STEPS))
    print(_summary())
    assert FIGURES["audits"] >= EXAMPLES
