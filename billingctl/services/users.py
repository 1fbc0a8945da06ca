"""Users: what an operator needs to see about one user."""

from __future__ import annotations

from billingctl.domain.errors import NotFound
from billingctl.domain.lifecycle import INVOICE_COLLECTED
from billingctl.domain.plans import require_id


def show_user(container, user_id: str) -> dict:
    with container.uow() as uow:
        user = uow.users.get(user_id)
        if user is None:
            raise NotFound(f"user {user_id} not found")
        ledger = uow.ledger.sum_of_user(user_id)
        purchases = uow.purchases.count_of_user(user_id)
        lock = uow.locks.read(user_id) or {}
    return {"user_id": user_id, "email": user["email"], "credits": user["credits"], "ledger_sum": int(ledger),
            "purchases": purchases, "sfw_processor": lock.get("sfw_processor") or None,
            "nsfw_processor": lock.get("nsfw_processor") or None,
            "nsfw_processor_mid": lock.get("nsfw_processor_mid") or None,
            "frozen": user["frozen_at"] is not None, "frozen_at": user["frozen_at"],
            "frozen_reason": user["frozen_reason"], "recent_payments": recent_payments(container, user_id)}


def recent_payments(container, user_id: str, limit: int = 10) -> list[dict]:
    with container.uow() as uow:
        return uow.purchases.recent_of_user(user_id, limit)


def freeze(container, user_id: str, reason: str, actor: str, void_invoices: bool = False, notify: bool = False,
           dry_run: bool = False) -> dict:
    """Disable further payments; optionally void pending invoices and notify the user. Idempotent:
    a second run changes nothing more."""
    require_id(user_id, "user_id")
    from billingctl.domain.errors import BillingError, InvalidInput
    from billingctl.services import alerts
    from billingctl.services.invoices import apply_copy

    if not reason or not reason.strip():
        raise InvalidInput("a reason is required")
    now = container.clock.now()
    with container.uow() as uow:
        current = uow.users.freeze_state(user_id)
        sub_ids = uow.subscriptions.ids_of_customer(user_id)
    if current is None:
        raise NotFound(f"user {user_id} not found")
    already = current.frozen_at is not None
    pending = []
    if void_invoices:
        for sid in sub_ids:
            pending += [i.id for i in container.provider.list_invoices(status=INVOICE_COLLECTED, subscription_id=sid)]
    plan = {"user_id": user_id, "already_frozen": already, "void_invoices": pending, "notify": notify}
    if dry_run:
        return {**plan, "dry_run": True}
    if not already:
        with container.uow() as uow:
            uow.users.freeze(user_id, now, reason)
            uow.audit.record(actor=actor, action="user.freeze", target=user_id, reason=reason,
                             details={"void_invoices": void_invoices, "notify": notify},
                             now=now)
            uow.commit()
    voided, failed = [], []
    for invoice_id in pending:
        try:
            answer = container.provider.void_invoice(invoice_id, idempotency_key=f"freeze-void:{invoice_id}")
            # Our copy says so at once: a renewal settling on it is refunded without waiting for the
            # workflow's record the provider will refuse (issue 39 item 1).
            apply_copy(container, answer.invoice)
            voided.append(invoice_id)
        except BillingError as exc:
            failed.append({"invoice_id": invoice_id, "error": exc.message})
    if notify:
        with container.uow() as uow:
            alerts.enqueue(uow, container.clock, "notify", {
                "user_id": user_id, "message": "Payments on your account are on hold. Please contact support."},
                f"freeze:{user_id}")
            uow.commit()
    from billingctl.domain.batch import BatchResult

    # A void the provider refused (a payment linked to the invoice, decision 192) is a partial failure:
    # the freeze stands, the invoice still owes, and the CLI exits 5 naming it.
    return BatchResult({"user_id": user_id, "frozen": True, "changed": not already, "voided": voided,
                        "void_failed": failed}, done=len(voided), failed=len(failed), errors=failed)


def unfreeze(container, user_id: str, reason: str, actor: str, dry_run: bool = False) -> dict:
    """Allow payments again (audited; idempotent). Payments held while frozen stay in manual review:
    `billingctl orphans retry PAYMENT_ID` records them."""
    require_id(user_id, "user_id")
    from billingctl.domain.errors import InvalidInput

    if not reason or not reason.strip():
        raise InvalidInput("a reason is required")
    with container.uow() as uow:
        current = uow.users.freeze_state(user_id)
        if current is None:
            raise NotFound(f"user {user_id} not found")
        held = uow.orphans.held_for_review(user_id)
        plan = {"user_id": user_id, "was_frozen": current.frozen_at is not None, "held_payments": held}
        if dry_run:
            return {**plan, "dry_run": True}
        changed = uow.users.unfreeze(user_id)
        if changed:
            uow.audit.record(actor=actor, action="user.unfreeze", target=user_id, reason=reason,
                             details={"held_payments": held}, now=container.clock.now())
        uow.commit()
    return {**plan, "frozen": False, "changed": changed}


def velocity_watch(container) -> dict:
    """Spec section 8 fraud patterns: over 10 charges or over 1000 currency units in the last minute,
    per user and in total; one chat alert per offender per minute window."""
    from datetime import timedelta

    from billingctl.services import alerts

    now = container.clock.now()
    window_start = now - timedelta(minutes=1)
    bucket = now.strftime("%Y%m%d%H%M")
    s = container.settings
    with container.uow() as uow:
        rows = uow.transactions.captured_per_customer_since(window_start)
        offenders = []
        totals = [0, 0]
        for customer_id, count, amount in rows:
            totals[0] += count
            totals[1] += int(amount)
            if count > s.velocity_max_charges_per_minute or amount > s.velocity_max_amount_per_minute:
                offenders.append({"user_id": customer_id, "charges": count, "amount": int(amount)})
        for o in offenders:
            alerts.raise_alert(uow, container.clock, f"Velocity: user {o['user_id']} made {o['charges']} charges "
                               f"({o['amount']} minor units) in the last minute", f"velocity:{o['user_id']}:{bucket}")
            uow.fraud.add(o["user_id"], "velocity_triggered", now, {
                "merchant_context": "full", "amount": o["amount"], "charges": o["charges"], "source": "velocity_watch"})
        total_hot = totals[0] > s.velocity_max_charges_per_minute or totals[1] > s.velocity_max_amount_per_minute
        if total_hot:
            alerts.raise_alert(uow, container.clock, f"Velocity: {totals[0]} charges ({totals[1]} minor units) "
                               "in the last minute across all users", f"velocity:all:{bucket}")
        uow.commit()
    return {"window_start": window_start, "charges": totals[0], "amount": totals[1], "offenders": offenders,
            "total_alert": total_hot}


def store_verification(container, user_id: str, outcome: str) -> dict:
    """The identity-verification outcome, stored on the user."""
    now = container.clock.now()
    with container.uow() as uow:
        uow.users.ensure(user_id, now)
        uow.users.set(user_id, idv_status=outcome[:32], idv_updated_at=now)
        uow.commit()
    return {"outcome": "stored", "user_id": user_id, "idv_status": outcome}


def apply_identity_event(container, event_type: str, data: dict) -> dict:
    """Front-end identity provider events: users created, updated, deleted (soft), sessions."""
    from billingctl.domain.errors import InvalidInput

    user_id = data.get("user_id") if event_type.startswith("session.") else data.get("id")
    if not isinstance(user_id, str) or not user_id:
        raise InvalidInput("the event names no user")
    now = container.clock.now()
    email = data.get("email")
    if email is None and data.get("email_addresses"):
        email = (data["email_addresses"][0] or {}).get("email_address")
    with container.uow() as uow:
        if event_type in ("user.created", "user.updated"):
            uow.users.ensure(user_id, now)
            uow.users.set(user_id, email=email, deleted_at=None)
        elif event_type == "user.deleted":
            uow.users.soft_delete(user_id, now)
            uow.locks.soft_delete(user_id, now)
        elif event_type.startswith("session."):
            ip = data.get("client_ip") or data.get("ip_address")
            uow.users.record_login(user_id, (ip or "")[:64] or None, now)
        else:
            return {"outcome": "ignored"}
        uow.commit()
    return {"outcome": "applied", "user_id": user_id, "type": event_type}
