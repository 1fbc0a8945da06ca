"""In-memory fakes of the repositories (cosmicpython's pattern): a unit test of a rule (the quota, the
processor lock's first-write-wins) runs against these instead of a database. Each fake keeps the contract
of its real repository in adapters/db/ — the integration tests run the real ones."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace


class FakeUsers:
    def __init__(self):
        self.rows: dict[str, dict] = {}

    def ensure(self, user_id: str, now) -> bool:
        if user_id in self.rows:
            return False
        self.rows[user_id] = {"id": user_id, "created_at": now, "credits": 0, "frozen_at": None}
        return True

    def lock(self, user_id: str) -> None:
        pass  # one thread: nothing to serialize

    def frozen_at(self, user_id: str):
        return (self.rows.get(user_id) or {}).get("frozen_at")

    def add_credits(self, user_id: str, amount: int) -> None:
        self.rows[user_id]["credits"] += amount


class FakeFraudEvents:
    def __init__(self):
        self.rows: list[dict] = []

    def add(self, user_id, event_type, now, metadata, dedupe_key=None) -> bool:
        if dedupe_key is not None and self.exists(dedupe_key):
            return False
        self.rows.append({"user_id": user_id, "event_type": event_type, "created_at": now, "metadata": metadata,
                          "dedupe_key": dedupe_key})
        return True

    def since(self, user_id, event_type, after) -> list:
        return [(r["created_at"], r["metadata"]) for r in self.rows
                if r["user_id"] == user_id and r["event_type"] == event_type and r["created_at"] > after]

    def exists(self, key) -> bool:
        return any(r["dedupe_key"] == key for r in self.rows)

    def rename(self, key, new_key) -> bool:
        for row in self.rows:
            if row["dedupe_key"] == key:
                row["dedupe_key"] = new_key
                return True
        return False

    def remove(self, key) -> None:
        self.rows = [r for r in self.rows if r["dedupe_key"] != key]


def _unlocked(value) -> bool:
    return value in (None, "")


class FakeProcessorLocks:
    def __init__(self):
        self.rows: dict[str, dict] = {}

    def read(self, user_id):
        row = self.rows.get(user_id)
        return dict(row) if row else None

    def ensure(self, user_id, now) -> None:
        self.rows.setdefault(user_id, {"user_id": user_id, "created_at": now, "sfw_processor": None,
                                       "nsfw_processor": None, "nsfw_processor_mid": None})

    def lock_first(self, user_id, column, values, now) -> bool:
        self.ensure(user_id, now)
        row = self.rows[user_id]
        if not _unlocked(row[column]):
            return False
        row.update(values)
        return True

    def relock(self, user_id, column, values) -> bool:
        row = self.rows.get(user_id)
        if row is None or not _unlocked(row[column]):
            return False
        row.update(values)
        return True


class FakeUnitOfWork:
    """What the rules under test touch of a unit of work: the repositories and a savepoint."""

    def __init__(self):
        self.users = FakeUsers()
        self.fraud = FakeFraudEvents()
        self.locks = FakeProcessorLocks()
        self.conn = SimpleNamespace(begin_nested=nullcontext)
        self.committed = 0

    def commit(self) -> None:
        self.committed += 1
