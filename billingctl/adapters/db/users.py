"""Users: the account row (credits, freeze, identity) and the login attempts seen for it."""

from __future__ import annotations

from sqlalchemy import func, select, update

from billingctl.adapters.db.repository import Repository
from billingctl.adapters.db.sql import insert_ignore
from billingctl.adapters.db.tables import credit_ledger, login_attempt, users


class Users(Repository):
    def get(self, user_id: str):
        return self.execute(select(users).where(users.c.id == user_id)).mappings().first()

    def ensure(self, user_id: str, now) -> bool:
        """Create the user's row with no credits when it does not exist; True when new."""
        return insert_ignore(self.uow, users, {"id": user_id, "created_at": now, "credits": 0}, ["id"])

    def lock(self, user_id: str) -> None:
        """Hold the user's row until the transaction ends (SELECT … FOR UPDATE; SQLite serializes writers)."""
        self.execute(select(users.c.id).where(users.c.id == user_id).with_for_update())

    def frozen_at(self, user_id: str):
        return self.execute(select(users.c.frozen_at).where(users.c.id == user_id)).scalar()

    def freeze_state(self, user_id: str):
        """A row with `frozen_at`, or None when the user does not exist."""
        return self.execute(select(users.c.frozen_at).where(users.c.id == user_id)).first()

    def freeze(self, user_id: str, now, reason: str) -> bool:
        """Freeze once, and mark where the freeze falls in the user's credit ledger: the row is locked first
        (a payment being credited holds it, decision 177), so the next statement sees every credit written
        before the freeze, and none can follow it unseen."""
        self.lock(user_id)
        last = select(func.coalesce(func.max(credit_ledger.c.id), 0)).where(
            credit_ledger.c.user_id == user_id).scalar_subquery()
        return self.execute(update(users).where(users.c.id == user_id, users.c.frozen_at.is_(None)).values(
            frozen_at=now, frozen_reason=reason, frozen_ledger_id=last)).rowcount == 1

    def unfreeze(self, user_id: str) -> bool:
        return self.execute(update(users).where(users.c.id == user_id, users.c.frozen_at.is_not(None)).values(
            frozen_at=None, frozen_reason=None, frozen_ledger_id=None)).rowcount == 1

    def add_credits(self, user_id: str, amount: int) -> None:
        self.execute(update(users).where(users.c.id == user_id).values(credits=users.c.credits + amount))

    def set(self, user_id: str, **values) -> None:
        self.execute(update(users).where(users.c.id == user_id).values(**values))

    def soft_delete(self, user_id: str, now) -> None:
        self.execute(update(users).where(users.c.id == user_id, users.c.deleted_at.is_(None)).values(deleted_at=now))

    def record_login(self, user_id: str, ip: str | None, now) -> None:
        self.execute(login_attempt.insert().values(user_id=user_id, ip_address=ip, created_at=now))
