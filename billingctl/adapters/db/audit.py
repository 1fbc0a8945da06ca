"""The audit log: one row per operator action."""

from __future__ import annotations

from billingctl.adapters.db.repository import Repository
from billingctl.adapters.db.tables import audit_log


class AuditLog(Repository):
    def record(self, actor: str, action: str, target: str, reason: str | None, details, now) -> None:
        self.execute(audit_log.insert().values(actor=actor, action=action, target=target, reason=reason,
                                               details=details, created_at=now))
