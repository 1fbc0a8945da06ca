"""Disputes at the orchestrator, followed to their decision (issue 34, decision 102). Primer sends
DISPUTE.OPENED (every processor) and DISPUTE.STATUS (a type and a status, one notification per change);
each moves the dispute along domain.lifecycle.DISPUTE:

- open (a retrieval, a chargeback or a pre-arbitration not yet decided): one fraud signal, one chat alert,
  and no merchant-initiated charge for the customer while it is open (renewals answer `skipped_disputed`);
- won or closed: the sale stands; renewals resume; one chat alert;
- lost: the customer has the money back: the payment's credits are reversed through the ledger (once,
  net of refunds already reversed), the subscription it paid is cancelled at the provider (no further
  charge of a card that charged back), one chat alert.

Stale news changes nothing (a decided dispute opens again only with a later stage: decision 214); a
contradiction (anything after lost but lost) and an undocumented type or status are reported: logged,
counted, alerted."""

from __future__ import annotations

import logging

from billingctl.adapters.payloads import Dispute
from billingctl.domain import errors as e
from billingctl.domain import lifecycle
from billingctl.services import alerts
from billingctl.services.lifecycles import report_illegal, unknown_notification

log = logging.getLogger("billingctl.fraud")
OPENED = ("DISPUTE.OPENED", "DISPUTE.OPEN")  # the unified "new dispute" notification (and its older name)


def dispute_event_id(event_type: str, body: Dispute) -> str:
    """The inbox key: one event per (dispute, type, status) — a new status of one dispute is a new event."""
    body = Dispute.read(body)
    return f"{event_type}:{body.dispute_id}:{body.type or ''}:{body.status or ''}"


def record_dispute(container, event_type: str, body: Dispute) -> dict:
    body = Dispute.read(body)  # the notification as it was stored: typed once, here
    if event_type in OPENED:  # names no stage: it opens a dispute we do not hold, and moves none we do
        kind, status = None, "OPEN"
    elif event_type == "DISPUTE.STATUS":
        kind, status = body.type or "DISPUTE", body.status
    else:
        return unknown_notification(container, event_type, body.dispute_id)
    payment_id, dispute_id = body.payment_id, body.dispute_id
    target = lifecycle.dispute_state(kind, status)
    now = container.clock.now()
    if target is None:
        with container.uow() as uow:
            report_illegal(container, uow, lifecycle.IllegalTransition("dispute", dispute_id, None,
                                                                        f"{kind}/{status}"[:64]))
            uow.commit()
        return {"outcome": "unknown_status", "dispute_id": dispute_id}
    user_id, amount, subscription_id = _owner(container, payment_id)
    words = {"kind": kind and str(kind)[:16], "status": str(status)[:16]}
    with container.uow() as uow:
        row = uow.disputes.get(dispute_id)
        source, held_kind = (row["state"], row["kind"]) if row is not None else (None, None)
        step = lifecycle.dispute_step(source, held_kind, target, kind)
        if step == lifecycle.Step.ILLEGAL:
            report_illegal(container, uow, lifecycle.IllegalTransition("dispute", dispute_id, source, target))
            uow.commit()
            return {"outcome": "illegal", "dispute_id": dispute_id, "state": source}
        if step != lifecycle.Step.APPLY:
            if step == lifecycle.Step.SAME:  # its latest words; stale news leaves the stage it held
                uow.disputes.note(dispute_id, now, **words)
            uow.commit()
            if target == "lost" and step == lifecycle.Step.SAME:
                _cancel_subscription(container, subscription_id, dispute_id)  # finish an interrupted loss
            return {"outcome": step.value, "dispute_id": dispute_id, "state": source}
        decided = now if target != "open" else None
        if row is None:
            processor = (body.processor or body.processor_id or "")[:64] or None
            moved = uow.disputes.open({
                "dispute_id": dispute_id, "payment_id": payment_id, "user_id": user_id, "state": target,
                "order_id": body.order_id or None,
                "amount": body.amount if "amount" in body.model_fields_set else amount,
                "currency_code": body.currency or None, "processor": processor, "created_at": now,
                "updated_at": now, "decided_at": decided, **words})
        else:
            moved = uow.disputes.move(dispute_id, target, lifecycle.DISPUTE.sources(target), held_kind, now,
                                      decided_at=decided, **words)
        if not moved:  # another notification moved it first: judge this one again against what it wrote
            uow.rollback()
        else:
            _enter(container, uow, target, source, dispute_id, payment_id, user_id or "unknown", amount, body)
            uow.commit()
    if not moved:
        return record_dispute(container, event_type, body)
    if target == "lost":
        _cancel_subscription(container, subscription_id, dispute_id)
    log.warning("dispute %s", target, extra={"dispute_id": dispute_id, "payment_id": payment_id, "user_id": user_id,
                                             "from_state": source, "type": kind, "status": status})
    return {"outcome": "recorded", "dispute_id": dispute_id, "state": target, "user_id": user_id or "unknown"}


def _owner(container, payment_id: str) -> tuple[str | None, int | None, str | None]:
    """(user, amount, subscription) from our purchase of the payment, else from the orchestrator's payment."""
    with container.uow() as uow:
        bought = uow.purchases.by_payment_id(payment_id)
    if bought is not None:
        return bought["user_id"], bought["amount"], bought["subscription_id"]
    try:
        payment = container.orchestrator.get_payment(payment_id)
    except e.BillingError as exc:  # the dispute is still recorded and alerted; the user is looked up by hand
        log.warning("disputed payment could not be read: %s", exc.message, extra={"payment_id": payment_id})
        return None, None, None
    return payment.user_id, payment.amount, payment.metadata.subscription_id


def _enter(container, uow, state: str, source: str | None, dispute_id: str, payment_id: str, user_id: str,
           amount, body: Dispute) -> None:
    clock, processor = container.clock, body.processor_id or body.processor or ""
    if state == "open":
        uow.fraud.add(user_id, "dispute_opened", clock.now(), {
            "merchant_context": "full", "amount": amount, "payment_id": payment_id, "dispute_id": dispute_id,
            "processor": processor or None}, dedupe_key=f"dispute:{dispute_id}:{body.type or 'DISPUTE'}")
        text = (f"Dispute opened on payment {payment_id} by user {user_id}" if source is None else
                f"Dispute {dispute_id} reopened ({body.type}) on payment {payment_id} by user {user_id}")
        alerts.raise_alert(uow, clock, text, f"dispute:{dispute_id}" if source is None else
                           f"dispute:{dispute_id}:{body.type}:open", amount=amount, processor=processor)
        return
    if state == "lost":
        reversed_credits = _reverse_credits(uow, clock.now(), dispute_id, payment_id)
        alerts.raise_alert(uow, clock, f"Dispute {dispute_id} lost on payment {payment_id} by user {user_id}: "
                                       f"{reversed_credits} credits reversed, subscription cancelled",
                           f"dispute:{dispute_id}:lost", amount=amount, processor=processor)
        return
    alerts.raise_alert(uow, clock, f"Dispute {dispute_id} {state} on payment {payment_id} by user {user_id}: "
                                   "renewals resume", f"dispute:{dispute_id}:{state}:{body.type}",
                       amount=amount, processor=processor)


def _reverse_credits(uow, now, dispute_id: str, payment_id: str) -> int:
    """The payment's credits not yet reversed (by refunds), reversed once through the ledger."""
    bought = uow.purchases.by_payment_id(payment_id)
    if bought is None:
        return 0
    uow.users.lock(bought["user_id"])
    delta = int(bought["credits"]) - uow.ledger.reversed_for(payment_id)
    if delta <= 0:
        return 0
    uow.ledger.apply(bought["user_id"], -delta, f"dispute:{dispute_id}", "dispute_lost", payment_id, now)
    return delta


def _cancel_subscription(container, subscription_id: str | None, dispute_id: str) -> None:
    """A lost chargeback ends the subscription the payment paid (raises while the provider cannot be
    reached: the notification stays in the inbox and is re-driven; every step is idempotent)."""
    if not subscription_id:
        return
    from billingctl.services.sync import apply_remote_subscription, cancel_at_provider

    with container.uow() as uow:
        if uow.subscriptions.status(subscription_id) == "cancelled":
            return
    remote = cancel_at_provider(container, subscription_id)
    apply_remote_subscription(container, remote, "dispute_lost", force=True)
    log.warning("subscription cancelled: dispute lost", extra={"subscription_id": subscription_id,
                                                               "dispute_id": dispute_id})


def disputed(uow, user_id: str) -> bool:
    """True while one of the user's disputes is undecided: no merchant-initiated charge meanwhile."""
    return bool(uow.disputes.open_for_user(user_id))


def deciding_dispute(container, payment_id: str) -> dict | None:
    """The dispute that decides what may be done with a payment's money (a lost one first, then an
    undecided one); None when neither."""
    with container.uow(autocommit=True) as uow:
        return uow.disputes.deciding(payment_id)


def money_returned(container, payment_id: str) -> bool:
    """A charge whose money went back no longer stands: refunded in full (or the rest asked for and still
    pending at the processor; a refusal is alerted, decision 174), or charged back by a lost dispute
    (decision 176)."""
    found = deciding_dispute(container, payment_id)
    if found is not None and found["state"] == "lost":
        return True
    return container.orchestrator.get_payment(payment_id).refunding_in_full


def refuse_if_disputed(container, payment_id: str, what: str) -> None:
    """A payment charged back is not refunded (the customer would get the money twice) nor given a
    subscription (for money that is gone); an undecided dispute is answered first (decision 172)."""
    found = deciding_dispute(container, payment_id)
    if found is None:
        return
    if found["state"] == "lost":
        raise e.Refused(f"payment {payment_id} was charged back (dispute {found['dispute_id']} lost): the customer "
                        f"has the money back, so {what} is refused; mark it handled (billingctl orphans resolve "
                        f"{payment_id} --mark-handled --reason R --yes) if it waits for review")
    raise e.Refused(f"payment {payment_id} is disputed (dispute {found['dispute_id']} open): {what} waits until "
                    "the dispute is decided (a refund now could return the money twice)")
