"""The one table of scheduled jobs (DESIGN section 7). cron lines and systemd units are generated
from it (`billingctl jobs render`) and a test checks the committed files against it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Job:
    name: str
    interval_seconds: int
    command: tuple[str, ...]  # the billingctl command the job runs (what an operator would type)
    target: str  # "module:function" called with the container; returns a dict
    lease_seconds: int  # a crashed holder's lease expires after this
    description: str
    # "module:function" called with the container by a run on every host, also one that finds the lease held:
    # work on the host's own disk, which the lease's holder cannot do for it (decision 210)
    every_host: str | None = None


JOBS: tuple[Job, ...] = (
    Job("poll", 15, ("poll",), "billingctl.services.events:poll", 120,
        "Event poller: process the provider's events after the cursor",
        every_host="billingctl.services.spool:drain"),
    Job("orphans", 60, ("orphans", "run"), "billingctl.services.orphans:run_orphans", 300,
        "Settled-payments poller: record missed payments, recover orphans"),
    Job("activations", 60, ("activate", "--pending"), "billingctl.services.payments:retry_pending", 300,
        "Finish pending provider records and activations"),
    Job("renewals", 900, ("renewals", "run"), "billingctl.services.renewals:run_renewals", 1800,
        "Dunning tick: one attempt per due renewal invoice"),
    Job("checkout-cleanup", 3600, ("checkout", "cleanup"), "billingctl.services.checkout:cleanup_expired", 3600,
        "Cancel expired pending checkouts older than a day"),
    Job("poller-watchdog", 60, ("poll", "--watchdog"), "billingctl.services.events:watchdog", 120,
        "Alert when the newest poller run is older than 5 minutes"),
    Job("velocity-watch", 60, ("fraud", "velocity"), "billingctl.services.users:velocity_watch", 120,
        "Alert on more than 10 charges or 1000 units a minute"),
    Job("alerts-deliver", 60, ("alerts", "deliver"), "billingctl.services.alerts:deliver_outbox", 300,
        "Deliver chat alerts, notifications and analytics from the outbox"),
    Job("reconcile", 86400, ("reconcile",), "billingctl.services.reconcile:reconcile", 7200,
        "Check the invariants: payments recorded once, ledger, credits, subscriptions"),
    Job("prune", 86400, ("db", "prune"), "billingctl.services.retention:prune", 3600,
        "Prune old poller runs, processed inbox payloads, delivered outbox rows, old audit rows"),
)

BY_NAME = {job.name: job for job in JOBS}


def resolve(job: Job, target: str | None = None):
    """The function a job's target (or another of its "module:function" names) points at."""
    import importlib

    module, function = (target or job.target).split(":")
    return getattr(importlib.import_module(module), function)
