"""Violations a person has judged: `billingctl reconcile ack CHECK SUBJECT --reason R` (audited). An
acknowledged violation is still reported (under `acknowledged`, with its reason) and no longer counts, so a
known case stops paging while a new one, or the same case under another check, still does."""

from __future__ import annotations

from billingctl.domain import errors as e
from billingctl.services.reconcile.rules import CHECKS


def current(container) -> dict[tuple[str, str], str]:
    with container.uow() as uow:
        return uow.acks.all()


def listing(container) -> list[dict]:
    with container.uow() as uow:
        return uow.acks.listing()


def acknowledge(container, check: str, subject: str, reason: str, actor: str, remove: bool = False) -> dict:
    if check not in CHECKS:
        raise e.InvalidInput(f"unknown check {check!r}: one of {', '.join(sorted(CHECKS))}")
    if not subject.strip():
        raise e.InvalidInput("the subject is the violation's first id (as `reconcile` shows it)")
    if not (reason or "").strip():
        raise e.InvalidInput("--reason is required: say why this violation is known and accepted")
    now = container.clock.now()
    with container.uow() as uow:
        if remove:
            changed = uow.acks.remove(check, subject)
            if not changed:
                raise e.NotFound(f"no acknowledgement of {check} {subject}")
        else:
            changed = uow.acks.put(check, subject, reason, actor, now)
        uow.audit.record(actor, "reconcile.unack" if remove else "reconcile.ack", f"{check}:{subject}"[:128],
                         reason, {"check": check, "subject": subject}, now)
        uow.commit()
    return {"check": check, "subject": subject, "reason": reason,
            "acknowledged": not remove, "changed": bool(changed)}
