"""Job leases: one row per job, taken by a conditional update (free, or expired)."""

from __future__ import annotations

from sqlalchemy import or_, select, update

from billingctl.adapters.db.repository import Repository
from billingctl.adapters.db.sql import insert_ignore
from billingctl.adapters.db.tables import job_lease


class Leases(Repository):
    def create(self, name: str, holder: str, now, expires) -> bool:
        """The job's first lease ever; False when the row exists."""
        return insert_ignore(self.uow, job_lease, {"name": name, "holder": holder, "acquired_at": now,
                                                   "expires_at": expires}, ["name"])

    def holder(self, name: str):
        """(holder, expires_at) of the job's row, or None."""
        return self.execute(select(job_lease.c.holder, job_lease.c.expires_at).where(job_lease.c.name == name)).first()

    def take(self, name: str, holder: str, now, expires, dead_holder: str | None = None) -> bool:
        """Take the lease when free or expired (or held by `dead_holder`, a process known to be gone)."""
        free = or_(job_lease.c.holder.is_(None), job_lease.c.expires_at.is_(None), job_lease.c.expires_at < now)
        if dead_holder:
            free = or_(free, job_lease.c.holder == dead_holder)
        return self.execute(update(job_lease).where(job_lease.c.name == name, free)
                            .values(holder=holder, acquired_at=now, expires_at=expires)).rowcount == 1

    def release(self, name: str, holder: str, now, error: str | None) -> None:
        values = {"holder": None, "expires_at": None}
        values.update({"last_success_at": now, "last_error": None} if error is None else
                      {"last_failure_at": now, "last_error": error[:500]})
        self.execute(update(job_lease).where(job_lease.c.name == name, job_lease.c.holder == holder).values(**values))

    def all(self) -> dict[str, dict]:
        return {r["name"]: dict(r) for r in self.execute(select(job_lease)).mappings()}

    def last_successes(self) -> dict:
        return dict(self.execute(select(job_lease.c.name, job_lease.c.last_success_at)).all())
