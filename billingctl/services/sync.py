"""Keeping the local copy in step with the provider (the source of truth): sync one, sync-all,
event-driven updates, and cancellation that reads the provider back when the call errors."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from billingctl.adapters.payloads import Subscription
from billingctl.domain import errors as e
from billingctl.domain.batch import BatchResult
from billingctl.domain.lifecycle import SUBSCRIPTION
from billingctl.domain.plans import require_id
from billingctl.services.cursors import write_value
from billingctl.services.lifecycles import provider_status, provider_step_written

log = logging.getLogger("billingctl.sync")

LIVE = ("active", "future", "in_trial", "non_renewing", "paused")


def _ts(value):
    if value in (None, ""):
        return None
    return datetime.fromtimestamp(int(value), UTC)


def remote_fields(remote: Subscription) -> dict:
    if not remote.customer_id:
        raise e.InvalidInput(f"the provider's copy of subscription {remote.id} names no customer")
    return {"status": remote.status, "start_date": _ts(remote.start_date),
            "current_term_end": _ts(remote.current_term_end), "customer_id": remote.customer_id,
            "coupon_ids": remote.coupon_ids, "item_price_id": remote.item_price_id}


def _older(local, version: int | None, updated_at) -> bool:
    """The provider orders a resource's changes by resource_version (milliseconds); updated_at (whole
    seconds) decides only where a version is missing on either side."""
    if version is not None and local["provider_resource_version"] is not None:
        return local["provider_resource_version"] > version
    return bool(updated_at and local["provider_updated_at"] and local["provider_updated_at"] > updated_at)


def diff(local: dict | None, fields: dict) -> dict:
    if local is None:
        return {k: {"local": None, "provider": v} for k, v in fields.items()}
    return {k: {"local": local.get(k), "provider": v} for k, v in fields.items() if local.get(k) != v}


def apply_remote_subscription(container, remote: Subscription, source: str = "sync", force: bool = False) -> str:
    """Overwrite the local copy from the provider's, unless the local copy is already newer."""
    with container.uow() as uow:
        outcome = write_remote_subscription(container, uow, remote, source, force)
        uow.commit()
    return outcome


def write_remote_subscription(container, uow, remote: Subscription, source: str, force: bool = False,
                              **extra) -> str:
    """Apply one provider copy of a subscription in the caller's transaction, as one step of
    domain.lifecycle.SUBSCRIPTION (decision 117): "updated", "unchanged", "older_ignored" (the copy held is
    newer, by resource_version) or "refused" (a status the provider does not document: reported, nothing
    written). `force` (an operator's sync, a copy just read) applies it whatever version is held; `extra`
    columns are written with the copy (one statement)."""
    from billingctl.services.subscriptions import invalidate_customer

    remote = Subscription.read(remote)  # typed already, or a copy a caller holds as the provider sent it
    fields = remote_fields(remote)
    updated_at, version = _ts(remote.updated_at), remote.resource_version
    now = container.clock.now()
    local = uow.subscriptions.get(remote.id)
    if local is not None and not force and (local["deleted_at"] is not None or _older(local, version, updated_at)):
        return "older_ignored"  # a subscription the provider deleted has no newer copy (decision 223)
    current = local["status"] if local is not None else None
    step = provider_status(container, uow, SUBSCRIPTION, remote.id, current, fields["status"])
    if step is None:
        return "refused"
    changes = diff(dict(local) if local else None, fields)
    if local is None:
        uow.subscriptions.add({"id": remote.id, "created_at": _ts(remote.created_at) or now, **fields})
    values = {**fields, "provider_updated_at": updated_at, "synced_at": now, **extra}
    if force:  # a copy just read: the provider holds it
        values["deleted_at"] = None
    if fields["status"] == "active":
        values.update(activation_pending_since=None, activation_error=None)
    if not uow.subscriptions.set_if_not_older(remote.id, None if force else version, **values):
        return "older_ignored"  # a newer copy was applied meanwhile
    if force and version is not None:
        uow.subscriptions.set(remote.id, provider_resource_version=version)
    provider_step_written(container, uow, SUBSCRIPTION, remote.id, current, fields["status"], step)
    if changes:
        invalidate_customer(container, fields["customer_id"])
        log.info("local subscription updated from the provider", extra={"subscription_id": remote.id,
                                                                        "source": source, "fields": sorted(changes)})
    return "updated" if changes else "unchanged"


def move_subscription(container, uow, subscription_id: str, target: str, **values) -> bool:
    """Our own write of a subscription's status where the provider sent no copy (it answered that the
    subscription no longer exists: cancelled): one step of SUBSCRIPTION from the status read in this
    transaction, by a conditional update; False when there is no row or a racing writer moved it first."""
    current = uow.subscriptions.status(subscription_id)
    if current is None:
        return False
    step = provider_status(container, uow, SUBSCRIPTION, subscription_id, current, target)
    if step is None or not uow.subscriptions.move(subscription_id, current, status=target, **values):
        return False
    provider_step_written(container, uow, SUBSCRIPTION, subscription_id, current, target, step)
    return True


def subscription_gone(container, subscription_id: str, version: int | None = None, source: str = "sync-all") -> bool:
    """The provider no longer holds the subscription (support deleted it there, decision 215: its
    `subscription_deleted` event, or a re-read answered not found): our copy is cancelled, so nothing
    renews it and the customer may buy its plan again. The provider deleted its invoices and transactions
    with it, so a person is told once when a payment of ours was recorded on them: the provider's books no
    longer hold it, and the customer keeps the credits it paid for unless that person refunds it. Our copies
    of those invoices are noted deleted: a payment whose record on one was still to do reached the provider
    after the deletion, nobody owes it, and its follow-up refunds it as for a deleted invoice (decision 217).
    Our copy notes when it learnt the deletion: a copy read after that (an event polled late) is older news
    (decision 223)."""
    from billingctl.services import alerts
    from billingctl.services.subscriptions import invalidate_customer

    now = container.clock.now()
    with container.uow() as uow:
        kept = {"provider_resource_version": version} if version is not None else {}
        moved = move_subscription(container, uow, subscription_id, "cancelled", synced_at=now, **kept)
        local = uow.subscriptions.get(subscription_id)
        if local is not None and local["deleted_at"] is None:  # its copies read from now on are older news
            uow.subscriptions.set(subscription_id, deleted_at=now)
        uow.invoices.delete_of_subscription(subscription_id, now)  # a record still to do is refunded (decision 217)
        paid = uow.purchases.on_provider_books(subscription_id)
        if local is not None and paid is not None:
            alerts.raise_alert(
                uow, container.clock,
                f"Subscription {subscription_id} of {local['customer_id']} was deleted at the provider with its "
                f"invoices and transactions: payment {paid} recorded on them is no longer in the provider's books; "
                f"the customer keeps its credits. Refund it (billingctl payments refund {paid} --reason R --yes) if "
                "the deletion ended the sale", f"subscription-deleted:{subscription_id}",
                subscription_id=subscription_id, user_id=local["customer_id"], payment_id=paid)
        uow.commit()
    if local is not None:
        invalidate_customer(container, local["customer_id"])
        log.warning("subscription no longer exists at the provider; marked cancelled",
                    extra={"subscription_id": subscription_id, "source": source, "moved": moved})
    return moved


def sync_subscription(container, subscription_id: str, dry_run: bool = False) -> dict:
    require_id(subscription_id, "subscription_id")
    try:
        remote = container.provider.get_subscription(subscription_id)
    except e.ExternalNotFound as exc:
        return _sync_gone(container, subscription_id, dry_run, exc)
    except e.ExternalError:
        container.metrics.sync_errors.inc()
        raise
    with container.uow() as uow:
        local = uow.subscriptions.get(subscription_id)
    changes = diff(dict(local) if local else None, remote_fields(remote))
    if not dry_run:
        apply_remote_subscription(container, remote, "sync", force=True)
    return {"subscription_id": subscription_id, "dry_run": dry_run, "changed": bool(changes),
            "differences": changes}


def _sync_gone(container, subscription_id: str, dry_run: bool, not_found: Exception) -> dict:
    """A re-read the provider answers not found: a copy we hold is of a subscription deleted there, cancelled
    here as at its event (decision 215); one we never held is the caller's mistake (the error stands)."""
    with container.uow() as uow:
        held = uow.subscriptions.status(subscription_id)
    if held is None:
        raise not_found
    if not dry_run:
        subscription_gone(container, subscription_id, source="sync")
    changes = {} if held == "cancelled" else {"status": {"local": held, "provider": "cancelled"}}
    return {"subscription_id": subscription_id, "dry_run": dry_run, "changed": bool(changes),
            "differences": changes, "deleted_at_provider": True}


def _resume_key(since: datetime | None) -> str:
    return f"sync_all:{int(since.timestamp()) if since else 0}"


def sync_all(container, since: datetime | None, progress=None) -> dict:
    """Every subscription updated since `since`, page by page, resumable after an interruption; then
    local live subscriptions the provider did not return are re-read one by one."""
    key = _resume_key(since)
    with container.uow() as uow:
        resume = uow.cursors.get(key)
    start = _ts(resume) if resume else since
    seen, updated, failed = set(), 0, []
    for remote in container.provider.list_subscriptions(updated_after=start):
        seen.add(remote.id)
        try:
            if apply_remote_subscription(container, remote, "sync-all", force=True) == "updated":
                updated += 1
        except Exception as exc:  # isolate one bad row
            container.metrics.sync_errors.inc()
            failed.append({"id": remote.id, "error": f"{type(exc).__name__}: {exc}"})
            continue
        _save_resume(container, key, remote.updated_at)
        if progress:
            progress(1)
    # A cancellation or deletion at the provider the listing did not show.
    with container.uow() as uow:
        missing = [sid for sid in uow.subscriptions.ids_in(LIVE, since) if sid not in seen]
    for sid in missing:  # one the provider no longer holds is cancelled by the re-read (decision 215)
        try:
            if sync_subscription(container, sid)["changed"]:
                updated += 1
        except e.BillingError as exc:
            failed.append({"id": sid, "error": exc.message})
    with container.uow() as uow:
        uow.cursors.forget(key)
        uow.commit()
    return BatchResult({"since": since, "listed": len(seen), "reread": len(missing), "updated": updated,
                        "failed": failed}, done=updated, failed=len(failed), errors=failed)


def _save_resume(container, key: str, updated_at) -> None:
    if updated_at is None:
        return
    write_value(container, key, str(int(updated_at) - 1))


def cancel_at_provider(container, subscription_id: str) -> Subscription:
    """A cancel can error although it took effect: the provider's state decides the outcome."""
    try:
        return container.provider.cancel_subscription(subscription_id).subscription
    except (e.OutcomeUnknown, e.ExternalInvalidRequest) as exc:
        remote = container.provider.get_subscription(subscription_id)
        if remote.status != "cancelled":
            raise
        log.warning("cancel call errored but the cancellation took effect: %s", exc.message,
                    extra={"subscription_id": subscription_id})
        return remote


def cancel_subscription(container, subscription_id: str, reason: str, actor: str, dry_run: bool = False) -> dict:
    require_id(subscription_id, "subscription_id")
    if not reason or not reason.strip():
        raise e.InvalidInput("a reason is required")
    if dry_run:
        remote = container.provider.get_subscription(subscription_id)
        return {"subscription_id": subscription_id, "dry_run": True, "current_status": remote.status}
    remote = cancel_at_provider(container, subscription_id)
    apply_remote_subscription(container, remote, "cancel", force=True)
    with container.uow() as uow:
        uow.audit.record(actor, "subscription.cancel", subscription_id, reason, {"status": remote.status},
                         container.clock.now())
        uow.commit()
    return {"subscription_id": subscription_id, "status": remote.status}


def sync_all_plan(container, since) -> dict:
    """--dry-run: what sync-all would change, without writing."""
    changes = []
    with container.uow() as uow:
        local = uow.subscriptions.all()
    for remote in container.provider.list_subscriptions(updated_after=since):
        difference = diff(local.get(remote.id), remote_fields(remote))
        if difference:
            changes.append({"subscription_id": remote.id, "differences": sorted(difference)})
    return {"dry_run": True, "since": since, "would_update": changes}
