"""Reconcile violations a person has judged (`reconcile_ack`)."""

from __future__ import annotations

from sqlalchemy import delete, select, update

from billingctl.adapters.db.repository import Repository
from billingctl.adapters.db.sql import insert_ignore
from billingctl.adapters.db.tables import reconcile_ack


class ReconcileAcks(Repository):
    def all(self) -> dict[tuple[str, str], str]:
        """(check, subject) -> reason."""
        return {(r.check_name, r.subject): r.reason for r in self.execute(select(reconcile_ack))}

    def listing(self) -> list[dict]:
        return [dict(r) for r in self.execute(select(reconcile_ack).order_by(reconcile_ack.c.created_at)).mappings()]

    def put(self, check: str, subject: str, reason: str, actor: str, now) -> bool:
        """Acknowledge (or re-word the reason of) one violation; True when it is new."""
        values = {"check_name": check, "subject": subject, "reason": reason, "actor": actor, "created_at": now}
        if insert_ignore(self.uow, reconcile_ack, values, ["check_name", "subject"]):
            return True
        self.execute(update(reconcile_ack).where(reconcile_ack.c.check_name == check,
                                                 reconcile_ack.c.subject == subject)
                     .values(reason=reason, actor=actor, created_at=now))
        return False

    def remove(self, check: str, subject: str) -> bool:
        return self.execute(delete(reconcile_ack).where(reconcile_ack.c.check_name == check,
                                                        reconcile_ack.c.subject == subject)).rowcount == 1
