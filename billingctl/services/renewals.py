"""Renewals and dunning (spec sections 2 rule 7, 3 "Authorization-attempt quota" rule 2 and "NSFW
renewal card substitution"): one merchant-initiated attempt per due invoice per tick, routed to the
user's locked processor, each invoice isolated from the others.

Retry schedule: after a failed attempt the next one waits `BILLING_RENEWAL_RETRY_HOURS[n]` (default
1 h, 24 h, 72 h, 120 h: five attempts over about nine days). When the schedule is exhausted the
subscription is cancelled at the provider, the user is notified, and an `exhausted` row closes the
invoice's dunning; the invoice stays payment_due at the provider (visible in `renewals list`)."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from billingctl.adapters.logs import item_failed
from billingctl.adapters.payloads import Invoice, Payment
from billingctl.domain import errors as e
from billingctl.domain import lifecycle
from billingctl.domain.batch import BatchResult
from billingctl.domain.clock import parse_time
from billingctl.domain.instruments import stored_instrument, usable_card
from billingctl.domain.quota import MERCHANT
from billingctl.services import alerts, catalog, fraud_quota, fraud_signals
from billingctl.services.invoices import owed_again
from billingctl.services.lifecycles import report_illegal
from billingctl.services.payments import NO_ANSWER, dunning_step, end_renewal_attempt, record_payment

log = logging.getLogger("billingctl.renewals")

# Attempts that count toward the retry schedule (a lock-read abort, a quota block, or an orchestrator
# error whose outcome is unknown do not: the next tick simply tries again).
COUNTED = ("declined", "failed")
FINAL = lifecycle.DUNNING_ENDED
IN_FLIGHT = lifecycle.IN_FLIGHT  # orchestrator statuses of a charge still in flight: neither paid nor declined
VOIDABLE = lifecycle.VOIDABLE


def run_renewals(container, dry_run: bool = False, progress=None) -> dict:
    """The dunning tick: every unpaid invoice (payment_due or not_paid) that belongs to a renewal. A dry run makes every
    check of the real run and stops where it would charge (`would_charge`), listing each invoice."""
    outcomes: dict[str, int] = {}
    failures, plan = [], []
    due = list(container.provider.list_invoices(status=lifecycle.INVOICE_COLLECTED))
    if progress:
        progress(0, new_total=len(due))
    started, limit = time.monotonic(), container.settings.renewals_tick_max_seconds
    for n, invoice in enumerate(due):
        if progress:
            progress(1)
        if n and not dry_run and time.monotonic() - started > limit:
            # A long backlog spreads over ticks instead of overrunning the job's lease: what is left is
            # still payment_due, and the next tick takes it up.
            outcomes["deferred"] = len(due) - n
            log.info("renewals tick stopped at its time budget; the next tick continues",
                     extra={"deferred": len(due) - n})
            break
        try:
            outcome = attempt_invoice(container, invoice, dry_run=dry_run)
            if dry_run:
                plan.append({"invoice_id": invoice.id, "outcome": outcome})
        except Exception as exc:  # one invoice never stops the others
            outcome = "error"
            failures.append({"invoice_id": invoice.id, "error": getattr(exc, "message", str(exc))})
            item_failed(log, "renewal attempt", exc, invoice_id=invoice.id)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    if dry_run:
        return BatchResult({"dry_run": True, "outcomes": outcomes, "invoices": plan, "errors": failures},
                           done=len(plan), failed=len(failures), errors=failures)
    if "deferred" not in outcomes:
        for outcome, count in sweep_in_flight(container, {invoice.id for invoice in due}).items():
            key = outcome if outcome == "error" else f"swept_{outcome}"
            outcomes[key] = outcomes.get(key, 0) + count
    failed = outcomes.get("error", 0)
    return BatchResult({"outcomes": outcomes, "errors": failures}, failed=failed, errors=failures,
                       skipped=outcomes.get("deferred", 0), done=sum(outcomes.values()) - failed
                       - outcomes.get("deferred", 0))


def _history(uow, invoice_id: str) -> list[dict]:
    return uow.dunning.history(invoice_id)


def _record(container, invoice: dict, status: str, resolves: dict | None = None, **values) -> bool:
    """One step of the invoice's dunning (domain.lifecycle.DUNNING); False when it was not written (the
    pending row it would end was ended by another path, or the table refuses the step)."""
    with container.uow() as uow:
        written = dunning_step(container, uow, invoice, status, resolves=resolves, **values)
        uow.commit()
    return written


def _target(remote: Invoice) -> dict:
    """Our reference to a renewal invoice, from the provider's copy: the keys the dunning rows and every
    step of an attempt name (a sweep builds the same from a dunning row)."""
    return {"id": remote.id, "subscription_id": remote.subscription_id, "customer_id": remote.customer_id,
            "currency_code": remote.currency_code or "USD", "amount": int(remote.amount_due or remote.total or 0),
            "item_price_id": remote.item_price_id}


def _second_subscription(container, invoice: dict, holder: str) -> str:
    """The customer holds the plan on another live subscription (support reactivated a cancelled one at the
    provider after the customer bought the plan again): one live subscription per customer and plan
    (decision 110), so this invoice is not charged, and one alert asks a person to cancel one of them
    (decision 186). The holder is the one paid last (`Subscriptions.plan_holder`), so its renewals go on."""
    sub_id, user_id = invoice["subscription_id"], invoice["customer_id"]
    return _not_charged(
        container, invoice, "second_subscription",
        f"{user_id} holds {invoice['item_price_id'] or 'one plan'} on two live subscriptions: {holder}, paid "
        f"last, renews; invoice {invoice['id']} of {sub_id} is not charged. Cancel {sub_id} (billingctl "
        f"subscriptions cancel {sub_id} --reason R --yes) and void the invoice at the provider, or cancel "
        f"{holder} if the customer keeps {sub_id}", f"second-subscription:{sub_id}", holder=holder)


def _not_charged(container, invoice: dict, outcome: str, text: str, key: str, **fields) -> str:
    """An invoice the renewal job will not charge, said once to a person (the alert's key dedupes it)."""
    with container.uow() as uow:
        alerts.raise_alert(uow, container.clock, text, key, subscription_id=invoice["subscription_id"],
                           invoice_id=invoice["id"], user_id=invoice["customer_id"], **fields)
        uow.commit()
    return outcome


def _overlapped(term: tuple | None, current_term_end) -> bool:
    """By our copy, the invoice bills a term the subscription's current term overlaps without being it
    (decision 191). The current term's own invoice (same end), a copy of ours behind the provider's renewal
    (a later end), and an earlier term that ended before the current one began (arrears of an unbroken
    subscription) do not overlap it."""
    if term is None or current_term_end is None:
        return False
    date_from, date_to = term
    end = int(current_term_end.timestamp())
    return end - (date_to - date_from) < date_to < end


def _superseded(container, term: tuple, invoice: dict, dry_run: bool = False) -> bool:
    """The provider's word, asked only when our copy says the terms overlap (a copy behind a term-end change
    at the provider would say so too): its current term began inside the invoice's term, so a
    reactivation restarted it and charging both would have the customer pay twice for the days they
    share. The copy read is applied (not by a dry run), so a stale one is asked about once; once it has said so
    (its alert is queued), it is not asked again each tick."""
    from billingctl.services.sync import apply_remote_subscription

    with container.uow(autocommit=True) as uow:
        if uow.outbox.queued(_superseded_key(invoice)):
            return True
    remote = container.provider.get_subscription(invoice["subscription_id"])
    if not dry_run:  # a dry run writes nothing, not even a fresher copy
        apply_remote_subscription(container, remote, "renewals")
    start = remote.current_term_start
    return remote.status in lifecycle.RENEWING and start is not None and term[0] < start < term[1]


def _superseded_term(container, invoice: dict, local: dict) -> str:
    """Not charged, with one alert: the provider keeps the old term's invoice payment_due (it collects no
    unpaid invoice on a reactivation), so a person voids it or writes it off there."""
    sub_id, user_id = invoice["subscription_id"], invoice["customer_id"]
    return _not_charged(
        container, invoice, "superseded_term",
        f"invoice {invoice['id']} of {sub_id} ({user_id}) bills a term the subscription's current term, up to "
        f"{local['current_term_end']:%Y-%m-%d}, overlaps: it was reactivated with a new term. The new term is "
        f"charged; this invoice is not. Void it or write it off at the provider", _superseded_key(invoice))


def _credit_short(remote: Invoice, term: tuple | None, paid: dict | None) -> int:
    """How much more an invoice whose term overlaps a paid one must be credited before it is charged: the
    share of its total that the days already paid make (its term's seconds the paid term covers, rounded
    down), less what a person adjusted on it (decision 248; decision 204 took any adjustment as enough). At
    least 1 while the paid term's days are not known from our copy (`paid`) and nothing is adjusted."""
    adjusted, total = int(remote.amount_adjusted or 0), int(remote.total or 0)
    if term is None or paid is None or paid["term_start"] is None or paid["term_end"] is None:
        return 0 if adjusted else max(total, 1)
    start, end = (int(parse_time(t).timestamp()) for t in term)
    shared = min(end, int(paid["term_end"].timestamp())) - max(start, int(paid["term_start"].timestamp()))
    owed = total * max(shared, 0) // (end - start) if end > start else total
    return max(owed - adjusted, 0)


def _overlaps_paid_term(container, invoice: dict, paid_invoice_id: str, paid: dict | None, short: int,
                        adjusted: int) -> str:
    """Not charged, with one alert (decision 204): a kept payment of the subscription paid a term this
    invoice's overlaps (support cancelled it mid-term and reactivated it at the provider, whose general
    reactivation starts a new term and invoices all of it, with no proration, or cut a paid term short
    there). A person voids this invoice and sets the term end back to the paid term's end there, or credits
    the days already paid (`short` more than what is adjusted on it, `adjusted`: one alert for each
    adjustment that falls short, decision 248). `paid`: our copy of the paid invoice."""
    until = f" up to {paid['term_end']:%Y-%m-%d %H:%M} UTC" if paid is not None and paid["term_end"] else ""
    sub_id, user_id = invoice["subscription_id"], invoice["customer_id"]
    return _not_charged(
        container, invoice, "overlaps_paid_term",
        f"invoice {invoice['id']} of {sub_id} ({user_id}) bills a term that overlaps one a kept payment already "
        f"paid (invoice {paid_invoice_id}{until}): reactivated, or its term end moved, at the provider. It is "
        f"not charged. Void it and set the subscription's term end back to the paid term's end at the provider "
        f"(the next term then renews from there), or credit the days already paid on it there (an adjustment "
        f"credit note of {short} {invoice['currency_code']} more): the rest is then charged",
        f"overlaps-paid-term:{invoice['id']}" + (f":adjusted-{adjusted}" if adjusted else ""),
        paid_invoice_id=paid_invoice_id, credit_short=short)


def _superseded_key(invoice: dict) -> str:
    return f"superseded-term:{invoice['id']}"


def attempt_invoice(container, remote: Invoice, dry_run: bool = False) -> str:
    remote = Invoice.read(remote)  # typed already, or a copy as the provider sent it
    invoice = _target(remote)
    now = container.clock.now()
    sub_id, user_id = invoice.get("subscription_id"), invoice.get("customer_id")
    with container.uow(autocommit=True) as uow:
        history = _history(uow, invoice["id"])
    last = history[-1] if history else None
    if last is not None and last["status"] == "pending" and last["resolved_at"] is None:
        # A charge is in flight for this invoice: never a second one; read how it ended before anything else
        # about the invoice, whatever became of it or its subscription meanwhile (a cheque paid part of it,
        # an operator cancelled it): the sweep skips every invoice the tick listed (decisions 189, 194).
        return "in_flight" if dry_run else _resolve_in_flight(container, invoice, last, history)
    lost = _lost_answer(history)
    if lost is not None and not dry_run:
        # A charge whose answer was lost may have been made (or still be running): its order is read back
        # before anything else about the invoice, whatever rows followed it (an aborted attempt, a quota
        # block) and whatever became of the invoice or its subscription (decision 239). One that exists is
        # that attempt's outcome.
        found = _read_back_lost(container, invoice, lost, history)
        if found != "nothing_charged":
            return found
    term = remote.term
    with container.uow() as uow:
        standing = uow.purchases.invoice_standing(
            invoice["id"], sub_id, tuple(parse_time(t) for t in term) if term is not None else None)
        if standing.removed:  # finance removed our payment from it at the provider: a person's (decision 184)
            if not dry_run:
                owed_again(container, uow, invoice["id"], remote.status)
                uow.commit()
            return "payment_removed"
        if standing.checkout:
            return "not_a_renewal"  # a checkout's first invoice: the customer pays it at checkout
        if standing.paid:
            return "already_paid"  # a recorded payment pays it; its report to the provider is pending work
        if standing.waiting:
            return "activation_pending"  # a paid checkout whose first invoice is being assigned
        local = uow.subscriptions.get(sub_id)
        frozen = uow.users.frozen_at(user_id)
        in_dispute = fraud_signals.disputed(uow, user_id)
        holder = uow.subscriptions.plan_holder(user_id, local["item_price_id"]) if local is not None else None
        paid = uow.invoices.get(standing.paid_overlap) if standing.paid_overlap is not None else None
    if any(h["status"] in FINAL for h in history):
        return "closed"
    if local is None or local["status"] not in lifecycle.RENEWING:
        return "not_a_renewal"
    if last is not None and last["next_attempt_at"] is not None and last["next_attempt_at"] > now:
        return "not_due"
    if holder is not None and holder != sub_id:  # a charge in flight is read first, above
        return "second_subscription" if dry_run else _second_subscription(container, invoice, holder)
    if _overlapped(term, local["current_term_end"]) and _superseded(container, term, invoice, dry_run):
        return "superseded_term" if dry_run else _superseded_term(container, invoice, local)
    if standing.unended_overlap is not None:
        # Another term's charge that these days share may still settle (decision 258): its end decides
        # (settled, this term overlaps a paid one; else it is charged), never two charges for one day.
        return "overlap_in_flight"
    if standing.paid_overlap is not None:  # a person's credit of the days already paid ends it
        short = _credit_short(remote, term, paid)
        if short:
            return "overlaps_paid_term" if dry_run else _overlaps_paid_term(
                container, invoice, standing.paid_overlap, paid, short, int(remote.amount_adjusted or 0))
    if frozen is not None:
        return "skipped_frozen"
    if in_dispute:
        return "skipped_disputed"  # decision 102: no merchant-initiated charge while a dispute is undecided
    if dry_run:
        return "would_charge"
    counted = sum(1 for h in history if h["status"] in COUNTED)
    attempt_no = counted + 1
    amount, item_price_id = invoice["amount"], invoice["item_price_id"]
    lane = local["lane"] or catalog.plan(container, item_price_id).lane

    # Spec section 2 rule 7: never route without a processor. A failed read aborts this attempt on
    # either lane; the next tick re-reads.
    try:
        with container.uow() as uow:
            lock = uow.locks.read(user_id) or {}
    except Exception as exc:
        log.error("renewal aborted: processor lock read failed: %s", type(exc).__name__,
                  extra={"invoice_id": invoice["id"], "lane": lane})
        _record(container, invoice, "aborted", decline_code="lock_read_failed", attempt_no=attempt_no, lane=lane,
                amount=amount)
        return "aborted"
    processor = lock.get(f"{lane}_processor") or None
    if not processor:
        return _failed(container, invoice, "failed", "no_locked_processor", attempt_no, lane, None, amount, history)

    # The quota's check and this attempt's reservation are one transaction under the user's row lock;
    # the reservation becomes the payment's attempt, or is released when no authorization happened.
    reservation = f"order:{invoice['id']}"
    with container.uow() as uow:
        decision = fraud_quota.reserve(uow, container.settings, user_id, lane, now, MERCHANT, reservation, amount,
                                       clock=container.clock, order_id=invoice["id"])
        uow.commit()
    if decision is not None and not decision.allowed:
        log.warning("MIT blocked: authorization count quota exhausted",
                    extra={"invoice_id": invoice["id"], "user_id": user_id, "window": decision.blocking})
        frees = next((w.next_slot_frees_at for w in decision.windows if w.window == decision.blocking), None)
        _record(container, invoice, "quota_blocked", decline_code="authorization_quota", attempt_no=attempt_no,
                lane=lane, processor=processor, amount=amount, next_attempt_at=frees)
        return "quota_blocked"
    try:
        token = _resolve_token(container, user_id, lane, now)
        if token is None:
            _release(container, reservation)
            return _failed(container, invoice, "failed", "no_payment_method", attempt_no, lane, processor, amount,
                           history)
        metadata = {"psp": processor, "lane": lane, "user_id": user_id, "subscription_id": sub_id,
                    "item_price_id": item_price_id, "merchant_initiated": True}
        if lane == "nsfw" and lock.get("nsfw_processor_mid"):
            metadata["processor_merchant_id"] = lock["nsfw_processor_mid"]
        # The key names the attempt: after an answer that was lost, the next tick sends the same request
        # and the orchestrator replays the original payment instead of charging again.
        payment = container.orchestrator.create_payment(
            payment_method_token=token, amount=amount, currency_code=invoice["currency_code"],
            order_id=invoice["id"], customer_id=user_id, metadata=metadata,
            idempotency_key=f"renewal:{invoice['id']}:{attempt_no}")
    except e.ExternalError as exc:
        _release(container, reservation)  # no payment came back: no authorization is counted
        return _charge_error(container, invoice, exc, attempt_no, lane, processor, amount, history)
    with container.uow() as uow:
        fraud_quota.count_authorization(uow, now, payment, lane, user_id)
        uow.commit()
    if payment.status in IN_FLIGHT:
        if not _record(container, invoice, "pending", attempt_no=attempt_no, lane=lane, processor=processor,
                       amount=amount, payment_id=payment.id, decline_code=payment.status) \
                and (ended := _ended_meanwhile(container, invoice, "in flight")):
            return ended
        log.info("renewal charge in flight", extra={"invoice_id": invoice["id"], "payment_id": payment.id,
                                                     "status": payment.status})
        return "pending"
    return _charged(container, invoice, payment, attempt_no, lane, processor, amount, history)


def _read_back(container, invoice, history, attempt_no, lane, processor, amount) -> str | None:
    """The outcome of a charge whose answer was lost, read from the orchestrator's payments of the
    invoice (its order id): None when it made none (charge now), else that payment's outcome. A read that
    fails charges nothing this tick."""
    known = {h["payment_id"] for h in history if h["payment_id"]}
    try:
        made = [p for p in container.orchestrator.payments_of_order(invoice["id"]) if p.id not in known]
        if not made:
            return None
        payment = container.orchestrator.get_payment(made[-1].id)
    except e.ExternalError as exc:
        log.warning("a lost charge could not be read back; nothing charged this tick: %s", exc.message,
                    extra={"invoice_id": invoice["id"]})
        return "read_back_failed"
    log.warning("a charge whose answer was lost was found at the orchestrator: it is this attempt",
                extra={"invoice_id": invoice["id"], "payment_id": payment.id, "status": payment.status})
    if payment.status in IN_FLIGHT:
        with container.uow() as uow:
            fraud_quota.count_authorization(uow, container.clock.now(), payment, lane, invoice.get("customer_id"))
            dunning_step(container, uow, invoice, "pending", attempt_no=attempt_no, lane=lane, processor=processor,
                         amount=amount, payment_id=payment.id, decline_code=payment.status)
            uow.commit()
        return "pending"
    return _charged(container, invoice, payment, attempt_no, lane, processor, amount, history)


def _release(container, reservation: str) -> None:
    with container.uow() as uow:
        fraud_quota.release(uow, reservation)
        uow.commit()


# Errors that mean the charge request itself is wrong (a token the orchestrator refuses, a malformed
# request): retrying the same request cannot succeed, so they count toward the retry schedule.
PERMANENT = (e.ExternalInvalidRequest, e.ExternalNotFound)
CHECKOUT_LOOKBACK = 6  # the latest NSFW purchases read back to find the latest checkout's card
ERROR_BACKOFF = timedelta(minutes=10)  # the first retry is the next tick
MAX_ERROR_BACKOFF = timedelta(hours=12)


def _charge_error(container, invoice, exc, attempt_no, lane, processor, amount, history) -> str:
    """A charge that returned no payment. A refused request counts toward exhaustion like a decline;
    refused credentials page once in any 24 hours (our fault, not the customer's); anything else (an outcome
    unknown, the breaker open, a 429) is retried with the same key, backing off while it repeats."""
    if isinstance(exc, PERMANENT):
        code = (exc.details or {}).get("api_error_code") or exc.code
        return _failed(container, invoice, "failed", code, attempt_no, lane, processor, amount, history)
    now = container.clock.now()
    if isinstance(exc, e.ExternalAuthError):
        with container.uow() as uow:
            alerts.raise_alert_every(uow, container.clock, "Renewals cannot charge: the payment orchestrator refused "
                                     f"our credentials ({exc.message})", "renewals-auth", timedelta(days=1))
            uow.commit()
    streak = 0
    for h in reversed(history):
        if h["status"] != "error":
            break
        streak += 1
    wait = min(ERROR_BACKOFF * 2 ** streak, MAX_ERROR_BACKOFF)
    if not _record(container, invoice, NO_ANSWER, decline_code=exc.code, attempt_no=attempt_no, lane=lane,
                   processor=processor, amount=amount, next_attempt_at=now + wait) \
            and (ended := _ended_meanwhile(container, invoice, "nothing")):
        return ended
    log.warning("renewal charge failed without an answer; same request next time: %s", exc.message,
                extra={"invoice_id": invoice["id"], "error": exc.code, "next_attempt_in_s": wait.total_seconds()})
    return "error"


def _ended_meanwhile(container, invoice, answered: str) -> str | None:
    """The end of the invoice's dunning when another path saw it before the tick wrote its charge's answer
    (the charge's notification came first: decisions 231, 232), else None."""
    with container.uow(autocommit=True) as uow:
        newest = uow.dunning.newest(invoice["id"])
    if newest is None or newest["status"] not in FINAL:
        return None
    log.info(f"renewal charge answered {answered}, but its end was seen already",
             extra={"invoice_id": invoice["id"], "status": newest["status"]})
    return newest["status"]


def _charged(container, invoice, payment, attempt_no, lane, processor, amount, history,
             pending: dict | None = None) -> str:
    """A final answer to a renewal charge (`pending`: the in-flight row it ends). Captured money is
    recorded (held for review when it is not the invoice's amount: a partial settle is never charged
    again in full); a decline moves the retry schedule on; a status the orchestrator does not document
    is reported and left in flight, never charged again."""
    status = payment.status
    with container.uow() as uow:  # an answer that was in flight takes its reservation now
        fraud_quota.count_authorization(uow, container.clock.now(), payment, lane, invoice.get("customer_id"))
        uow.commit()
    if status in ("SETTLED", "PARTIALLY_SETTLED"):
        # Recording ends a pending row itself (whichever path records first); this ends it when another
        # path recorded the payment before the row was written, and writes the outcome of a direct answer.
        outcome = record_payment(container, payment, "renewal")["outcome"]
        ended = "held" if outcome == "held_mismatch" else "succeeded"
        with container.uow() as uow:
            end_renewal_attempt(container, uow, invoice, payment.id, ended, attempted=True, attempt_no=attempt_no,
                                lane=lane, processor=processor, amount=amount)
            uow.commit()
        return ended
    if status not in ("DECLINED", "FAILED", "CANCELLED"):
        with container.uow() as uow:
            report_illegal(container, uow, lifecycle.IllegalTransition(
                "payment", str(payment.id), "pending", str(status)))
            if pending is None:
                dunning_step(container, uow, invoice, "pending", attempt_no=attempt_no, lane=lane,
                             processor=processor, amount=amount, payment_id=payment.id,
                             decline_code=str(status)[:64])
            uow.commit()
        return "in_flight"
    code = payment.status_reason.code or status
    return _failed(container, invoice, "declined", code, attempt_no, lane, processor, amount, history,
                   payment_id=payment.id, resolves=pending)


def _resolve_in_flight(container, invoice, last, history) -> str:
    """Read how a charge in flight ended; past its age limit (decision 103), end it: an authorization the
    workflow left is captured, a PENDING charge is cancelled, anything else is escalated."""
    try:
        payment = container.orchestrator.get_payment(last["payment_id"])
        if payment.status in IN_FLIGHT:
            payment = _past_age_limit(container, invoice, last, payment)
    except e.ExternalError as exc:
        log.warning("in-flight renewal charge could not be read or ended; next tick: %s", exc.message,
                    extra={"invoice_id": invoice["id"], "payment_id": last["payment_id"]})
        return "in_flight"
    if payment.status in IN_FLIGHT:
        return "in_flight"
    return _charged(container, invoice, payment, last["attempt_no"], last["lane"], last["processor"], last["amount"],
                    history, pending=last)


def _past_age_limit(container, invoice, last, payment: Payment) -> dict:
    """The payment after the action its age calls for (unchanged while it is within its limit), its age
    counted from when it was made (decision 239). A charge that can still be voided for an invoice nobody
    owes any more is voided whatever its age (decision 197)."""
    settings, status = container.settings, payment.status
    # Aged from when it was made: a charge whose answer was lost is written in flight only once read back.
    made = payment.made_at
    age = container.clock.now() - (min(last["created_at"], made) if made is not None else last["created_at"])
    uncaptured = status == "AUTHORIZED" and age > timedelta(minutes=settings.renewal_authorized_max_minutes)
    owed = _owed(container, invoice, term=uncaptured) if status in VOIDABLE else None
    settled = _invoice_settled(owed, payment.id) if owed is not None else None
    if settled is not None:
        log.warning("renewal charge in flight for an invoice nobody owes any more: cancelling",
                    extra={"invoice_id": invoice["id"], "payment_id": payment.id, "why": settled})
        return container.orchestrator.cancel_payment(payment.id, reason=f"renewal charge: {settled}")
    if uncaptured:
        unowed = _no_longer_owed(owed)
        if unowed is not None:  # voided at no cost, rather than captured and given back (decision 190)
            log.warning("renewal authorization left uncaptured past its limit for a term no longer owed: "
                        "cancelling", extra={"invoice_id": invoice["id"], "payment_id": payment.id, "why": unowed})
            return container.orchestrator.cancel_payment(payment.id, reason=f"renewal authorization: {unowed}")
        log.warning("renewal authorization left uncaptured past its limit: capturing",
                    extra={"invoice_id": invoice["id"], "payment_id": payment.id, "age_s": age.total_seconds()})
        return container.orchestrator.capture_payment(payment.id)
    if age <= timedelta(hours=settings.renewal_in_flight_max_hours):
        return payment
    if status == "PENDING":
        log.warning("renewal charge pending past its limit: cancelling",
                    extra={"invoice_id": invoice["id"], "payment_id": payment.id, "age_s": age.total_seconds()})
        return container.orchestrator.cancel_payment(payment.id, reason="renewal charge pending past its limit")
    container.metrics.renewal_charges_stuck.inc()
    with container.uow() as uow:
        alerts.raise_alert_every(uow, container.clock, f"Renewal charge {payment.id} for invoice {invoice['id']} "
                                 f"is still {status} after {age.total_seconds() / 3600:.0f} h - manual review "
                                 "required", f"renewal-stuck:{payment.id}", timedelta(days=1),
                                 payment_id=payment.id, invoice_id=invoice["id"])
        uow.commit()
    return payment


def _owed(container, invoice: dict, term: bool = False) -> dict:
    """What says whether an invoice is still owed, from our copies (no provider call): our copy of the
    invoice and the standing purchase that pays it; with `term` (decision 190's uncaptured authorization),
    also its subscription and whether its customer is frozen."""
    with container.uow(autocommit=True) as uow:
        owed = {"copy": uow.invoices.get(invoice["id"]), "paid_by": uow.books.paid_by(invoice["id"])}
        if term:
            sub_id = invoice.get("subscription_id")
            owed.update(local=uow.subscriptions.get(sub_id) if sub_id else None,
                        frozen=uow.users.frozen_at(invoice.get("customer_id")))
        return owed


def _invoice_settled(owed: dict, payment_id: str) -> str | None:
    """Why nobody owes the invoice a charge in flight is for any more: another payment pays it (a cheque
    entered at the provider, a payment of ours), or it was voided or deleted. None while it may still be owed."""
    if owed["paid_by"] is not None and owed["paid_by"].transaction_id != payment_id:
        return f"invoice paid by {owed['paid_by'].transaction_id}"
    if owed["copy"] is not None and owed["copy"]["status"] == "voided":
        return "invoice voided"
    if owed["copy"] is not None and owed["copy"]["deleted_at"] is not None:
        return "invoice deleted"
    return None


def _no_longer_owed(owed: dict) -> str | None:
    """Why the term an authorization was taken for is no longer owed, by `_owed`'s copies: its subscription
    no longer live (cancelled, paused), its customer frozen, or its invoice no longer payable (voided,
    written off, paid otherwise). None while it is owed."""
    local, copy = owed["local"], owed["copy"]
    if local is not None and local["status"] not in lifecycle.RENEWING:
        return f"subscription {local['status']}"
    if owed["frozen"] is not None:
        return "customer frozen"
    if copy is not None and copy["status"] is not None and copy["status"] not in lifecycle.INVOICE_PAYABLE:
        return f"invoice {copy['status']}"
    return None


def sweep_in_flight(container, handled: set[str]) -> dict[str, int]:
    """Every renewal charge still in flight whose invoice the tick did not see (the invoice left
    payment_due: paid by the workflow, voided, written off, or recorded by another path before the
    in-flight row was written) is read and ended the same way, so no attempt stays pending for ever. A
    charge whose answer was lost (`error`) is read back from its order first, as the tick would have
    (decision 239): one found is ended the same way, and a read that finds none is not made again."""
    outcomes: dict[str, int] = {}
    with container.uow(autocommit=True) as uow:
        lost = [r for r in uow.dunning.answers_lost() if r["invoice_id"] not in handled]
    for outcome in _each_swept(container, lost, "lost renewal charge", _read_back_lost):
        if outcome != "pending":  # one found in flight is ended with the rest, below
            key = outcome if outcome == "error" else f"read_back_{outcome}"
            outcomes[key] = outcomes.get(key, 0) + 1
    with container.uow(autocommit=True) as uow:
        rows = [r for r in uow.dunning.in_flight() if r["invoice_id"] not in handled]
    for outcome in _each_swept(container, rows, "in-flight renewal charge", _resolve_in_flight):
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


def _each_swept(container, rows: list[dict], what: str, end):
    """The outcome of `end(container, invoice, row, history)` for each dunning row, the invoice as the row
    names it; one that fails is `error` and never stops the others."""
    for row in rows:
        invoice = {"id": row["invoice_id"], "subscription_id": row["subscription_id"], "customer_id": row["user_id"]}
        try:
            with container.uow(autocommit=True) as uow:
                history = uow.dunning.history(row["invoice_id"])
            yield end(container, invoice, row, history)
        except Exception as exc:
            item_failed(log, what, exc, invoice_id=row["invoice_id"])
            yield "error"


def _lost_answer(history: list[dict]) -> dict | None:
    """The newest attempt whose answer was lost, if its order was not read back since and no later row
    names a charge (its notification, or a read-back, told its outcome)."""
    for h in reversed(history):
        if h["payment_id"]:
            return None
        if h["status"] == "error" and h["resolved_at"] is None:
            return h
    return None


def _read_back_lost(container, invoice: dict, row: dict, history: list[dict]) -> str:
    """A lost charge's order read back (`_read_back`), as the attempt `row` made it; once read (whatever it
    found), the invoice's lost answers are marked read. `nothing_charged` when none was made."""
    outcome = _read_back(container, invoice, history, row["attempt_no"], row["lane"], row["processor"], row["amount"])
    if outcome == "read_back_failed":
        return outcome
    with container.uow() as uow:
        uow.dunning.read_back(invoice["id"], container.clock.now())
        uow.commit()
    return "nothing_charged" if outcome is None else outcome


def _resolve_token(container, user_id: str, lane: str, now) -> str | None:
    instruments = container.orchestrator.list_payment_instruments(user_id)
    stored = stored_instrument(instruments)
    if stored is None:
        return None
    if lane != "nsfw" or usable_card(stored, now):
        return stored.token
    cards = [i for i in instruments if usable_card(i, now)]
    preferred = _latest_nsfw_checkout_token(container, user_id) if cards else None
    card = next((c for c in cards if c.token == preferred), cards[-1] if cards else None)
    if card is not None:
        log.info("nsfw_renewal_card_substitution", extra={"user_id": user_id, "from_type": stored.payment_method_type})
        return card.token
    # Only wallets (or unusable cards): send the stored token and let the processor reject it.
    log.warning("nsfw_renewal_no_card_found", extra={"user_id": user_id})
    return stored.token


def _latest_nsfw_checkout_token(container, user_id: str) -> str | None:
    """The card vaulted at the user's latest NSFW checkout (the one checkout tried to make primary);
    without it, the newest usable card is used. A checkout's payment is the orchestrator's FIRST_PAYMENT:
    which path recorded a purchase says nothing (a renewal's settle webhook usually records it first)."""
    with container.uow() as uow:
        payment_ids = uow.purchases.latest_on_lane(user_id, "nsfw", CHECKOUT_LOOKBACK)
    for payment_id in payment_ids:
        try:
            payment = container.orchestrator.get_payment(payment_id)
        except e.BillingError:
            return None
        if payment.payment_method.payment_type == "FIRST_PAYMENT":
            return payment.payment_method.token
    return None


def _failed(container, invoice, status, code, attempt_no, lane, processor, amount, history, payment_id=None,
            resolves: dict | None = None) -> str:
    schedule = container.settings.renewal_retry_hours
    counted_before = sum(1 for h in history if h["status"] in COUNTED)
    if counted_before < len(schedule):
        next_at = container.clock.now() + timedelta(hours=schedule[counted_before])
        if not _record(container, invoice, status, resolves=resolves, decline_code=code, attempt_no=attempt_no,
                       lane=lane, processor=processor, amount=amount, next_attempt_at=next_at, payment_id=payment_id):
            return "in_flight_ended_elsewhere"
        log.info("renewal attempt failed; next attempt scheduled", extra={"invoice_id": invoice["id"], "code": code,
                                                                         "next_attempt_at": next_at.isoformat()})
        return status
    if not _record(container, invoice, status, resolves=resolves, decline_code=code, attempt_no=attempt_no, lane=lane,
                   processor=processor, amount=amount, payment_id=payment_id):
        return "in_flight_ended_elsewhere"
    return _exhaust(container, invoice)


def _exhaust(container, invoice: dict) -> str:
    from billingctl.services.sync import apply_remote_subscription, cancel_at_provider

    sub_id, user_id = invoice.get("subscription_id"), invoice.get("customer_id")
    try:
        remote = cancel_at_provider(container, sub_id)
        apply_remote_subscription(container, remote, "dunning", force=True)
    except e.BillingError as exc:
        log.error("dunning exhausted but the cancel failed; will retry: %s", exc.message,
                  extra={"subscription_id": sub_id})
        return "exhausted_cancel_failed"
    _record(container, invoice, "exhausted", decline_code="retry_schedule_exhausted")
    with container.uow() as uow:
        alerts.enqueue(uow, container.clock, "notify", {
            "user_id": user_id, "message": "Your subscription was cancelled because the renewal payment failed. "
                                           "Add a card at checkout to subscribe again."}, f"dunning-exhausted:{sub_id}")
        uow.commit()
    log.warning("dunning exhausted: subscription cancelled", extra={"subscription_id": sub_id, "user_id": user_id})
    return "exhausted"


def list_attempts(container, user_id: str | None = None, invoice_id: str | None = None, limit: int = 100) -> list:
    with container.uow() as uow:
        return uow.dunning.listing(user_id, invoice_id, limit)


def charges_in_flight(container) -> dict:
    """Renewal charges in flight, by age (health, the live gauge, `renewals list`): how many, the oldest's
    age, and those past their limit (decision 103: AUTHORIZED past its capture limit, any past the
    in-flight limit; the next tick captures, cancels or escalates them)."""
    now = container.clock.now()
    with container.uow(autocommit=True) as uow:
        rows = uow.dunning.in_flight()
    authorized_max = timedelta(minutes=container.settings.renewal_authorized_max_minutes)
    in_flight_max = timedelta(hours=container.settings.renewal_in_flight_max_hours)
    overdue = [r for r in rows if now - r["created_at"] > in_flight_max
               or (r["decline_code"] == "AUTHORIZED" and now - r["created_at"] > authorized_max)]
    oldest = max((now - r["created_at"]).total_seconds() for r in rows) if rows else 0.0
    return {"count": len(rows), "oldest_age_seconds": round(oldest, 1),
            "overdue": [{"invoice_id": r["invoice_id"], "payment_id": r["payment_id"], "status": r["decline_code"],
                         "age_seconds": round((now - r["created_at"]).total_seconds(), 1)} for r in overdue[:20]]}

