"""The per-user, per-lane processor lock (spec section 2, "Processor lock" rules 1-11).

After a settle the processor that actually settled is locked on its lane (on NSFW with the merchant
account), first write wins, permanently. Every gated settle records exactly one outcome in
billing_processor_lock_outcome_total{lane, psp, outcome}."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from billingctl.domain.errors import BillingError, InvalidInput, NotFound, Refused
from billingctl.domain.plans import LANES, is_unlocked, lane_of_processor, processor_column

log = logging.getLogger("billingctl.processor_lock")

@dataclass
class LockResult:
    lane: str
    outcome: str
    psp: str
    locked_processor: str | None


def read_lock(uow, user_id: str) -> dict | None:
    """The user's live lock row. Rule 4: soft-deleted rows are excluded from every reader and writer."""
    return uow.locks.read(user_id)


def _count(metrics, lane: str, psp: str, outcome: str) -> None:
    metrics.processor_lock_outcome.labels(lane=lane, psp=psp, outcome=outcome).inc()


def lock_after_settle(uow, container, *, user_id: str, payment_lane: str, processor: str | None,
                      merchant_id: str | None) -> LockResult:
    """Gate one settle. Runs inside the recording transaction, in a savepoint: a failure here is
    counted as assign_error and never undoes the recording."""
    metrics, table = container.metrics, container.settings.processor_lanes
    if not processor:
        _count(metrics, payment_lane, "none", "assign_error")
        log.error("settle without a processor name; nothing to lock", extra={"user_id": user_id})
        return LockResult(payment_lane, "assign_error", "none", None)
    lane = lane_of_processor(processor, table)
    if lane is None:
        # Rule 10: an unknown name locks nothing; locked users are unaffected.
        _count(metrics, payment_lane, "other", "unknown_processor")
        log.error("settled processor is unknown to every lane",
                  extra={"user_id": user_id, "processor": processor, "lane": payment_lane})
        return LockResult(payment_lane, "unknown_processor", "other", None)
    try:
        # The whole gate in one savepoint: on PostgreSQL a failed statement (the lock table unreadable)
        # aborts the transaction it runs in, so a savepoint around the write alone let a failed read undo
        # the recording. One savepoint, not one per write: the same round trips as before.
        with uow.conn.begin_nested():
            return _gate(uow, container, user_id, payment_lane, lane, processor, merchant_id)
    except Exception as exc:
        _count(metrics, lane, processor, "assign_error")
        log.error("processor lock write failed: %s", type(exc).__name__,
                  extra={"user_id": user_id, "lane": lane, "processor": processor})
        return LockResult(lane, "assign_error", processor, None)


def _gate(uow, container, user_id, payment_lane, lane, processor, merchant_id) -> LockResult:
    metrics = container.metrics
    column = processor_column(lane)
    current = read_lock(uow, user_id) or {}  # one read: a locked user (every renewal) needs nothing else
    if lane != payment_lane:
        if not current:  # every paying user has a lock row, unlocked here
            uow.locks.ensure(user_id, container.clock.now())
        # Rule 9: the settled processor belongs to the other lane's table. It is never written into
        # this lane's lock (tokens are processor-homed), and on a locked user it is only worth a debug line.
        locked = current.get(processor_column(payment_lane))
        if not is_unlocked(locked):
            log.debug("cross-lane settle on a locked user",
                      extra={"user_id": user_id, "lane": payment_lane, "processor": processor})
            _count(metrics, payment_lane, processor, "already_locked")
            return LockResult(payment_lane, "already_locked", processor, locked)
        # Not a failed write (nothing pages on it): rule 9 asks for a debug line, and nothing is locked.
        log.debug("cross-lane settle on an unlocked user; not locked",
                  extra={"user_id": user_id, "lane": payment_lane, "processor": processor})
        _count(metrics, payment_lane, processor, "cross_lane")
        return LockResult(payment_lane, "cross_lane", processor, None)

    stored = current.get(column)
    if is_unlocked(stored):
        # Rule 3: first write wins: the update only applies while the lane is still unlocked.
        values = {column: processor}
        if lane == "nsfw":
            values["nsfw_processor_mid"] = merchant_id
        # One conditional statement (in the gate's savepoint: a failed write never undoes the recording):
        # create the user's row locked, or lock the row only while this lane is still unlocked.
        won = uow.locks.lock_first(user_id, column, values, container.clock.now())
        if won:
            _count(metrics, lane, processor, "locked")
            log.info("processor locked", extra={"user_id": user_id, "lane": lane, "processor": processor})
            return LockResult(lane, "locked", processor, processor)
        winner = (read_lock(uow, user_id) or {}).get(column)
        _count(metrics, lane, processor, "lost_race")
        _drift(metrics, user_id, lane, winner, processor)  # lost to another processor of the lane: drift too
        return LockResult(lane, "lost_race", processor, winner)

    _count(metrics, lane, processor, "already_locked")
    _drift(metrics, user_id, lane, stored, processor)
    return LockResult(lane, "already_locked", processor, stored)


def _drift(metrics, user_id: str, lane: str, locked: str | None, settled: str) -> None:
    """Rule 8: drift within the lane (NSFW: tokens are processor-homed; SFW: expected fallback)."""
    if is_unlocked(locked) or locked == settled:
        return
    log.warning("settled processor differs from locked psp",
                extra={"user_id": user_id, "lane": lane, "locked_psp": locked, "settled_psp": settled})
    metrics.processor_lock_drift.labels(lane=lane, locked_psp=locked, settled_psp=settled).inc()


# ---- operator actions ------------------------------------------------------------------------

def _check_lane(lane: str) -> str:
    if lane not in LANES:
        raise InvalidInput(f"lane must be one of {', '.join(LANES)}")
    return lane


def show(container, user_id: str) -> dict:
    with container.uow() as uow:
        row = uow.locks.read(user_id)
        known = row is not None or uow.users.get(user_id) is not None
    if not known:
        raise NotFound(f"user {user_id} has no lane record")
    if row is None:  # a user whose lanes were never locked (a lock write failed): what the runbooks ask about
        return {"user_id": user_id, "sfw_processor": None, "nsfw_processor": None, "nsfw_processor_mid": None}
    return {"user_id": user_id, "sfw_processor": row["sfw_processor"] or None,
            "nsfw_processor": row["nsfw_processor"] or None, "nsfw_processor_mid": row["nsfw_processor_mid"] or None}


def clear(container, user_id: str, lane: str, reason: str, actor: str, dry_run: bool = False) -> dict:
    """Rule 6: clear a wrong lock only if the user never transacted successfully on the stored processor."""
    _check_lane(lane)
    if not reason or not reason.strip():
        raise InvalidInput("a reason is required")
    column = processor_column(lane)
    with container.uow() as uow:
        row = uow.locks.read(user_id)
        if row is None or is_unlocked(row[column]):
            raise Refused(f"user {user_id} is not locked on {lane}")
        stored = row[column]
        successes = uow.transactions.successes_on(user_id, stored)
        if successes:
            raise Refused(f"user {user_id} has {len(successes)} successful transaction(s) on {stored}; "
                          "the lock stays")
        plan = {"user_id": user_id, "lane": lane, "cleared_processor": stored,
                "cleared_mid": row["nsfw_processor_mid"] if lane == "nsfw" else None}
        if dry_run:
            return {**plan, "dry_run": True}
        values = {column: None}
        if lane == "nsfw":
            values["nsfw_processor_mid"] = None  # cleared together with the processor
        uow.locks.clear(user_id, column, stored, values)
        uow.audit.record(actor=actor, action="lock.clear", target=user_id, reason=reason,
                         details=plan, now=container.clock.now())
        uow.commit()
    return plan


def repair(container, user_id: str, lane: str, actor: str = "operator") -> dict:
    """Rule 11: re-lock from the orchestrator's payment history; one outcome per repair."""

    _check_lane(lane)
    column = processor_column(lane)

    def outcome(value: str) -> None:
        container.metrics.processor_repair_outcome.labels(lane=lane, outcome=value).inc()

    def unavailable(exc: Exception) -> dict:
        """Our own error says what failed; of anything else only the class (a driver's message has internals)."""
        outcome("unavailable")
        error = exc.message if isinstance(exc, BillingError) else type(exc).__name__
        return {"user_id": user_id, "lane": lane, "outcome": "unavailable", "error": error}

    try:
        with container.uow() as uow:
            row = uow.locks.read(user_id)
    except Exception as exc:  # the database is failing: one outcome, as for the orchestrator
        return unavailable(exc)
    if row is not None and not is_unlocked(row[column]):
        outcome("locked")  # refused, but the lane is locked: every repair records one outcome
        raise Refused(f"user {user_id} is already locked on {lane} to {row[column]}")
    try:
        history = [p for p in container.orchestrator.list_payments("SETTLED", customer_id=user_id)
                   if lane_of_processor(p.processor.name, container.settings.processor_lanes) == lane]
    except Exception as exc:
        return unavailable(exc)
    if not history:
        outcome("no_history")
        return {"user_id": user_id, "lane": lane, "outcome": "no_history"}
    first = sorted(history, key=lambda p: str(p.date))[0]
    processor, mid = first.processor.name, first.processor.merchant_id
    try:
        with container.uow() as uow:
            uow.locks.ensure(user_id, container.clock.now())
            values = {column: processor} | ({"nsfw_processor_mid": mid} if lane == "nsfw" else {})
            won = uow.locks.relock(user_id, column, values)
            details = {"lane": lane, "processor": processor, "payment": first.id}
            uow.audit.record(actor=actor, action="lock.repair", target=user_id, reason=None,
                             details=details, now=container.clock.now())
            uow.commit()
    except Exception as exc:
        return unavailable(exc)
    outcome("locked")  # by this repair, or by the settle that won the race while it ran
    if not won:
        raise Refused(f"user {user_id} was locked on {lane} while repairing")
    return {"user_id": user_id, "lane": lane, "outcome": "locked", "processor": processor, "from_payment": first.id}


def backfill_mid(container, actor: str = "operator", dry_run: bool = False) -> dict:
    """Rule 5: the only permitted backfill: the merchant account of legacy NMI-type users whose
    merchant account is NULL or empty. Processor columns are never touched."""
    legacy = container.settings.legacy_nmi_processor
    with container.uow() as uow:
        candidates = uow.locks.legacy_without_mid(legacy)
        filled, missing = [], []
        for row_id, user_id in candidates:
            mid = uow.transactions.first_merchant_id(user_id, legacy)
            if mid is None:
                missing.append(user_id)
                continue
            filled.append({"user_id": user_id, "nsfw_processor_mid": mid})
            if not dry_run:
                uow.locks.fill_mid(row_id, legacy, mid)
        if not dry_run and filled:
            uow.audit.record(actor=actor, action="lock.backfill-mid", target="*", reason=None,
                             details={"filled": filled}, now=container.clock.now())
        if not dry_run:
            uow.commit()
    return {"dry_run": dry_run, "filled": filled, "without_history": missing}


PROBLEMS = ("drift", "unknown", "unlocked")


def problems(container, problem: str, since) -> list[dict]:
    """The users behind a processor-lock alert (issue 38 item 7: its runbook needs ids the alert does not
    carry): each captured payment since `since` that settled on a processor other than its user's lock in
    its lane (`drift`), on a processor no lane lists (`unknown`), or for a user whose lane is still unlocked
    (`unlocked`)."""
    if problem not in PROBLEMS:
        raise InvalidInput(f"problem must be one of {', '.join(PROBLEMS)}")
    table = container.settings.processor_lanes
    with container.uow() as uow:
        settles = uow.locks.settles_since(since)
    found = []
    for row in settles:
        lane = lane_of_processor(row["processor"], table) if row["processor"] else None
        locked = row.get(f"{lane}_processor") if lane else None
        kind = ("unknown" if lane is None else "unlocked" if is_unlocked(locked)
                else "drift" if locked != row["processor"] else None)
        if kind == problem:
            found.append({"user_id": row["customer_id"], "lane": lane, "locked": locked,
                          "settled": row["processor"], "payment_id": row["transaction_id"], "at": row["created_at"]})
    return found
