"""What the scheduled jobs are doing: each job of the table with its lease holder, last success, lag and
last error (`billingctl jobs list`, `health`), and their freshness for the metrics scrape. The schedule
table is data the services may read; running a job is the runner's (jobs/runner.py)."""

from __future__ import annotations

from jobs.schedule import JOBS


def leases(container) -> list[dict]:
    now = container.clock.now()
    with container.uow() as uow:
        rows = uow.leases.all()
    report = []
    for job in JOBS:
        row = rows.get(job.name, {})
        last = row.get("last_success_at")
        lag = (now - last).total_seconds() if last else None
        report.append({"job": job.name, "every_seconds": job.interval_seconds,
                       "holder": row.get("holder") if row.get("expires_at") and row["expires_at"] > now else None,
                       "last_success_at": last, "lag_seconds": round(lag, 1) if lag is not None else None,
                       "last_error": row.get("last_error"),
                       "late": lag is not None and lag > 3 * job.interval_seconds + 60})
    return report
