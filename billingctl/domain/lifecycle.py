"""The life of each money aggregate as one table of allowed transitions (issues 34 and 35): the
orchestrator payment as we hold it, the renewal (dunning) attempt on an invoice, the dispute, the review
row of a payment we must not credit automatically, and the provider's subscription and invoice. Every
status the orchestrator and the provider document is in a table; an event that is not is refused by
`Lifecycle.step`, and the caller logs, counts (`billing_lifecycle_illegal_transitions_total`) and
alerts it. Repositories apply a step with a conditional update (`... WHERE status IN
lifecycle.sources(target)`, or the provider's resource_version for its copies), so two writers that race
cannot move a row backwards.

Besides "allowed" and "illegal", a step of an aggregate fed by notifications (whose table is a directed
acyclic graph but for its self-loops) can be *stale*: the event names a state the aggregate has already
left behind (a PENDING webhook delivered after the SETTLED one). Stale news is expected (webhooks arrive
in any order) and changes nothing; it is neither applied nor alerted. Illegal means two facts contradict
each other (SETTLED after DECLINED)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Step(StrEnum):
    APPLY = "apply"  # an allowed transition: write it
    SAME = "same"  # the aggregate is already there (a repeated report)
    STALE = "stale"  # older news than what we hold: nothing to write
    ILLEGAL = "illegal"  # contradicts what we hold: counted and alerted, never applied silently


@dataclass(frozen=True)
class Lifecycle:
    name: str
    states: tuple[str, ...]
    edges: dict[str | None, tuple[str, ...]]  # from-state (None: no row yet) -> allowed to-states
    final: tuple[str, ...] = ()
    # True for an aggregate fed by notifications that arrive in any order (its table is a DAG but for
    # self-loops): an event behind the current state is stale news. False for one we write ourselves in
    # order (the dunning log, whose retries loop): every step outside the table is illegal.
    stale_news: bool = True
    # True for the provider's resources, of which we hold copies ordered by resource_version (decision 225):
    # a copy is the resource at one instant, and the steps between two copies we read may each have had a
    # copy of their own we read later or never (an event still to poll, a direct read). A status reachable
    # from ours by the table's steps is applied; one no sequence of steps reaches (a voided invoice paid, a
    # subscription future again) contradicts what we hold.
    snapshots: bool = False
    _reach: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        for source, targets in self.edges.items():
            for state in (source, *targets):
                if state is not None and state not in self.states:
                    raise ValueError(f"{self.name}: {state!r} is not a state")
        for state in self.final:
            if self.edges.get(state):
                raise ValueError(f"{self.name}: final state {state!r} has transitions")

    def allowed(self, source: str | None, target: str) -> bool:
        return target in self.edges.get(source, ())

    def sources(self, target: str) -> tuple[str, ...]:
        """The states a row may be in for `target` to be written over it (the conditional update's IN)."""
        return tuple(s for s, targets in self.edges.items() if s is not None and target in targets)

    def reachable(self, source: str) -> frozenset[str]:
        """Every state reachable from `source` by one or more allowed transitions."""
        if source not in self._reach:
            seen: set[str] = set()
            todo = list(self.edges.get(source, ()))
            while todo:
                state = todo.pop()
                if state not in seen:
                    seen.add(state)
                    todo.extend(self.edges.get(state, ()))
            self._reach[source] = frozenset(seen)
        return self._reach[source]

    def step(self, source: str | None, target: str) -> Step:
        if target not in self.states:
            return Step.ILLEGAL
        if self.allowed(source, target):  # a self-loop in the table is a new event (one more attempt)
            return Step.APPLY
        if source == target:
            return Step.SAME
        if self.stale_news and source is not None and source in self.reachable(target):
            return Step.STALE
        if self.snapshots and source is not None and target in self.reachable(source):
            return Step.APPLY  # the copy skipped steps whose own copies come later as older news, or never
        return Step.ILLEGAL

    def mermaid(self) -> str:
        """The table as a Mermaid state diagram (docs/lifecycles.md is generated from it)."""
        lines = ["stateDiagram-v2"]
        for source, targets in self.edges.items():
            for target in targets:
                if target != source:
                    lines.append(f"    {'[*]' if source is None else source} --> {target}")
        lines.extend(f"    {state} --> [*]" for state in self.final)
        return "\n".join(lines)


class IllegalTransition(Exception):
    def __init__(self, lifecycle: str, key: str, source: str | None, target: str):
        super().__init__(f"{lifecycle} {key}: {source or 'new'} -> {target} is not an allowed transition")
        self.lifecycle, self.key, self.source, self.target = lifecycle, key, source, target


# ---- the orchestrator payment, as we hold it (the `transaction` row) --------------------------------------
# Primer's payment statuses (its payment lifecycle reference), each with our row's name for it. Refunds do
# not change a payment's status at the orchestrator (its amountRefunded grows): they are ledger reversals.
ORCHESTRATOR_STATUS = {"PENDING": "pending", "AUTHORIZED": "authorized", "SETTLING": "settling",
                       "PARTIALLY_SETTLED": "partially_captured", "SETTLED": "captured", "DECLINED": "declined",
                       "FAILED": "failed", "CANCELLED": "cancelled"}
# A payment that was captured (in part or in full) is money we hold: recording follows it.
CAPTURED = ("partially_captured", "captured")
_ENDED = ("declined", "failed", "cancelled")
PAYMENT = Lifecycle(
    name="payment",
    states=tuple(ORCHESTRATOR_STATUS.values()),
    edges={
        None: tuple(ORCHESTRATOR_STATUS.values()),  # the first report we see may be any status
        "pending": ("authorized", "settling", "partially_captured", "captured", *_ENDED),
        "authorized": ("settling", "partially_captured", "captured", *_ENDED),
        "settling": ("partially_captured", "captured", "declined", "failed"),
        # A partial capture may be followed by a capture of the rest (a capture that is not final).
        "partially_captured": ("captured",),
    },
    final=("captured", *_ENDED),
)


def payment_status(orchestrator_status: str | None) -> str | None:
    """Our row's name for one of the orchestrator's statuses; None for a status it does not document."""
    return ORCHESTRATOR_STATUS.get(orchestrator_status or "")


# ---- the renewal attempt on one invoice (the `dunning_attempt` rows) --------------------------------------
# The aggregate's state is its newest row's status. `pending` is the one row a later outcome resolves in
# place (its `resolved_at`), so whichever path observes the charge's end (the tick, the webhook, the poller)
# closes it exactly once, and the outcome row follows it.
# A renewal skipped (a frozen customer, an undecided dispute) writes no row: the tick answers why, and the
# next tick decides again, so no state stands for it.
RETRYABLE = ("declined", "failed", "error", "aborted", "quota_blocked")
DUNNING = Lifecycle(
    name="dunning",
    states=("pending", "succeeded", "held", "exhausted", *RETRYABLE),
    edges={
        None: ("pending", "succeeded", "held", *RETRYABLE),
        "pending": ("succeeded", "held", "declined", "failed"),
        **{state: ("pending", "succeeded", "held", *RETRYABLE) for state in ("error", "aborted", "quota_blocked")},
        # A counted failure may end the schedule: the exhausted row follows the last one.
        "declined": ("pending", "succeeded", "held", "exhausted", *RETRYABLE),
        "failed": ("pending", "succeeded", "held", "exhausted", *RETRYABLE),
        # A charge held as captured in part that is captured in full afterwards (a capture that was not
        # final, then the rest): it matches the invoice and is recorded (decision 226).
        "held": ("succeeded",),
    },
    # succeeded: paid. held: money captured that does not match the invoice (a partial settle, another
    # amount or currency): a person decides, no automatic charge follows. exhausted: cancelled.
    final=("succeeded", "exhausted"),
    stale_news=False,
)
DUNNING_ENDED = ("succeeded", "held", "exhausted")  # no automatic charge follows
IN_FLIGHT = ("PENDING", "AUTHORIZED", "SETTLING")  # orchestrator statuses of a charge not yet ended
VOIDABLE = ("PENDING", "AUTHORIZED")  # in flight and not yet moving money: the orchestrator still voids it


# ---- the dispute (Primer's DISPUTE.OPENED and DISPUTE.STATUS notifications) -------------------------------
# Primer: a dispute has a type (RETRIEVAL, DISPUTE, PREARBITRATION) and a status (OPEN, ACCEPTED, CHALLENGED,
# EXPIRED, CANCELLED, WON, LOST); a new DISPUTE.STATUS follows every change of either. Our state says what
# the money does: open (undecided: no merchant-initiated charge for the customer), won or closed (the sale
# stands), lost (the customer has the money back: the payment's credits are reversed).
DISPUTE_TYPES = ("RETRIEVAL", "DISPUTE", "PREARBITRATION")
DISPUTE_STATUSES = ("OPEN", "ACCEPTED", "CHALLENGED", "EXPIRED", "CANCELLED", "WON", "LOST")
DISPUTE = Lifecycle(
    name="dispute",
    states=("open", "won", "closed", "lost"),
    edges={
        None: ("open", "won", "closed", "lost"),
        "open": ("won", "closed", "lost"),
        # The issuer may take a won dispute to pre-arbitration: it is open again. A later stage may also be
        # decided before its opening arrives (deliveries come in any order): a chargeback lost or won after
        # a closed retrieval, a pre-arbitration cancelled after a won chargeback (decision 227). Each of these
        # cycles is taken only by a later stage (`dispute_step`).
        "won": ("open", "lost", "closed"),
        "closed": ("open", "won", "lost"),
    },
    final=("lost",),
)


def dispute_step(source: str | None, held_kind: str | None, target: str, kind: str | None) -> Step:
    """A dispute's step judged by its stage as well as its state (decision 214). Primer's types are stages
    in order (an inquiry, a chargeback, a pre-arbitration), and the table's cycles (a won or closed dispute
    open again, or decided otherwise) are taken only by a later stage: news of an earlier stage than the one
    held, or naming no stage (DISPUTE.OPENED, `kind` None, for a dispute already held) is stale, whatever
    state it names; so is the held stage's opening once it is decided, and its other decision (closed then
    won or lost, won then closed) is illegal. Won -> lost is taken by the held stage as well, as before."""
    if source is None:
        return DISPUTE.step(None, target)
    held = DISPUTE_TYPES.index(held_kind) if held_kind in DISPUTE_TYPES else 0
    if kind is None or DISPUTE_TYPES.index(kind) < held:
        return Step.STALE
    if source in ("won", "closed") and target != source and DISPUTE_TYPES.index(kind) == held:
        if target == "open":
            return Step.STALE
        if (source, target) in LATER_STAGE_ONLY:
            return Step.ILLEGAL  # one stage decided two ways
    return DISPUTE.step(source, target)


# Steps of the table a later stage takes, never the stage that was decided (decision 227).
LATER_STAGE_ONLY = {("won", "closed"), ("closed", "won"), ("closed", "lost")}


def dispute_state(kind: str | None, status: str | None) -> str | None:
    """Our state for one of Primer's (type, status) pairs; None for a pair it does not document.
    A retrieval is an inquiry (no money moved yet): it keeps the customer open until it ends; its EXPIRED
    means a chargeback may follow, so it stays open. A chargeback or pre-arbitration that the merchant
    accepted or let expire is lost."""
    kind = kind or "DISPUTE"
    if kind not in DISPUTE_TYPES or status not in DISPUTE_STATUSES:
        return None
    if status in ("OPEN", "CHALLENGED"):
        return "open"
    if status == "WON":
        return "won"
    if status == "CANCELLED":
        return "closed"
    if status == "LOST":
        return "lost"
    if kind == "RETRIEVAL":
        return "open" if status == "EXPIRED" else "closed"  # ACCEPTED retrieval: evidence given, no reversal
    return "lost"  # ACCEPTED or EXPIRED chargeback / pre-arbitration


# ---- the review row of a settled payment we must not credit automatically (`orphan_recovery`) ------------
# An orphan (settled for a cancelled checkout) is `retrying` until recovery re-subscribes the customer
# (`recovered`), refunds a same-plan duplicate (`duplicate_refunded`) or runs out of attempts (`exhausted`);
# a payment a person must judge (a frozen account, an amount that does not match its order, a payment that
# names none of our subscriptions) opens as `needs_review`. A person ends any open row (`resolved`: refunded,
# re-subscribed or handled) or sends it back to recovery (`retrying`). A recovered payment whose invoice
# turns out voided is refunded and `resolved` (decision 113). Only recovery writes these rows, in order:
# a step outside the table is illegal (no stale news). A row that ended with a refund the processor then
# refused (its PAYMENT.REFUND reports the REFUND transaction FAILED) goes back to a person (decision 174).
# A row that ended `recovered` because its payment was recorded on its own checkout (decision 226) goes back
# to recovery when that checkout's activation finds the subscription cancelled at the provider (decision 230).
REVIEW_OPEN = ("retrying",)  # recovery's own work: attempted on its schedule
REVIEW_HUMAN = ("exhausted", "needs_review")  # a person's work (or a forced retry)
REVIEW_REFUNDED = ("duplicate_refunded", "resolved")  # the ends a refund may have made
_REVIEW_ENDS = ("recovered", *REVIEW_REFUNDED)
ORPHAN = Lifecycle(
    name="orphan",
    states=(*REVIEW_OPEN, *REVIEW_HUMAN, *_REVIEW_ENDS),
    edges={
        None: ("retrying", "needs_review"),
        "retrying": ("retrying", "exhausted", "needs_review", *_REVIEW_ENDS),
        "needs_review": ("retrying", "needs_review", "exhausted", *_REVIEW_ENDS),
        "exhausted": ("retrying", "needs_review", *_REVIEW_ENDS),
        "recovered": ("resolved", "retrying"),
        "duplicate_refunded": ("needs_review",),
        "resolved": ("needs_review",),
    },
    stale_news=False,
)



# ---- the provider's subscription, as we hold it (the `subscription` row) ----------------------------------
# Chargebee's subscription statuses (its Subscription.Status: future, in_trial, active, non_renewing, paused,
# cancelled, transferred). The provider is authoritative (spec 1.1): its copies are applied in the order of
# its resource_version (a conditional update; an older copy is dropped before the table is consulted), so
# nothing is stale news. A documented status the table does not allow from ours (a future subscription
# reported paused) is written all the same, because it is the provider's, and counted and alerted: our
# copy missed a step or the provider did something we did not model. An undocumented status is refused.
SUBSCRIPTION_STATUSES = ("future", "in_trial", "active", "non_renewing", "paused", "cancelled", "transferred")
RENEWING = ("active", "non_renewing")  # a subscription whose renewal invoices the renewal job charges
AWAITING_OR_STARTED = ("future", *RENEWING)  # a checkout's subscription, still owed its first payment (decision 211)
SUBSCRIPTION = Lifecycle(
    name="subscription",
    states=SUBSCRIPTION_STATUSES,
    edges={
        None: SUBSCRIPTION_STATUSES,  # the first copy we see may be in any status
        # A future subscription starts (in trial or active) on its start date, or is cancelled before; a
        # cancel scheduled for its first term end makes it non_renewing.
        "future": ("in_trial", "active", "non_renewing", "cancelled"),
        "in_trial": ("active", "non_renewing", "paused", "cancelled"),
        "active": ("non_renewing", "paused", "cancelled", "transferred"),
        # A scheduled cancel can be removed (active again) or reached (cancelled).
        "non_renewing": ("active", "paused", "cancelled", "transferred"),
        "paused": ("active", "non_renewing", "cancelled"),
        # A cancelled subscription can be reactivated (in trial or active).
        "cancelled": ("active", "in_trial"),
    },
    final=("transferred",),
    stale_news=False,
    snapshots=True,
)


# ---- the provider's invoice, as we hold it (the `invoice` row) --------------------------------------------
# Chargebee's invoice statuses (Invoice.Status: paid, posted, payment_due, not_paid, voided, pending). A
# pending invoice is still open for charges; closing it posts it (payment_due or not_paid when collection
# fails, paid when collected). A paid invoice becomes payable again when its payment is removed (a
# transaction voided or deleted, a chargeback recorded); only an unpaid invoice can be voided, and a voided
# invoice stays voided. Applied like the subscription: provider copies in resource_version order. A deleted
# invoice (only one with no payment linked and nothing adjusted) keeps its status: its `deleted` flag is kept
# beside it (`invoice.deleted_at`), and nobody owes it (decision 201).
INVOICE_STATUSES = ("pending", "posted", "payment_due", "not_paid", "voided", "paid")
INVOICE_PAYABLE = ("payment_due", "not_paid", "posted")  # an invoice the provider takes a payment on
# The unpaid invoices the renewal job collects: payment_due, and not_paid, which the provider's dunning for
# offline payments marks at its end, the subscription kept or cancelled (decision 244). Posted (payment terms:
# not due yet) becomes payment_due at its due date.
INVOICE_COLLECTED = ("payment_due", "not_paid")
INVOICE = Lifecycle(
    name="invoice",
    states=INVOICE_STATUSES,
    edges={
        None: INVOICE_STATUSES,
        "pending": ("posted", "payment_due", "not_paid", "paid", "voided"),
        "posted": ("payment_due", "not_paid", "paid", "voided"),
        "payment_due": ("not_paid", "paid", "voided"),
        "not_paid": ("payment_due", "paid", "voided"),
        "paid": ("posted", "payment_due", "not_paid"),
    },
    final=("voided",),
    stale_news=False,
    snapshots=True,
)

LIFECYCLES = (PAYMENT, DUNNING, DISPUTE, ORPHAN, SUBSCRIPTION, INVOICE)
