"""Runs a job under its lease: any number of hosts may run the timers, one executes at a time.

The lease is a row of `job_lease` taken by a conditional update (free, or expired); a second runner
exits 75 at once; a crashed holder's lease expires after the job's lease_seconds."""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from datetime import timedelta

from billingctl.domain.batch import failed_items
from billingctl.domain.errors import BatchFailed, BillingError, LeaseHeld
from billingctl.services.job_status import leases  # noqa: F401 - the runner's report
from jobs.schedule import Job, resolve

log = logging.getLogger("billingctl.jobs")


def holder_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def acquire(container, job: Job, holder: str) -> bool:
    now = container.clock.now()
    expires = now + timedelta(seconds=job.lease_seconds)
    with container.uow() as uow:
        # The usual run finds its row free: one statement (a job's first run ever creates the row).
        taken = uow.leases.take(job.name, holder, now, expires) or uow.leases.create(job.name, holder, now, expires)
        if not taken:
            current = uow.leases.holder(job.name)
            # A holder that was a process on this host that no longer exists (killed, or its database went
            # away before it could release) is taken over now rather than after its lease.
            if current and current.holder and _dead_here(current.holder):
                taken = uow.leases.take(job.name, holder, now, expires, dead_holder=current.holder)
        uow.commit()
    return taken


def _dead_here(holder: str) -> bool:
    host, _, rest = holder.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def release(container, job: Job, holder: str, error: str | None) -> None:
    with container.uow() as uow:
        uow.leases.release(job.name, holder, container.clock.now(), error)
        uow.commit()


def run_once(container, job: Job) -> dict:
    holder = holder_id()
    if not acquire(container, job, holder):
        with container.uow() as uow:
            current = uow.leases.holder(job.name)
        container.metrics.job_runs.labels(job=job.name, outcome="lease_held").inc()
        if job.every_host:  # this host's own share of the job (its webhook spool), which the holder cannot do
            _on_this_host(container, job)
        raise LeaseHeld(f"job {job.name} is running elsewhere ({current.holder}, lease until "
                        f"{current.expires_at.isoformat() if current.expires_at else '?'})")
    started = time.monotonic()
    error = None
    try:
        result = resolve(job)(container)
        if failed_items(result):
            error = f"{failed_items(result)} item(s) failed"
        return {"job": job.name, "result": result, "seconds": round(time.monotonic() - started, 3)}
    except BillingError as exc:
        error = exc.message
        raise
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        try:
            release(container, job, holder, error)
        except Exception as exc:  # the database may be the thing that failed: the lease expires on its own
            log.error("could not release the lease of %s: %s", job.name, type(exc).__name__)
        container.metrics.job_runs.labels(job=job.name, outcome="ok" if error is None else "failed").inc()
        log.info("job finished", extra={"job": job.name, "error": error})


def _on_this_host(container, job: Job) -> None:
    try:
        done = resolve(job, job.every_host)(container)
    except Exception as exc:  # logged; the run still reports the lease held elsewhere
        log.error("host-local work of %s failed: %s", job.name, type(exc).__name__)
        return
    if failed_items(done) or any(done.values()):
        log.info("host-local work done", extra={"job": job.name, "result": done})


def run(container, job: Job) -> dict:
    outcome = run_once(container, job)
    failed = failed_items(outcome["result"])
    if failed:
        raise BatchFailed(f"job {job.name}: {failed} item(s) failed", result=outcome)
    return outcome
