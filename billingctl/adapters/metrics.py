"""Prometheus metrics with the spec's exact names and labels (spec section 6), plus job and breaker
metrics. One registry per container; with PROMETHEUS_MULTIPROC_DIR set, every process writes to the
shared directory and the internal app's /metrics aggregates them."""

from __future__ import annotations

from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 30, 60, 120, 300, 900)


def ensure_multiprocess_dir() -> str | None:
    """Jobs run whether or not PROMETHEUS_MULTIPROC_DIR exists (a timer host without the web units, a
    cron line): the directory is created; when it cannot be, this process keeps its samples in a private
    directory (they are not scraped, and a warning says so) instead of crashing."""
    import logging
    import os
    import tempfile

    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        return None
    try:
        os.makedirs(path, exist_ok=True)
        if os.access(path, os.W_OK):
            _archive_at_exit()
            return path
        raise PermissionError(path)
    except OSError as exc:
        import atexit
        import shutil

        private = tempfile.mkdtemp(prefix="billing-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = private
        # Nobody scrapes it: removed when the process exits (a cron host left ~13,000 a day behind).
        atexit.register(shutil.rmtree, private, True)
        logging.getLogger("billingctl.metrics").warning(
            "metrics directory unavailable (%s: %s); this process's metrics are not scraped",
            type(exc).__name__, path, extra={"metrics_dir": path})
        return private


LOCK_OUTCOMES = ("locked", "already_locked", "lost_race", "unknown_processor", "assign_error", "cross_lane")
REPAIR_OUTCOMES = ("locked", "no_history", "unavailable")
HELD_REASONS = ("partially_settled", "amount_mismatch", "currency_mismatch", "refund_failed")

_ARCHIVING: list[int] = []


def _archive_at_exit() -> None:
    import atexit
    import os

    if os.getpid() not in _ARCHIVING:
        _ARCHIVING.append(os.getpid())
        atexit.register(archive_process_metrics)


@contextmanager
def folding_lock(path: str, exclusive: bool):
    """The metrics directory's lock: a fold holds it alone, a scrape shares it with other scrapes. A scrape
    therefore never sees an archive that already holds an exiting process's counts beside that process's
    own file (counted twice, then a counter going backwards: a reset to Prometheus)."""
    import fcntl
    import os

    with open(os.path.join(path, "archive.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def archive_process_metrics(pid: int | None = None) -> int:
    """Fold one exiting process's metric files into one archive file per kind (counters and histograms
    summed, max gauges kept as the max; other gauges are state and dropped), so the directory stays a
    few files however many job processes ran, and the scrape stays fast. Returns the files folded."""
    import glob
    import os

    from prometheus_client.mmap_dict import MmapedDict

    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path or not os.path.isdir(path):
        return 0
    pid = pid or os.getpid()
    folded = 0
    with folding_lock(path, exclusive=True):
        for name in glob.glob(os.path.join(path, f"*_{pid}.db")):
            kind = os.path.basename(name)[:-len(f"_{pid}.db")]  # counter, histogram, gauge_max, ...
            if kind in ("counter", "histogram", "summary", "gauge_max", "gauge_min"):
                archive = MmapedDict(os.path.join(path, f"{kind}_archive.db"))
                try:
                    for key, value, timestamp, _ in MmapedDict.read_all_values_from_file(name):
                        current, _ = archive.read_value(key)
                        if kind == "gauge_max":
                            value = max(value, current) if current else value
                        elif kind == "gauge_min":
                            value = min(value, current) if current else value
                        else:
                            value = current + value
                        archive.write_value(key, value, timestamp)
                finally:
                    archive.close()
            os.remove(name)
            folded += 1
    return folded


class Metrics:
    def preset(self, processor_lanes: dict[str, str]) -> Metrics:
        """Create the rare-event label sets at 0, so the first occurrence is an increase every rule sees
        and every spec metric is on the first scrape."""
        lanes = sorted(set(processor_lanes.values()) | {"sfw", "nsfw"})
        for lane in lanes:
            own = sorted(p for p, p_lane in processor_lanes.items() if p_lane == lane)
            for psp in (*own, "none", "other"):
                for outcome in LOCK_OUTCOMES:
                    self.processor_lock_outcome.labels(lane=lane, psp=psp, outcome=outcome)
            for locked in own:
                for settled in own:
                    if locked != settled:
                        self.processor_lock_drift.labels(lane=lane, locked_psp=locked, settled_psp=settled)
            for outcome in REPAIR_OUTCOMES:
                self.processor_repair_outcome.labels(lane=lane, outcome=outcome)
        from billingctl.domain.lifecycle import LIFECYCLES

        for name in (*(lifecycle.name for lifecycle in LIFECYCLES), "notification"):
            self.lifecycle_illegal.labels(lifecycle=name)
        for reason in HELD_REASONS:
            self.payments_held.labels(reason=reason)
        return self

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.payment_recording_latency = Histogram(
            "payment_recording_latency_seconds",
            "Time from the payment's settle to its recording.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.events_polled = Counter(
            "events_polled", "Subscription-provider events read by the event poller.", registry=r
        )
        self.provider_rate_limit_errors = Counter(
            "billing_provider_rate_limit_errors",
            "HTTP 429 answers from the subscription provider.",
            registry=r,
        )
        self.processor_lock_outcome = Counter(
            "billing_processor_lock_outcome",
            "One record per gated settle.",
            ["lane", "psp", "outcome"],
            registry=r,
        )
        self.processor_repair_outcome = Counter(
            "billing_processor_repair_outcome",
            "One record per history-based lock repair.",
            ["lane", "outcome"],
            registry=r,
        )
        self.processor_lock_drift = Counter(
            "billing_processor_lock_drift",
            "Settled processor differs from the locked one within the lane.",
            ["lane", "locked_psp", "settled_psp"],
            registry=r,
        )
        self.circuit_breaker_state = Gauge(
            "billing_circuit_breaker_state",
            "Circuit breaker state per dependency: 0 closed, 1 half-open, 2 open.",
            ["dependency"],
            registry=r,
            multiprocess_mode="max",
        )
        self.external_errors = Counter(
            "billing_external_errors",
            "Failed calls to external systems by dependency and error type.",
            ["dependency", "error"],
            registry=r,
        )
        self.job_runs = Counter(
            "billing_job_runs", "Job runs by outcome.", ["job", "outcome"], registry=r
        )
        self.activation_errors = Counter(
            "billing_activation_errors", "Failed subscription activations.", registry=r
        )
        self.sync_errors = Counter("billing_sync_errors", "Failed subscription syncs.", registry=r)
        self.poller_last_run = Gauge(
            "billing_event_poller_last_run_timestamp_seconds", "Unix time of the newest event poller run.",
            registry=r, multiprocess_mode="max",
        )
        self.reconcile_violations = Gauge(
            "billing_reconcile_violations", "Invariant violations found by the last reconcile.", registry=r,
            multiprocess_mode="max",
        )
        self.redis_errors = Counter(
            "billing_redis_errors", "Redis failures absorbed by a fallback (locks, cache, limiter, breaker).",
            ["component"], registry=r,
        )
        self.payments_recorded = Counter(
            "billing_payments_recorded", "Payments recorded by path.", ["path"], registry=r
        )
        self.lifecycle_illegal = Counter(
            "billing_lifecycle_illegal_transitions",
            "Events outside a money aggregate's transition table (domain.lifecycle), by aggregate.",
            ["lifecycle"], registry=r,
        )
        self.renewal_charges_stuck = Counter(
            "billing_renewal_charges_stuck",
            "Renewal charges in flight past their age limit that could be neither captured nor cancelled.",
            registry=r,
        )
        self.webhooks_spooled = Counter(
            "billing_webhooks_spooled", "Authenticated webhooks kept on disk while the database was away.",
            ["source"], registry=r,
        )
        self.payments_held = Counter(
            "billing_payments_held", "Captured payments held for review instead of credited, by reason.",
            ["reason"], registry=r,
        )

    def sample(self, name: str, labels: dict | None = None) -> float:
        """The current value of one sample (tests and `health` read metrics back this way)."""
        value = self.registry.get_sample_value(name, labels or {})
        return value or 0.0


# State gauges are read from the shared state when Prometheus scrapes, never aggregated over the files
# of processes that exited (a job that once saw the breaker open would keep the alert firing).
LIVE_GAUGES = ("billing_circuit_breaker_state", "billing_reconcile_violations",
               "billing_job_last_success_timestamp_seconds", "billing_job_last_failure_timestamp_seconds",
               "billing_job_interval_seconds", "billing_outbox_pending", "billing_outbox_oldest_pending_age_seconds",
               "billing_inbox_events", "billing_inbox_oldest_pending_age_seconds", "billing_orphans",
               "billing_event_poller_last_run_timestamp_seconds", "billing_renewal_charges_in_flight",
               "billing_renewal_charge_in_flight_oldest_age_seconds", "billing_dependency_up")


class FoldedDirectory:
    """Every process's metric files in PROMETHEUS_MULTIPROC_DIR, read under the folding lock's shared side
    (no exiting process folds meanwhile: issue 38 item 4). A file a starting process has created but not
    yet written, or one removed between the listing and the read, is left out of this scrape instead of
    failing it (struct.error before); a directory that does not exist yet is empty (it was a 500)."""

    def __init__(self, path: str):
        self.path = path

    def collect(self):
        import glob
        import os
        import struct

        from prometheus_client.mmap_dict import MmapedDict
        from prometheus_client.multiprocess import MultiProcessCollector

        if not os.path.isdir(self.path):
            return []  # no process has written yet (or the runtime directory was cleaned): nothing to add
        with folding_lock(self.path, exclusive=False):
            readable = []
            for name in glob.glob(os.path.join(self.path, "*.db")):
                try:
                    MmapedDict.read_all_values_from_file(name)
                except (FileNotFoundError, struct.error, ValueError):
                    continue
                readable.append(name)
            return list(MultiProcessCollector.merge(readable, accumulate=True))


class WithoutLive:
    """The multiprocess aggregation minus the state gauges (LiveState answers those)."""

    def __init__(self, inner):
        self.inner = inner

    def collect(self):
        families = list(self.inner.collect())
        for family in families:
            if family.name not in LIVE_GAUGES:
                yield family


class LiveState:
    """The live state gauges, from one read of the shared state at scrape time (`read()`: a document as
    billingctl.services.observed builds it). A part that could not be read is absent, and
    billing_dependency_up says which dependency is down (issue 38 item 3)."""

    def __init__(self, read: callable):
        self.read = read

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        from billingctl.adapters.breaker import STATE_VALUE

        state = self.read()

        def family(name, text, labels=None, rows=()):
            metric = GaugeMetricFamily(name, text, labels=labels)
            for row in rows:
                metric.add_metric(*row)
            return metric

        yield family("billing_dependency_up", "1 when the scrape could read the dependency, 0 when it could not.",
                     ["dependency"], [([name], up) for name, up in state.get("up", {}).items()])
        if "breakers" in state:
            yield family("billing_circuit_breaker_state",
                         "Circuit breaker state per dependency: 0 closed, 1 half-open, 2 open.", ["dependency"],
                         [([name], STATE_VALUE.get(snap["state"], 2)) for name, snap in state["breakers"].items()])
        if state.get("violations") is not None:
            yield GaugeMetricFamily("billing_reconcile_violations",
                                    "Invariant violations found by the last reconcile.", value=state["violations"])
        if "jobs" in state:
            jobs = state["jobs"]
            yield family("billing_job_last_success_timestamp_seconds",
                         "Unix time of each job's newest successful run (from its lease row, any host); for a job "
                         "that never succeeded, when this deployment began watching it.", ["job_name"],
                         [([j["job"]], j["last_success_at"]) for j in jobs])
            yield family("billing_job_last_failure_timestamp_seconds",
                         "Unix time of each job's newest failed run (any host).", ["job_name"],
                         [([j["job"]], j["last_failure_at"]) for j in jobs if j["last_failure_at"] is not None])
            yield family("billing_job_interval_seconds", "Each job's scheduled interval.", ["job_name"],
                         [([j["job"]], j["interval_seconds"]) for j in jobs])
        if "outbox" in state:
            outbox = state["outbox"]
            yield family("billing_outbox_pending", "Outbox messages not yet delivered, by sink.", ["sink"],
                         [([sink], v["pending"]) for sink, v in outbox.items()])
            yield family("billing_outbox_oldest_pending_age_seconds",
                         "Age of the oldest undelivered outbox message, by sink (0 when none).", ["sink"],
                         [([sink], v["oldest_age_seconds"]) for sink, v in outbox.items()])
        if "inbox" in state:
            inbox = state["inbox"]
            yield family("billing_inbox_events", "Inbox events waiting (pending) or given up on (parked).",
                         ["state"], [(["pending"], inbox["pending"]), (["parked"], inbox["parked"])])
            yield GaugeMetricFamily("billing_inbox_oldest_pending_age_seconds",
                                    "Age of the oldest pending inbox event (0 when none).",
                                    value=inbox["oldest_pending_age_seconds"])
        if "review" in state:
            yield family("billing_orphans", "Review rows still open, by status (retrying: recovery's own; "
                         "exhausted, needs_review: a person's).", ["status"],
                         [([status], n) for status, n in state["review"].items()])
        charges = state.get("in_flight")
        if charges is not None:
            yield GaugeMetricFamily("billing_renewal_charges_in_flight",
                                    "Renewal charges the orchestrator has not ended yet.", value=charges["count"])
            yield GaugeMetricFamily("billing_renewal_charge_in_flight_oldest_age_seconds",
                                    "Age of the oldest renewal charge in flight (0 when none).",
                                    value=charges["oldest_age_seconds"])
        if state.get("poller") is not None:
            yield GaugeMetricFamily("billing_event_poller_last_run_timestamp_seconds",
                                    "Unix time of the newest event poller run (any host).", value=state["poller"])
