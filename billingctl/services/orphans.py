"""Orphaned-payment recovery (spec section 3 rules 1-7): payments that settled for a cancelled
subscription (checkout-retry orphans), found by the settled-payments poller.

Unlike the spec's in-memory counter (rule 4), attempts live in `orphan_recovery`, so a restart, a
deploy or the next cron process continues the count and the exhaustion alert is raised once per
payment id. Every action on a payment first claims its row with a conditional update, so two
runners never refund or re-subscribe twice."""

from __future__ import annotations

import logging
from datetime import timedelta

from billingctl.adapters.db.subscriptions import STARTED_OR_HELD
from billingctl.adapters.logs import item_failed
from billingctl.adapters.payloads import Payment
from billingctl.domain import errors as e
from billingctl.domain import lifecycle
from billingctl.domain.backoff import ORPHAN_MAX_ATTEMPTS, orphan_retry_delay
from billingctl.domain.batch import BatchResult
from billingctl.domain.clock import parse_time
from billingctl.services import alerts, review
from billingctl.services.cursors import read_value, write_value
from billingctl.services.fraud_signals import deciding_dispute, money_returned, refuse_if_disputed
from billingctl.services.payments import (
    CAPTURED_STATUSES,
    captured_in_part_reason,
    record_payment,
    refund,
    returned_in_review,
    reverse_refund,
)

log = logging.getLogger("billingctl.orphans")

CURSOR = "settled_payments"
EXHAUSTED_TEXT = "ORPHANED PAYMENT RECOVERY EXHAUSTED - manual review required"
DUPLICATE_TEXT = "same-plan duplicate charge during orphan recovery"
TOO_RECENT = timedelta(seconds=15)  # spec section 1 rule 3: the webhook or the event poller is still due
# The orchestrator lists a payment within a minute of its creation (Primer's list-payments reference), and
# lists it by its creation date: each run reads back this far behind its cursor, so a payment listed late
# (or settled late) after a younger one moved the cursor is still seen. Payments already handled cost one
# database read each.
LISTING_DELAY = timedelta(minutes=2)
CLAIM = timedelta(minutes=5)
OPEN = lifecycle.REVIEW_OPEN
HUMAN = lifecycle.REVIEW_HUMAN


# ---- the settled-payments poller ------------------------------------------------------------------

def run_orphans(container, progress=None) -> dict:
    now = container.clock.now()
    cursor = _read_cursor(container)
    counts: dict[str, int] = {}
    newest = cursor
    unsettled = []  # payments still to be looked at: too recent to judge, or their check failed
    since = cursor - LISTING_DELAY if cursor is not None else None
    listed = list(container.orchestrator.list_payments("SETTLED", from_date=since))  # summaries: the total
    if progress:
        progress(0, new_total=len(listed))
    for payment in listed:
        if progress:
            progress(1)
        settled_at = payment.settled_at or now
        if cursor is not None and settled_at < cursor and _handled_before(container, payment.id):
            continue  # read again within the overlap, and handled by an earlier run: nothing to count
        if now - settled_at < TOO_RECENT:
            outcome = "too_recent"
        else:
            try:
                outcome = handle_payment(container, payment)
            except Exception as exc:  # isolate; the payment is looked at again next run
                outcome = "error"
                log.warning("settled payment check failed; looked at again next run: %s",
                            getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}",
                            extra={"payment_id": payment.id})
        if outcome in ("too_recent", "error"):
            unsettled.append(settled_at)
        counts[outcome] = counts.get(outcome, 0) + 1
        if newest is None or settled_at > newest:
            newest = settled_at
    # The cursor holds at the oldest payment still to be looked at (spec section 3, orphan rule 3):
    # one under retry, one too recent, or one whose check failed (the list's from_date is inclusive).
    with container.uow() as uow:
        oldest_open = uow.orphans.oldest_settled(OPEN)
    hold = [t for t in (oldest_open, *unsettled) if t is not None]
    new_cursor = min([newest, *hold]) if newest is not None and hold else newest
    if new_cursor is not None and new_cursor != cursor:
        _write_cursor(container, new_cursor)
    waiting = counts.get("too_recent", 0) + counts.get("waiting", 0)
    return BatchResult({"outcomes": counts, "cursor": new_cursor}, failed=counts.get("error", 0), skipped=waiting,
                       done=sum(counts.values()) - counts.get("error", 0) - waiting)


def _handled_before(container, payment_id: str) -> bool:
    with container.uow(autocommit=True) as uow:
        status = uow.orphans.status(payment_id)
        return status not in (None, *OPEN) or (status is None and uow.purchases.exists_for_payment(payment_id))


def handle_payment(container, payment: Payment) -> str:
    payment = Payment.read(payment)
    payment_id = payment.id
    with container.uow() as uow:
        # The orphan row first: a failed recovery attempt may have written the purchase already.
        row = uow.orphans.get(payment_id)
        if row is None and uow.purchases.exists_for_payment(payment_id):
            return "recorded"
    if row is not None and row["status"] not in OPEN:
        if returned_in_review(row):
            # Its money went back in review; captured again since (a lost notification), what it took
            # since goes back too, as recording does (decision 238).
            # One whose refund was refused since (nothing back, nothing pending) is the refusal's to
            # handle (decision 174): never recorded here.
            payment = container.orchestrator.get_payment(payment_id) if payment.is_summary else payment
            if payment.refund_asked and not payment.refunding_in_full:
                return record_payment(container, payment, "settled_poller")["outcome"]
        return row["status"]
    if payment.is_summary:
        # The list holds summaries: recording needs the customer, the instrument and the refunded amount.
        payment = container.orchestrator.get_payment(payment_id)
    sub_id = payment.metadata.subscription_id
    if row is None:
        status = _subscription_status(container, sub_id) if sub_id and not payment.is_renewal else None
        if status != "cancelled":  # a renewal charge is never an orphan: it pays its own invoice (decision 107)
            # Not an orphan: an ordinary settled payment the webhook and the event poller missed.
            try:
                return record_payment(container, payment, "settled_poller")["outcome"]
            except e.InvalidInput as exc:  # not ours to record: a person decides, the cursor moves on
                return _hold_unattributed(container, payment, exc.message)
        _open(container, payment)
    return attempt(container, payment_id)


def _hold_unattributed(container, payment: Payment, reason: str) -> str:
    with container.uow() as uow:
        review.hold_unattributed(uow, container.clock, payment_id=payment.id,
                                 user_id=payment.user_id, reason=reason,
                                 subscription_id=None, item_price_id=None, amount=payment.amount,
                                 currency_code=payment.currency_code, settled_at=payment.settled_at)
        uow.commit()
    log.warning("settled payment names none of our subscriptions: held for review", extra={"payment_id": payment.id})
    return "needs_review"


def _subscription_status(container, sub_id: str) -> str | None:
    with container.uow() as uow:
        local = uow.subscriptions.status(sub_id)
    if local == "cancelled":
        return local
    try:
        return container.provider.get_subscription(sub_id).status
    except e.ExternalNotFound:
        return "cancelled"


def _open(container, payment: Payment) -> None:
    now = container.clock.now()
    with container.uow() as uow:
        user_id = payment.user_id
        review.open_row(uow, now, payment_id=payment.id, user_id=user_id,
                        subscription_id=payment.metadata.subscription_id, item_price_id=payment.metadata.item_price_id,
                        amount=payment.amount, currency_code=payment.currency_code,
                        settled_at=payment.settled_at)
        uow.commit()
    log.warning("orphaned payment found: settled for a cancelled subscription", extra={"payment_id": payment.id})


def _claim(container, payment_id: str, force: bool = False) -> dict | None:
    """Own the row for one attempt (a conditional update); None when it is not due or someone else has it."""
    now = container.clock.now()
    with container.uow() as uow:
        row = uow.orphans.get(payment_id)
        if row is None:
            return None
        due = force or (row["status"] in OPEN and (row["next_attempt_at"] is None or row["next_attempt_at"] <= now))
        if not due:
            return None
        claimed = uow.orphans.claim(row, now, now + CLAIM)
        uow.commit()
    return dict(row) if claimed else None


def attempt(container, payment_id: str, force: bool = False) -> str:
    row = _claim(container, payment_id, force)
    if row is None:
        return "waiting"
    try:
        payment = container.orchestrator.get_payment(payment_id)  # fresh: refunds since it was listed count
        outcome = _recover(container, row, payment)
    except e.BillingError as exc:
        return _failed(container, row, exc.message)
    except Exception as exc:
        item_failed(log, "orphan recovery", exc, payment_id=payment_id)
        return _failed(container, row, f"{type(exc).__name__}: {exc}")
    return outcome


def _recover(container, row: dict, payment: Payment) -> str:
    user_id, plan = row["user_id"], row["item_price_id"]
    disputed = deciding_dispute(container, row["payment_id"])
    if disputed is not None:
        return _disputed(container, row, disputed)
    if payment.captured_in_part:  # it cannot pay a term: a person's, or the rest's capture (decision 229)
        _finish(container, row["payment_id"], "needs_review", last_error=captured_in_part_reason(payment))
        return "needs_review"
    with container.uow() as uow:
        frozen = uow.users.frozen_at(user_id)
    if frozen is not None:
        # A frozen account gets no automatic re-subscription: a person decides.
        _finish(container, row["payment_id"], "needs_review", last_error=review.FROZEN)
        with container.uow() as uow:
            review.alert_frozen(uow, container.clock, row["payment_id"], user_id)
            uow.commit()
        return "needs_review"
    recorded_on = _recorded_on(container, row["payment_id"])
    if recorded_on is not None and recorded_on != row["subscription_id"] \
            and _subscription_status(container, recorded_on) != "cancelled":
        # An earlier attempt re-subscribed the user and moved the payment there; its activation failed, and
        # may have been completed since (the activations job, an operator). That subscription is this
        # payment's own: finish there, never a same-plan duplicate to refund.
        return _finish_resubscription(container, row, payment, recorded_on)
    if (row["last_error"] == review.FROZEN or (recorded_on is not None and recorded_on == row["subscription_id"])) \
            and _subscription_status(container, row["subscription_id"]) != "cancelled":
        # Held because the account was frozen, now unfrozen: the payment pays its own subscription. Once
        # recorded there (its activation may have failed since), it stays there: never a resubscription.
        return _record_on_own_subscription(container, row, payment)
    paid_by = _order_paid_by_another(container, row, payment) if recorded_on is None else None
    if paid_by is None and (holding := _active_same_plan(container, user_id, plan, exclude=row["subscription_id"])):
        paid_by = {"active_subscription": holding}
    if paid_by:  # the order was paid by another payment, or the plan is held (by another subscription)
        return _refund_duplicate(container, row, paid_by)  # idempotent: a refund already made is not repeated
    refunded = payment.refunded
    if payment.fully_refunded:
        # Refunded at the orchestrator before recovery: nothing to re-subscribe, nothing to refund.
        _reverse_credits(container, row["payment_id"])
        _end_unsubscribed(container, row["payment_id"], "resolved", "refunded_elsewhere")
        return "refunded_elsewhere"
    if refunded:
        _finish(container, row["payment_id"], "needs_review", last_error=f"partially refunded ({refunded})")
        _alert(container, f"Orphaned payment {row['payment_id']} is partially refunded - manual review required",
               f"orphan-partial:{row['payment_id']}")
        return "needs_review"
    if _subscription_status(container, row["subscription_id"]) == "future":
        # Its own checkout still waits to start (handed here as a possible second charge of its order, and
        # nothing keeps the first any more): it pays that subscription, never a new one beside it (decision 253).
        return _record_on_own_subscription(container, row, payment)
    return _resubscribe(container, row, payment)


def _disputed(container, row: dict, found: dict) -> str:
    """A charged-back payment (the customer has the money back) is neither re-subscribed (a subscription
    and a paid invoice for money that is gone, renewed next month) nor refunded (the money would go back
    twice): its row ends, and a purchase recorded for it is closed (its credits went back with the loss).
    Under an undecided dispute a person answers the dispute first (decision 172)."""
    payment_id = row["payment_id"]
    if found["state"] == "open":
        _finish(container, payment_id, "needs_review", last_error=f"disputed (dispute {found['dispute_id']} open)")
        return "needs_review"
    _end_unsubscribed(container, payment_id, "resolved", "charged_back")
    log.warning("orphaned payment charged back: ended without a subscription or a refund",
                extra={"payment_id": payment_id, "dispute_id": found["dispute_id"]})
    return "charged_back"


def _record_on_own_subscription(container, row: dict, payment: Payment) -> str:
    recorded = record_payment(container, payment, "orphan_recovery")
    if recorded.get("refunded_unpaid_period") == row["payment_id"]:
        return "resolved"  # its invoice was voided or paid meanwhile: refunded, its row ended (decisions 113, 179)
    _require_activation(recorded, f"recorded {row['payment_id']}")
    _finish(container, row["payment_id"], "recovered", resolution=review.RECORDED)
    return "recovered"


def _require_activation(recorded: dict, what: str) -> None:
    """A recorded payment whose subscription is not active yet is a failed attempt: the next one finishes."""
    activation = recorded.get("activation")
    if activation == "pending":
        raise e.ExternalError(f"{what} but activation is pending: {recorded['activation_error']}")
    if activation not in ("activated", "already_active"):  # cancelled at the provider meanwhile
        raise e.ExternalError(f"{what} but its subscription was not activated: {activation}")


def _recorded_on(container, payment_id: str) -> str | None:
    """The subscription the payment's purchase is on (None: not recorded)."""
    with container.uow(autocommit=True) as uow:
        bought = uow.purchases.by_payment_id(payment_id)
    return bought["subscription_id"] if bought is not None else None


def _order_paid_by_another(container, row: dict, payment: Payment) -> dict | None:
    """What holds another payment of this payment's order that we keep (the subscription it is on, or the
    payment a person kept): the order was paid already, and this charge is its duplicate. Another purchase
    on the order's subscription answers without a call; a payment recovery moved to a subscription of its
    own is found through the orchestrator's payments of the order, kept when its purchase is not closed
    (decision 221), and so is one a person marked handled (decision 252)."""
    with container.uow(autocommit=True) as uow:
        if uow.purchases.other_payment_of(row["subscription_id"], row["payment_id"]):
            return {"active_subscription": row["subscription_id"]}
    if not payment.order_id:
        return None
    others = [p.id for p in container.orchestrator.payments_of_order(payment.order_id)
              if p.id != payment.id and p.status in CAPTURED_STATUSES]
    handled = []
    with container.uow(autocommit=True) as uow:
        for other in others:
            kept = uow.purchases.by_payment_id(other)
            if kept is not None and kept["closed_at"] is None:
                return {"active_subscription": kept["subscription_id"]}
            if kept is None and (uow.orphans.get(other) or {}).get("resolution") == "handled":
                handled.append(other)
    # A charge a person marked handled stands by their decision (decision 252): it paid the order, unless
    # its money went back since (refunded in full at the orchestrator, or charged back).
    return next(({"paid_by": other} for other in handled if not money_returned(container, other)), None)


def _active_same_plan(container, user_id: str, plan: str, exclude: str | None) -> str | None:
    with container.uow() as uow:
        candidates = uow.subscriptions.holding_plan(user_id, plan, exclude)
    for sub_id in candidates:  # the provider is the source of truth (a paid one may wait for its activation)
        if container.provider.get_subscription(sub_id).status in (*STARTED_OR_HELD, "future"):
            return sub_id
    return None


def _refund_duplicate(container, row: dict, holder: dict) -> str:
    """`holder`: what keeps the order's or the plan's other payment (`active_subscription`, or `paid_by`)."""
    payment_id = row["payment_id"]
    _alert(container, DUPLICATE_TEXT, f"orphan-duplicate:{payment_id}", payment_id=payment_id,
           user_id=row["user_id"], plan=row["item_price_id"], **holder)
    refund(container, payment_id)
    from billingctl.adapters.faults import crash_point

    crash_point(container.settings, "orphan.after_refund")
    _reverse_credits(container, payment_id)
    _end_unsubscribed(container, payment_id, "duplicate_refunded", "refunded")
    log.warning(DUPLICATE_TEXT, extra={"payment_id": payment_id, **holder})
    return "duplicate_refunded"


def _resubscribe(container, row: dict, payment: Payment) -> str:
    from billingctl.services.checkout import create_pending_subscription

    # The request is the same on every attempt (its start counted from when the orphan was found): a key
    # sent again with other parameters is refused by the provider, and the key is what keeps an attempt
    # cut short after the provider created the subscription from creating a second one.
    created = create_pending_subscription(container, row["user_id"], row["item_price_id"], row["created_at"],
                                          f"orphan-subscription:{row['payment_id']}")
    from billingctl.adapters.faults import crash_point

    crash_point(container.settings, "orphan.after_subscription_created")
    _move_purchase(container, row["payment_id"], created.subscription.id)
    return _finish_resubscription(container, row, payment, created.subscription.id)


def _finish_resubscription(container, row: dict, payment: Payment, sub_id: str) -> str:
    # Like a checkout: the payment pays the first invoice of the new subscription, which activation
    # starts (and so invoices); nothing is left payment_due for the renewals job to charge again.
    recovered = payment.but(order_id=sub_id, metadata=payment.metadata.model_copy(update={"subscription_id": sub_id}))
    _require_activation(record_payment(container, recovered, "orphan_recovery"), f"re-subscribed {sub_id}")
    _finish(container, row["payment_id"], "recovered", resolution="resubscribed", new_subscription=sub_id)
    return "recovered"


def _move_purchase(container, payment_id: str, new_subscription: str) -> None:
    """A payment credited for a checkout the provider had cancelled keeps its purchase (and credits):
    the purchase moves to the new subscription, whose first invoice it then pays."""
    with container.uow() as uow:
        uow.purchases.move_to(payment_id, new_subscription)
        uow.commit()


def _reverse_credits(container, payment_id: str) -> None:
    """Credits a refunded orphan was given before it became one go back (a no-op when it never was)."""
    payment = container.orchestrator.get_payment(payment_id)
    reverse_refund(container, payment_id, payment.refunded,
                   "orphan_recovery")


def _failed(container, row: dict, error: str) -> str:
    attempts = row["attempts"] + 1
    now = container.clock.now()
    if attempts >= ORPHAN_MAX_ATTEMPTS:
        _finish(container, row["payment_id"], "exhausted", attempts=attempts, last_error=error[:500])
        _alert(container, EXHAUSTED_TEXT, f"orphan-exhausted:{row['payment_id']}", payment_id=row["payment_id"],
               user_id=row["user_id"], attempts=attempts, last_error=error[:200])
        log.error(EXHAUSTED_TEXT, extra={"payment_id": row["payment_id"]})
        return "exhausted"
    # Each attempt is timed from when it was due, not from when the job got to it: the schedule does not
    # drift by one job tick per attempt (a manual retry ahead of schedule counts from now).
    due = row["next_attempt_at"]
    base = due if due is not None and due <= now else now
    with container.uow() as uow:
        uow.orphans.set(row["payment_id"], attempts=attempts, last_error=error[:500],
                        next_attempt_at=base + orphan_retry_delay(attempts), updated_at=now)
        uow.commit()
    log.warning("orphan recovery attempt failed: %s", error, extra={"payment_id": row["payment_id"],
                                                                    "attempts": attempts})
    return "retrying"


def _end_unsubscribed(container, payment_id: str, status: str, resolution: str, resolved_by: str | None = None):
    """The row ends without a subscription for its payment (refunded, charged back, or handled by a person):
    a purchase recorded for it here, never on the provider's books, is closed in the same transaction once
    its credits are back (`review.close_purchase_ended`; a refund still pending at the processor closes it
    when its notification reverses them). Left open, no follow-up would ever record it, and reconcile named
    it every day as not on the provider's invoice (decision 173)."""
    with container.uow() as uow:
        review.move(container, uow, payment_id, status, updated_at=container.clock.now(), next_attempt_at=None,
                    resolution=resolution, **({"resolved_by": resolved_by} if resolved_by else {}))
        review.close_purchase_ended(uow, payment_id, container.clock.now())
        uow.commit()


def _refuse_credits_kept_off_the_providers_books(container, payment_id: str) -> None:
    """Marked handled, a payment credited here and not recorded at the provider would keep its credits with
    no invoice behind them (reconcile names it every day, and nothing else would ever act on it): a person
    gives it its subscription or refunds it; once its credits are back (a refund, a lost dispute), it may
    be marked handled (decision 173)."""
    with container.uow(autocommit=True) as uow:
        row = uow.purchases.by_payment_id(payment_id)
        kept = 0 if row is None or row["closed_at"] or row["provider_recorded_at"] else \
            int(row["credits"]) - uow.ledger.reversed_for(payment_id)
    if kept > 0:
        raise e.Refused(
            f"payment {payment_id} is credited here ({kept} credits) and not recorded at the provider: marked "
            f"handled, it would keep them with no invoice behind them; give it a subscription (billingctl orphans "
            f"resolve {payment_id} --create-subscription --reason R --yes) or refund it (billingctl orphans "
            f"resolve {payment_id} --refund --reason R --yes)")


def _finish(container, payment_id: str, status: str, resolution: str | None = None, attempts: int | None = None,
            last_error: str | None = None, new_subscription: str | None = None, resolved_by: str | None = None):
    values = {"updated_at": container.clock.now(), "next_attempt_at": None}
    if resolution:
        values["resolution"] = resolution
    if attempts is not None:
        values["attempts"] = attempts
    if last_error is not None:
        values["last_error"] = last_error
    if resolved_by:
        values["resolved_by"] = resolved_by
    if new_subscription:
        values["subscription_id"] = new_subscription
    with container.uow() as uow:
        review.move(container, uow, payment_id, status, **values)
        uow.commit()


def _alert(container, text: str, key: str, **fields) -> None:
    with container.uow() as uow:
        alerts.raise_alert(uow, container.clock, text, key, **fields)
        uow.commit()


def _read_cursor(container):
    value = read_value(container, CURSOR)
    return parse_time(value) if value else None


def _write_cursor(container, when) -> None:
    write_value(container, CURSOR, when.isoformat())


# ---- manual review (spec rule 7) -----------------------------------------------------------------------

def list_orphans(container, state: str | None = None) -> list[dict]:
    with container.uow() as uow:
        return uow.orphans.listing(state)


def show(container, payment_id: str) -> dict:
    row, payment, holds = _looked_up(container, payment_id)
    return {"orphan": row,
            "payment": payment.wire() if isinstance(payment, Payment) else {"unavailable": payment.message},
            "user_subscriptions": holds}


def _looked_up(container, payment_id: str) -> tuple[dict, Payment | e.BillingError, list]:
    """(the review row, the orchestrator's payment or why it could not be read, the user's holdings)."""
    with container.uow() as uow:
        row = uow.orphans.get(payment_id)
        if row is None:
            raise e.NotFound(f"no orphan record for payment {payment_id}")
        holds = uow.subscriptions.holdings_of_customer(row["user_id"])
    try:
        payment = container.orchestrator.get_payment(payment_id)
    except e.BillingError as exc:
        payment = exc
    return dict(row), payment, holds


def retry(container, payment_id: str, actor: str) -> dict:
    row = show(container, payment_id)["orphan"]
    if row["status"] not in (*OPEN, *HUMAN):
        raise e.Refused(f"payment {payment_id} is {row['status']}: nothing to retry")
    outcome = attempt(container, payment_id, force=True)
    _audit(container, actor, "orphans.retry", payment_id, None, {"outcome": outcome})
    return {"payment_id": payment_id, "outcome": outcome}


def resolve(container, payment_id: str, action: str, reason: str, actor: str, dry_run: bool = False) -> dict:
    if not reason or not reason.strip():
        raise e.InvalidInput("a reason is required")
    row, payment, _ = _looked_up(container, payment_id)
    if row["status"] not in (*OPEN, *HUMAN):
        raise e.Refused(f"payment {payment_id} is already {row['status']}")
    if isinstance(payment, e.BillingError) and not isinstance(payment, e.ExternalNotFound):
        # Every action is checked against the orchestrator's payment (a second charge of its order, a refund
        # or dispute); unread, none is taken (decision 228). One it does not hold may still be marked handled.
        raise e.ExternalUnavailable(f"payment {payment_id} could not be read at the orchestrator ({payment.message}):"
                                    " nothing was changed; try again", dependency="orchestrator")
    refunded = payment.refunded if isinstance(payment, Payment) else 0  # 0 when it could not be read
    if action == "refund" and refunded > 0:
        raise e.Refused(f"payment {payment_id} was already refunded ({refunded})")
    if action == "create-subscription" and refunded > 0:
        raise e.Refused(f"payment {payment_id} was refunded: a subscription cannot be created for it")
    if action not in ("refund", "create-subscription", "mark-handled"):
        raise e.InvalidInput("choose one of --create-subscription, --refund, --mark-handled")
    if action != "mark-handled" and not isinstance(payment, Payment):
        raise e.ExternalUnavailable(f"payment {payment_id} could not be read at the orchestrator: {payment.message}",
                                    dependency="orchestrator")
    if action in ("refund", "create-subscription"):
        refuse_if_disputed(container, payment_id, f"--{action}")
    if action in ("mark-handled", "create-subscription") and isinstance(payment, Payment):
        _refuse_a_kept_second_charge(container, payment, action)
    if action == "mark-handled":
        _refuse_credits_kept_off_the_providers_books(container, payment_id)
    if action == "create-subscription":
        if isinstance(payment, Payment) and payment.captured_in_part:
            raise e.Refused(f"payment {payment_id} is captured in part ({int(payment.processor.amount_captured or 0)}"
                            f" of {payment.charged}): it cannot pay a term; refund what was captured (billingctl "
                            f"orphans resolve {payment_id} --refund --reason R --yes), or wait until the rest is "
                            "captured")
        _refuse_a_frozen_account(container, row["user_id"], payment_id)
        _refuse_a_second_subscription_of_a_held_plan(container, row, payment_id)
    plan = {"payment_id": payment_id, "action": action, "state": row["status"]}
    if dry_run:
        return {**plan, "dry_run": True}
    if action == "refund":
        refund(container, payment_id)
        _reverse_credits(container, payment_id)
        _end_unsubscribed(container, payment_id, "resolved", "refunded", resolved_by=actor)
    elif action == "create-subscription":
        with container.uow() as uow:
            review.move(container, uow, payment_id, "retrying")
            uow.commit()
        claimed = _claim(container, payment_id, force=True)
        if claimed is None:
            raise e.Refused(f"payment {payment_id} is being worked on; try again")
        _resubscribe(container, claimed, payment)  # writes the resolution and the new subscription
        _finish(container, payment_id, "resolved", resolved_by=actor)
    else:
        _end_unsubscribed(container, payment_id, "resolved", "handled", resolved_by=actor)
    _audit(container, actor, f"orphans.resolve.{action}", payment_id, reason, plan)
    return {**plan, "state": "resolved"}


def _refuse_a_frozen_account(container, user_id: str | None, payment_id: str) -> None:
    """A frozen account is credited nothing (spec section 4): a subscription for a frozen customer's payment
    waits for the unfreeze, refused before anything is created (found by the model-based exploration: credits
    after the freeze). Recording reads the freeze again under the user's row (decision 177)."""
    if not user_id:
        return
    with container.uow(autocommit=True) as uow:
        frozen = uow.users.frozen_at(user_id)
    if frozen is not None:
        raise review.frozen_refusal(user_id, payment_id)


def _refuse_a_second_subscription_of_a_held_plan(container, row: dict, payment_id: str) -> None:
    """A new subscription for a payment whose customer holds the plan live (its own checkout's, paid by a
    payment support refunded at the orchestrator, or another) would be billed beside it every term (found
    by the exploration, decision 182). Refused, naming the holder: refund the payment, or cancel the holder."""
    if not row["user_id"] or not row["item_price_id"]:
        return
    holding = _active_same_plan(container, row["user_id"], row["item_price_id"], exclude=None)
    if holding:
        raise e.Refused(f"payment {payment_id}: {row['user_id']} already holds {row['item_price_id']} ({holding}), "
                        "so --create-subscription would bill the plan twice; refund it (billingctl orphans resolve "
                        f"{payment_id} --refund --reason R --yes), or cancel {holding} first")


def _refuse_a_kept_second_charge(container, payment: Payment, action: str) -> None:
    """A payment kept (marked handled, or given a subscription of its own) while another captured payment of
    the same order stands unrefunded would leave the customer charged twice for one checkout or period (found
    by the model-based exploration: an operator marked a same-plan duplicate handled, and it was never
    refunded). Refused: refund it (`--refund`), or refund the other first."""
    if payment.fully_refunded or not payment.order_id:
        return
    others = [p.id for p in container.orchestrator.payments_of_order(payment.order_id)
              if p.id != payment.id and p.status in ("SETTLED", "PARTIALLY_SETTLED")]
    standing = [pid for pid in others if not container.orchestrator.get_payment(pid).fully_refunded]
    if standing:
        raise e.Refused(f"payment {payment.id} is a second charge of order {payment.order_id} (paid by "
                        f"{', '.join(standing)}): --{action} would leave the customer charged twice; refund it "
                        f"(billingctl orphans resolve {payment.id} --refund --reason R --yes)")


def _audit(container, actor, action, target, reason, details) -> None:
    with container.uow() as uow:
        uow.audit.record(actor, action, target, reason, details, container.clock.now())
        uow.commit()
