"""The sandbox's own state: JSON documents in its own SQLite file, so separate CLI runs see one
provider and one orchestrator. Also the controllable clock and the fault table."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from contextlib import contextmanager
from heapq import merge
from itertools import islice
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS objects (kind TEXT, id TEXT, seq INTEGER, data TEXT, PRIMARY KEY (kind, id));
CREATE INDEX IF NOT EXISTS objects_by_seq ON objects (kind, seq);
CREATE INDEX IF NOT EXISTS objects_by_updated ON objects (kind, json_extract(data, '$.updated_at'), seq);
CREATE INDEX IF NOT EXISTS objects_by_occurred ON objects (kind, json_extract(data, '$.occurred_at'), seq);
CREATE INDEX IF NOT EXISTS objects_by_status ON objects (kind, json_extract(data, '$.status'), seq);
CREATE INDEX IF NOT EXISTS objects_by_status_date ON objects (kind, json_extract(data, '$.status'),
    json_extract(data, '$.date'), seq);
CREATE INDEX IF NOT EXISTS objects_by_subscription ON objects (kind, json_extract(data, '$.subscription_id'), seq);
CREATE INDEX IF NOT EXISTS objects_by_item_type ON objects (kind, json_extract(data, '$.item_type'), seq);
CREATE INDEX IF NOT EXISTS objects_by_date ON objects (kind, json_extract(data, '$.date'), seq);
CREATE INDEX IF NOT EXISTS objects_by_reference ON objects (kind, json_extract(data, '$.reference_number'), seq);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS faults (id INTEGER PRIMARY KEY AUTOINCREMENT, system TEXT, method TEXT,
    path TEXT, kind TEXT, remaining INTEGER, retry_after REAL, delay REAL, skip INTEGER DEFAULT 0);
CREATE TABLE IF NOT EXISTS idempotent_answer (key TEXT PRIMARY KEY, params TEXT, status INTEGER, body TEXT,
                                              at REAL);
CREATE TABLE IF NOT EXISTS requests (id INTEGER PRIMARY KEY AUTOINCREMENT, system TEXT, method TEXT, path TEXT);
"""

_locks: dict[str, threading.RLock] = {}


def _position(row) -> tuple:
    """A row's place in a keyset order (the cursor): its key, then its insertion order."""
    return row["k"], row["seq"]


def _sqlite_order(row) -> tuple:
    """`_position` as SQLite orders it: a missing key first."""
    return row["k"] is not None, row["k"] if row["k"] is not None else 0, row["seq"]


class SandboxStore:
    def __init__(self, path: str | Path):
        self.path = str(path)
        self._lock = _locks.setdefault(self.path, threading.RLock())
        self._local = threading.local()
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")  # a simulator: many small writes, several processes
        db.executescript(SCHEMA)
        db.close()

    @contextmanager
    def tx(self):
        """One write transaction; nested calls in the same thread join the outer one."""
        current = getattr(self._local, "db", None)
        if current is not None:
            yield current
            return
        with self._lock:
            db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            db.row_factory = sqlite3.Row
            self._local.db = db
            try:
                db.execute("PRAGMA busy_timeout=30000")
                db.execute("PRAGMA synchronous=NORMAL")
                db.execute("BEGIN IMMEDIATE")
                yield db
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            finally:
                self._local.db = None
                db.close()

    # -- clock: real time plus an offset that tests and `sandbox clock` move -------------------
    def now(self) -> float:
        return time.time() + self.offset()

    def offset(self) -> float:
        """Seconds the sandbox's clock runs ahead of the system's."""
        return float(self.meta("clock_offset") or 0)

    def advance_clock(self, seconds: float) -> float:
        with self.tx():
            self.set_meta("clock_offset", float(self.meta("clock_offset") or 0) + seconds)
        return self.now()

    def meta(self, key: str, default=None):
        with self.tx() as db:
            row = db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return json.loads(row["value"]) if row else default

    def set_meta(self, key: str, value) -> None:
        with self.tx() as db:
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def next_id(self, prefix: str) -> str:
        with self.tx():
            n = int(self.meta(f"seq:{prefix}") or 0) + 1
            self.set_meta(f"seq:{prefix}", n)
        return f"{prefix}_{n:06d}"

    # -- documents -----------------------------------------------------------------------------
    def get(self, kind: str, obj_id: str) -> dict | None:
        with self.tx() as db:
            row = db.execute("SELECT data FROM objects WHERE kind=? AND id=?", (kind, obj_id)).fetchone()
        return json.loads(row["data"]) if row else None

    def put_many(self, kind: str, items: list[dict]) -> None:
        """Bulk insert of new documents (large test fixtures, benchmarks)."""
        with self.tx() as db:
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) FROM objects WHERE kind=?", (kind,)).fetchone()[0]
            db.executemany("INSERT INTO objects (kind, id, seq, data) VALUES (?, ?, ?, ?)",
                           [(kind, item["id"], seq + i + 1, json.dumps(item)) for i, item in enumerate(items)])

    def put(self, kind: str, obj_id: str, data: dict) -> dict:
        with self.tx() as db:
            row = db.execute("SELECT seq FROM objects WHERE kind=? AND id=?", (kind, obj_id)).fetchone()
            if row:
                db.execute("UPDATE objects SET data=? WHERE kind=? AND id=?", (json.dumps(data), kind, obj_id))
            else:
                seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM objects WHERE kind=?", (kind,)).fetchone()[0]
                db.execute("INSERT INTO objects (kind, id, seq, data) VALUES (?, ?, ?, ?)",
                           (kind, obj_id, seq, json.dumps(data)))
        return data

    def page(self, kind: str, filters: list[tuple[str, str, object]], sort: str | None, offset: int,
             limit: int, plan: bool = False) -> tuple[list[dict], bool]:
        """One page of a list endpoint: SQLite filters and sorts the JSON documents through the expression
        indexes above and only the page is decoded. Filters are (field, "=", ">", "is not" or "in", value;
        "is not" also takes a field that is absent, "in" a list); the sort is by one field ("-field":
        descending), then by insertion order in the same direction. Returns the page and whether more rows
        follow (with `plan`, SQLite's query plan instead)."""
        where, args = ["kind = ?"], [kind]
        for field, op, value in filters:
            if op not in ("=", ">", "is not", "in") or not field.replace("_", "").isalnum():
                raise ValueError(f"unsupported filter {field} {op}")
            if op == "in":  # a list of values
                where.append(f"json_extract(data, '$.{field}') IN ({', '.join('?' * len(value))})")
                args.extend(value)
                continue
            where.append(f"json_extract(data, '$.{field}') {op} ?")
            args.append(value)
        order = "seq"
        if sort:
            field, direction = (sort[1:], " DESC") if sort.startswith("-") else (sort, "")
            if not field.replace("_", "").isalnum():
                raise ValueError(f"unsupported sort {sort}")
            order = f"json_extract(data, '$.{field}'){direction}, seq{direction}"
        query = f"SELECT data FROM objects WHERE {' AND '.join(where)} ORDER BY {order} LIMIT ? OFFSET ?"
        with self.tx() as db:
            if plan:
                return [r["detail"] for r in db.execute("EXPLAIN QUERY PLAN " + query,
                                                        (*args, limit + 1, max(0, offset)))], False
            rows = db.execute(query, (*args, limit + 1, max(0, offset))).fetchall()
        return [json.loads(r["data"]) for r in rows[:limit]], len(rows) > limit

    def page_after(self, kind: str, filters: list[tuple[str, str, object]], field: str,
                   after: tuple | None, limit: int) -> tuple[list[dict], tuple | None]:
        """One page in `field`'s order (then insertion order) after the position `after` (a keyset cursor:
        every page costs the same however deep, as an opaque cursor does at the real orchestrator). Filters
        are (field, op, value) with op "=", ">=" or "in" (a list). Returns the page and the position after
        its last row when more rows follow. An "in" filter is read one value at a time, each in `field`'s
        order by its index, and the reads merged: as one statement SQLite walked the whole list in `field`'s
        order to find the few payments in flight among a million (1.5 s)."""
        if not field.replace("_", "").isalnum():
            raise ValueError(f"unsupported field {field}")
        listed = next(((name, value) for name, op, value in filters if op == "in"), None)
        if listed is None:
            rows = self._rows_after(kind, filters, field, after, limit)
        else:
            rest = [f for f in filters if f[0] != listed[0] or f[1] != "in"]
            rows = list(islice(merge(*(self._rows_after(kind, [*rest, (listed[0], "=", value)], field, after, limit)
                                       for value in dict.fromkeys(listed[1])), key=_sqlite_order), limit + 1))
        more = len(rows) > limit
        rows = rows[:limit]
        return [json.loads(r["data"]) for r in rows], (_position(rows[-1]) if more else None)

    def _rows_after(self, kind: str, filters: list[tuple[str, str, object]], field: str, after: tuple | None,
                    limit: int) -> list:
        where, args = ["kind = ?"], [kind]
        for name, op, value in filters:
            if op not in ("=", ">=", "in") or not name.replace("_", "").isalnum():
                raise ValueError(f"unsupported filter {name} {op}")
            if op == "in":
                where.append(f"json_extract(data, '$.{name}') IN ({', '.join('?' * len(value))})")
                args.extend(value)
            else:
                where.append(f"json_extract(data, '$.{name}') {op} ?")
                args.append(value)
        key = f"json_extract(data, '$.{field}')"
        if after is not None:
            where.append(f"({key} > ? OR ({key} = ? AND seq > ?))")
            args.extend((after[0], after[0], after[1]))
        query = f"SELECT {key} AS k, seq, data FROM objects WHERE {' AND '.join(where)} ORDER BY {key}, seq LIMIT ?"
        with self.tx() as db:
            return db.execute(query, (*args, limit + 1)).fetchall()

    def take(self, kind: str, obj_id: str) -> dict | None:
        """Remove a document and return it; None when another process took it first."""
        with self.tx() as db:
            row = db.execute("DELETE FROM objects WHERE kind=? AND id=? RETURNING data", (kind, obj_id)).fetchone()
        return json.loads(row["data"]) if row else None

    def all(self, kind: str) -> list[dict]:
        with self.tx() as db:
            rows = db.execute("SELECT data FROM objects WHERE kind=? ORDER BY seq", (kind,)).fetchall()
        return [json.loads(r["data"]) for r in rows]

    # -- idempotency keys: a repeated logical POST gets the first answer ---------------------
    def idempotent_result(self, key: str) -> dict | None:
        """The first answer to an idempotency key: its parameters' digest, status, body and time."""
        with self.tx() as db:
            row = db.execute("SELECT params, status, body, at FROM idempotent_answer WHERE key=?", (key,)).fetchone()
        return {"params": row["params"], "status": row["status"], "body": json.loads(row["body"]),
                "at": row["at"] or 0.0} if row else None

    def save_idempotent_result(self, key: str, status: int, body: dict, params: str | None = None,
                               at: float | None = None) -> None:
        """Kept until the key's window has passed (then a new request with it is a new request)."""
        with self.tx() as db:
            db.execute("INSERT OR REPLACE INTO idempotent_answer (key, params, status, body, at) "
                       "VALUES (?, ?, ?, ?, ?)",
                       (key, params, status, json.dumps(body), at if at is not None else self.now()))

    # -- request log: what the billing service asked of each system (tests, the call budget) -------
    def log_request(self, system: str, method: str, path: str) -> None:
        with self.tx() as db:
            db.execute("INSERT INTO requests (system, method, path) VALUES (?, ?, ?)", (system, method, path))

    def count_requests(self, system: str, method: str | None = None, path_contains: str = "") -> int:
        with self.tx() as db:
            rows = db.execute("SELECT method, path FROM requests WHERE system=?", (system,)).fetchall()
        return sum(1 for r in rows if (method is None or r["method"] == method) and path_contains in r["path"])

    # -- faults ----------------------------------------------------------------------------------
    def add_fault(self, system: str, kind: str, *, method: str = "*", path: str = "", count: int = 1,
                  retry_after: float | None = None, delay: float = 0.0, skip: int = 0) -> int:
        """Fail the next `count` matching requests (-1: all of them), after letting `skip` through."""
        with self.tx() as db:
            cur = db.execute("INSERT INTO faults (system, method, path, kind, remaining, retry_after, delay, skip) "
                             "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                             (system, method.upper(), path, kind, count, retry_after, delay, skip))
            return cur.lastrowid

    def clear_faults(self) -> None:
        with self.tx() as db:
            db.execute("DELETE FROM faults")

    def take_fault(self, system: str, method: str, path: str, kinds: tuple[str, ...]) -> dict | None:
        """The first matching fault, consumed once (remaining < 0 means forever)."""
        with self.tx() as db:
            rows = db.execute("SELECT * FROM faults WHERE system=? AND remaining != 0 ORDER BY id",
                              (system,)).fetchall()
            for row in rows:
                if row["kind"] not in kinds:
                    continue
                if row["method"] not in ("*", method.upper()) or row["path"] not in path:
                    continue
                if row["skip"]:
                    db.execute("UPDATE faults SET skip = skip - 1 WHERE id=?", (row["id"],))
                    return None
                if row["remaining"] > 0:
                    db.execute("UPDATE faults SET remaining = remaining - 1 WHERE id=?", (row["id"],))
                return dict(row)
        return None
