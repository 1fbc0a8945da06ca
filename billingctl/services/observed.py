"""What the metrics scrape reads as live state (issue 38, items 1-3): each dependency read on its own, so
one that is down takes only its own series with it and says so (`billing_dependency_up`), never the whole
scrape. From the database: the jobs' newest success and failure, the inbox, the outbox, the review queue,
the last reconcile, the event poller and the renewal charges in flight; from the breakers (Redis when
configured): their states."""

from __future__ import annotations

import logging

log = logging.getLogger("billingctl.metrics")
WATCHED_SINCE = "jobs_watched_since"  # when this deployment began watching its jobs (a never-run job's "since")


def observed_state(container) -> dict:
    state: dict = {"up": {}}
    try:
        from billingctl.services.health import breaker_status

        if container.redis is not None:
            # Asked directly: the breakers fall back to this process's own state when Redis fails, so their
            # reads succeed with Redis down (it read as up, and a scrape showed a stand-in breaker state).
            container.redis.ping()
            state["up"]["redis"] = 1
        state["breakers"] = breaker_status(container)
    except Exception as exc:  # noqa: BLE001 - a scrape reports what it can read
        log.warning("scrape: breaker state unreadable: %s", type(exc).__name__)
        state["up"]["redis"] = 0
    try:
        state.update(_from_database(container))
        state["up"]["database"] = 1
    except Exception as exc:  # noqa: BLE001 - a scrape reports what it can read
        log.warning("scrape: database unreadable: %s", type(exc).__name__)
        state["up"]["database"] = 0
    state["up"] = {k: v for k, v in state["up"].items() if v is not None}
    return state


def _from_database(container) -> dict:
    from billingctl.services.reconcile import STATE_KEY
    from billingctl.services.renewals import charges_in_flight
    from jobs.schedule import JOBS

    now = container.clock.now()
    with container.uow() as uow:
        watched = uow.cursors.get(WATCHED_SINCE)
        if watched is None:
            uow.cursors.put(WATCHED_SINCE, now.isoformat(), now)
            uow.commit()
            watched = now.isoformat()
        rows = uow.leases.all()
        violations = uow.cursors.get(STATE_KEY)
        newest = uow.poller_runs.newest()
        inbox = uow.inbox.backlog()
        outbox = uow.outbox.backlog()
        review = uow.orphans.count_by_status()
    from billingctl.domain.clock import parse_time
    from billingctl.services.alerts import SINK_SETTINGS

    since = parse_time(watched).timestamp()
    jobs = []
    for job in JOBS:
        row = rows.get(job.name, {})
        success, failure = row.get("last_success_at"), row.get("last_failure_at")
        # A job that never succeeded counts from when it was first watched: it pages after three intervals.
        jobs.append({"job": job.name, "interval_seconds": job.interval_seconds,
                     "last_success_at": success.timestamp() if success else since,
                     "last_failure_at": failure.timestamp() if failure else None})
    return {"jobs": jobs, "violations": int(violations) if violations is not None else None,
            "poller": newest.created_at.timestamp() if newest is not None else None,
            "in_flight": charges_in_flight(container),
            "inbox": {"pending": inbox["pending"], "parked": inbox["parked"],
                      "oldest_pending_age_seconds": _age(now, inbox["oldest_pending"])},
            "outbox": {sink: {"pending": outbox.get(sink, {}).get("pending", 0),
                              "oldest_age_seconds": _age(now, outbox.get(sink, {}).get("oldest"))}
                       for sink in SINK_SETTINGS},
            "review": review}


def _age(now, when) -> float:
    return round(max(0.0, (now - when).total_seconds()), 1) if when is not None else 0.0
