"""Runbooks as tests (issue 38 item 8): for each alert of prometheus/alerts.yml, its fault is planted in the
production shape (PostgreSQL, Redis, the sandbox over its store, every process on the sandbox's clock), the
alert's condition is seen on the internal app's /metrics, the runbook's commands are followed as written
(tests/e2e/runbooks.py), and the condition is seen cleared on the next scrape. An alert that counts events
(`increase(...)`) is cleared when the thing that counted runs again and counts nothing more."""

from __future__ import annotations

import json

import pytest

from billingctl.bootstrap import Container
from billingctl.services.checkout import create_checkout
from tests.e2e.runbooks import Runbook, alert_names, ids, scrape, table, value
from tests.helpers import billingctl, term_runs_out

pytestmark = pytest.mark.e2e


class Ops:
    """One production-shaped world: the test's container and the environment of an operator's shell."""

    def __init__(self, container, env, metrics_dir):
        self.c, self.env, self.metrics_dir = container, env, metrics_dir
        self.sandbox = container.sandbox

    def runbook(self, name: str) -> Runbook:
        return Runbook(name, self.env)

    def scrape(self) -> dict:
        return scrape(self.c, self.metrics_dir)

    def cli(self, *args, expect=0):
        done = billingctl(list(args), self.env)
        codes = expect if isinstance(expect, tuple) else (expect,)
        assert done.returncode in codes, f"{args}: {done.returncode}\n{done.stdout}\n{done.stderr}"
        return json.loads(done.stdout) if args[0] == "--json" and done.stdout.strip() else done

    def advance(self, seconds: float) -> None:
        self.sandbox.store.advance_clock(seconds)  # every process reads the sandbox's clock

    def paid(self, user: str, plan: str = "credits-pro-USD-monthly", **kw) -> tuple[dict, dict]:
        co = create_checkout(self.c, user, plan)
        return co, self.sandbox.pay(co["order_id"], **kw)

    def paid_by_cli(self, user: str, plan: str = "credits-pro-USD-monthly", *flags: str) -> tuple[dict, dict]:
        """A checkout paid through `billingctl sandbox pay`: its webhook is handled in that process, so
        what recording counts reaches the metrics directory."""
        co = create_checkout(self.c, user, plan)
        return co, self.cli("--json", "sandbox", "pay", co["order_id"], *flags)

    def now(self) -> float:
        return self.sandbox.store.now()


@pytest.fixture(params=["postgresql"])
def db_url(request):
    """Production's database: the runbooks are followed on PostgreSQL (with Redis) only."""
    from tests.conftest import _truncate_postgres

    url = request.getfixturevalue("pg_url")
    _truncate_postgres(url)
    return url


@pytest.fixture
def ops(make_settings, db_url, redis_url, tmp_path):
    settings = make_settings(database_url=db_url, redis_url=redis_url, clock="sandbox")
    env = {"BILLING_DATABASE_URL": db_url, "BILLING_SANDBOX_DB": settings.sandbox_db, "BILLING_REDIS_URL": redis_url,
           "BILLING_CLOCK": "sandbox", "BILLING_INTERNAL_TOKEN": "test-internal-token",
           "BILLING_CHECKOUT_STARTS_PER_USER_PER_MINUTE": "1000",
           "BILLING_WEBHOOK_SPOOL_DIR": settings.webhook_spool_dir,
           "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics")}
    container = Container(settings)
    world = Ops(container, env, tmp_path / "metrics")
    world.scrape()  # Prometheus watches from the deployment's start (a job's "never succeeded" counts from here)
    yield world
    container.close()


def test_every_alert_has_its_runbook_test():
    tested = {name.removeprefix("test_runbook_") for name in globals() if name.startswith("test_runbook_")}
    assert set(alert_names()) <= tested, sorted(set(alert_names()) - tested)


# ---- the inbox, orphans and the outbox ------------------------------------------------------------------

def test_runbook_EventsParked(ops):
    """A refund's provider events fail at every attempt while the orchestrator refuses our key (rotated
    there, not here) and are parked; once the key is fixed the runbook replays them: nothing is parked, the
    refund stands reversed once. (An outage parks nothing: decision 216.)"""
    from billingctl.services import events, provider_events

    co, payment = ops.paid("user_parked")
    ops.sandbox.store.add_fault("orchestrator", "401", count=-1)
    ops.c.orchestrator.http.sleep = ops.c.provider.http.sleep = lambda s: None
    ops.sandbox.refund(payment["id"])
    for _ in range(provider_events.MAX_EVENT_ATTEMPTS + 1):
        ops.advance(600)
        events.poll(ops.c)
    assert value(ops.scrape(), "billing_inbox_events", state="parked") == 2
    ops.sandbox.store.clear_faults()  # the key is fixed

    book = ops.runbook("EventsParked")
    parked = table(book.run("events list --state parked").stdout)
    assert {row["event_type"] for row in parked} == {"credit_note_created", "payment_refunded"}
    for row in parked:
        assert "orchestrator" in book.run("events show ID", ID=row["id"]).stdout
        book.run("events replay ID", ID=row["id"])
    book.run("events list --state pending")
    book.followed()

    assert value(ops.scrape(), "billing_inbox_events", state="parked") == 0
    assert ops.cli("--json", "users", "show", "user_parked")["credits"] == 0


def test_runbook_OrphanRecoveryExhausted(ops):
    """A payment for an expired checkout is an orphan; the provider refuses to subscribe it ten times and
    recovery gives up. After the provider recovers, the runbook's retry subscribes and credits it."""
    from billingctl.services.checkout import cleanup_expired
    from billingctl.services.orphans import run_orphans

    co = create_checkout(ops.c, "user_orphan", "credits-pro-USD-monthly")
    ops.advance(2 * 86400)
    cleanup_expired(ops.c)
    payment = ops.sandbox.pay(co["order_id"])
    ops.sandbox.store.add_fault("provider", "500", path="subscription_for_items", count=-1)
    ops.c.provider.http.sleep = lambda s: None
    # Five hours of recovery compressed into seconds: the planting process's share of the provider budget
    # is lifted (its batch share made the run wait a minute in real time); the runbook's commands keep theirs.
    ops.c.provider.http.limiter = None
    for _ in range(10):
        ops.advance(1801)
        run_orphans(ops.c)
    assert value(ops.scrape(), "billing_orphans", status="exhausted") == 1
    ops.sandbox.store.clear_faults()  # the provider's outage ended
    ops.advance(120)

    book = ops.runbook("OrphanRecoveryExhausted")
    listed = book.run("orphans list --state exhausted").stdout
    assert ids(listed, "pay_") == [payment["id"]]
    book.run("orphans show PAYMENT_ID", PAYMENT_ID=payment["id"])
    book.run("orphans retry PAYMENT_ID", PAYMENT_ID=payment["id"])
    book.not_taken_here("orphans resolve PAYMENT_ID --refund", "the retry recovered it: nothing to give back")
    book.not_taken_here("orphans resolve PAYMENT_ID --create-subscription", "the retry subscribed the customer")
    book.followed()

    assert value(ops.scrape(), "billing_orphans", status="exhausted") == 0
    assert ops.cli("--json", "users", "show", "user_orphan")["credits"] == 2000


class ChatEndpoint:
    """A Slack-compatible incoming webhook on a loopback port: it answers `status` and keeps what it took."""

    def __init__(self):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        endpoint = self
        self.status, self.received = 503, []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if endpoint.status == 200:
                    endpoint.received.append(json.loads(body))
                self.send_response(endpoint.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks/chat"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_runbook_ChatAlertsUndelivered(ops):
    """The chat endpoint refuses for over 15 minutes while a page waits for it; once it answers again the
    runbook delivers the backlog."""
    from billingctl.services import alerts

    chat = ChatEndpoint()
    try:
        ops.env["BILLING_ALERT_WEBHOOK_URL"] = chat.url
        with ops.c.uow() as uow:
            alerts.enqueue(uow, ops.c.clock, "chat", {"text": "ORPHANED PAYMENT RECOVERY EXHAUSTED"}, "k1")
            uow.commit()
        ops.cli("alerts", "deliver", expect=5)
        ops.advance(1200)
        assert value(ops.scrape(), "billing_outbox_oldest_pending_age_seconds", sink="chat") > 900
        chat.status = 200  # the endpoint is back

        book = ops.runbook("ChatAlertsUndelivered")
        pending = book.run("alerts list --state pending").stdout
        assert "ORPHANED PAYMENT RECOVERY EXHAUSTED" in pending and "503" in pending
        book.run("health", expect=(0, 3))
        book.run("alerts deliver")
        book.followed()

        assert value(ops.scrape(), "billing_outbox_oldest_pending_age_seconds", sink="chat") == 0
        assert [m["text"] for m in chat.received] == ["ORPHANED PAYMENT RECOVERY EXHAUSTED"]
    finally:
        chat.close()


# ---- payments -------------------------------------------------------------------------------------------

def _quantile(before: dict, after: dict, name: str, q: float) -> float | None:
    """The q-quantile's bucket bound of the observations made between two scrapes (None: there were none)."""
    def buckets(series):
        found = {}
        for (n, labels), v in series.items():
            if n == f"{name}_bucket":
                le = float(dict(labels)["le"])
                found[le] = found.get(le, 0) + v
        return found
    b, a = buckets(before), buckets(after)
    counts = {le: a[le] - b.get(le, 0) for le in a}
    total = counts.get(float("inf"), 0)
    if not total:
        return None
    return min(le for le, n in counts.items() if n >= q * total)


def test_runbook_PaymentRecordingLatencyHigh(ops):
    """Payments' webhooks are lost: the settled-payments poller records them ten minutes late (p99 over 60
    s). The runbook finds nothing left waiting; the next payment, its webhook delivered, is recorded in time."""
    start = ops.scrape()
    co, late = ops.paid("user_late", drop_webhook=True)
    ops.advance(600)
    ops.cli("orphans", "run")  # the scheduled poller finds it
    fired = ops.scrape()
    assert _quantile(start, fired, "payment_recording_latency_seconds", 0.99) > 60

    book = ops.runbook("PaymentRecordingLatencyHigh")
    book.run("health", expect=(0, 3))
    book.run("events list --state pending")
    book.run("jobs list")
    book.run("poll")
    book.run("orphans run")
    book.followed()

    ops.paid_by_cli("user_on_time")
    assert _quantile(fired, ops.scrape(), "payment_recording_latency_seconds", 0.99) <= 60
    assert ops.cli("--json", "users", "show", "user_late")["credits"] == 2000


def test_runbook_ActivationErrorsHigh(ops):
    """The provider fails the activation of a paid subscription: the payment is recorded, the activation
    counted as an error. After the outage the runbook activates it; the next payment activates cleanly."""
    ops.sandbox.store.add_fault("provider", "503", path="update_for_items", count=-1)
    start = ops.scrape()
    co, payment = ops.paid_by_cli("user_act")
    ops.sandbox.store.clear_faults()  # the outage ends
    fired = ops.scrape()
    errors = value(fired, "billing_activation_errors_total") - value(start, "billing_activation_errors_total")
    recorded = value(fired, "billing_payments_recorded_total") - value(start, "billing_payments_recorded_total")
    assert errors / max(recorded, 1) > 0.01

    book = ops.runbook("ActivationErrorsHigh")
    health = book.run("health", expect=3).stdout
    assert co["subscription_id"] in health
    book.run("activate --pending")
    book.run("activate SUB", SUB=co["subscription_id"])
    book.followed()

    assert ops.sandbox.subscription(co["subscription_id"])["status"] == "active"
    ops.paid_by_cli("user_act_2")
    after = ops.scrape()
    assert value(after, "billing_activation_errors_total") == value(fired, "billing_activation_errors_total")
    assert value(after, "billing_payments_recorded_total") > value(fired, "billing_payments_recorded_total")


def test_runbook_ReconcileViolations(ops):
    """A payment settled at the orchestrator is never recorded (its webhook lost, the poller down):
    reconcile pages. The runbook traces the customer, records the payment, and the full pass is clean."""
    co, payment = ops.paid("user_unrecorded", drop_webhook=True)
    ops.advance(2 * 3600)
    ops.cli("reconcile", expect=5)
    assert value(ops.scrape(), "billing_reconcile_violations") > 0

    book = ops.runbook("ReconcileViolations")
    found = book.run("reconcile", expect=5).stdout
    assert "payment_unrecorded" in found and payment["id"] in found
    traced = book.run("trace USER_OR_PAYMENT_ID", expect=5, USER_OR_PAYMENT_ID=payment["id"]).stdout
    assert "payment_unrecorded" in traced
    book.run("payments record PAYMENT_ID", PAYMENT_ID=payment["id"])
    book.run("orphans list")
    book.not_taken_here("sync SUB", "for subscription_differs; this incident is payment_unrecorded")
    shown = book.run("users show USER", USER="user_unrecorded").stdout
    assert "2000" in shown
    book.not_taken_here("reconcile ack CHECK", "for a case finance has judged; this one is fixed in the books")
    book.run("reconcile acks")
    book.followed()

    ops.cli("reconcile", "--full")  # how you know it is fixed
    assert value(ops.scrape(), "billing_reconcile_violations") == 0


def test_runbook_WebhooksSpooled(ops):
    """Decision 208: a chargeback is opened and lost while the database is away; the web app keeps both
    notifications on disk (202). The runbook shows them waiting and dispatches them: the credits are
    reversed once and the spool is empty."""
    from tests.servers import free_port

    _, payment = ops.paid("user_spooled")
    away = {**ops.env, "BILLING_DATABASE_URL": f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/none"}
    start = ops.scrape()
    opened = json.loads(billingctl(["--json", "sandbox", "dispute-status", payment["id"], "OPEN"], away).stdout)
    lost = json.loads(billingctl(["--json", "sandbox", "dispute-status", payment["id"], "LOST", "--dispute-id",
                                  opened["dispute"]["processorDisputeId"]], away).stdout)
    assert (opened["delivered"], lost["delivered"]) == (202, 202)
    fired = ops.scrape()
    assert value(fired, "billing_webhooks_spooled_total", source="orchestrator") - value(
        start, "billing_webhooks_spooled_total", source="orchestrator") == 2

    book = ops.runbook("WebhooksSpooled")
    shown = book.run("health", expect=(0, 3)).stdout
    assert "2 webhook(s) waiting" in shown
    listed = book.run("ls -l SPOOL_DIR", SPOOL_DIR=ops.c.settings.webhook_spool_dir).stdout
    assert listed.count(".json") == 2
    book.not_taken_here("journalctl -u billing-job-poll", "no systemd here: the database is back")
    book.run("jobs run poll")
    events = book.run("events list").stdout
    assert "DISPUTE.STATUS" in events
    book.followed()

    assert "webhook_spool" in ops.cli("health", expect=(0, 3)).stdout
    assert [c for c in ops.cli("--json", "health", expect=(0, 3))["checks"]
            if c["name"] == "webhook_spool"][0]["data"]["waiting"] == 0
    with ops.c.uow() as uow:
        assert uow.users.get("user_spooled")["credits"] == 0


def test_runbook_PaymentsHeldForReview(ops):
    """A renewal charge is captured in part: held for review, nothing credited. The runbook finds it and
    refunds it; the review queue is empty and the next renewal is not held."""
    co, _ = ops.paid("user_held")
    term_runs_out(ops.sandbox, co["subscription_id"])
    ops.sandbox.renew_due()
    ops.cli("sandbox", "async-charges", "PARTIALLY_SETTLED")
    start = ops.scrape()
    ops.cli("renewals", "run")
    fired = ops.scrape()
    assert value(fired, "billing_payments_held_total") - value(start, "billing_payments_held_total") == 1
    ops.cli("sandbox", "async-charges", "off")

    book = ops.runbook("PaymentsHeldForReview")
    listed = book.run("orphans list --state needs_review").stdout
    assert "partially_settled" in listed
    [charge] = ids(listed, "pay_")
    book.run("orphans show PAYMENT_ID", PAYMENT_ID=charge)
    book.run("users show USER", USER="user_held")
    book.run("orphans resolve PAYMENT_ID --refund", PAYMENT_ID=charge, R='"captured in part; refunded"')
    book.not_taken_here("orphans resolve PAYMENT_ID --mark-handled", "refunded instead")
    book.not_taken_here("alerts list", "held for a partial capture, not a refused refund")
    book.not_taken_here("payments refund PAYMENT_ID", "held in the review queue: resolved there")
    book.followed()

    assert ids(ops.cli("orphans", "list", "--state", "needs_review").stdout, "pay_") == []
    assert ops.cli("--json", "orphans", "show", charge)["orphan"]["status"] == "resolved"
    co2, _ = ops.paid("user_held_2")
    term_runs_out(ops.sandbox, co2["subscription_id"])
    ops.sandbox.renew_due()
    ops.cli("renewals", "run")
    assert value(ops.scrape(), "billing_payments_held_total") == value(fired, "billing_payments_held_total")


def test_runbook_PaymentsHeldForReview_for_a_refund_the_processor_refused(ops):
    """Decision 174: an operator's refund is answered pending, then refused by the processor; the
    notification counts it (`reason="refund_failed"`) and one chat alert names the payment. The runbook
    finds it and asks again: a new refund, settled; the credits go back once."""
    _, payment = ops.paid("user_refused")
    pid = payment["id"]
    ops.cli("sandbox", "async-refunds", "FAILED")
    start = ops.scrape()
    first = ops.cli("--json", "payments", "refund", pid, "--reason", "customer asked", "--yes")
    assert (first["outcome"], first["credits_reversed"]) == ("refund_pending", 0)
    ops.cli("sandbox", "clock", "60")  # the processor decides: refused, and PAYMENT.REFUND says so
    fired = ops.scrape()
    assert value(fired, "billing_payments_held_total", reason="refund_failed") - value(
        start, "billing_payments_held_total", reason="refund_failed") == 1
    ops.cli("sandbox", "async-refunds", "off")

    book = ops.runbook("PaymentsHeldForReview")
    listed = book.run("alerts list").stdout
    assert f"Refund of payment {pid} failed at the processor" in listed
    assert ids(book.run("orphans list --state needs_review").stdout, "pay_") == []  # no row holds it
    book.run("users show USER", USER="user_refused")
    book.not_taken_here("orphans show PAYMENT_ID", "no review row")
    book.run("payments refund PAYMENT_ID", PAYMENT_ID=pid, R='"refused once; asked again"')
    book.not_taken_here("orphans resolve PAYMENT_ID --refund", "no review row")
    book.not_taken_here("orphans resolve PAYMENT_ID --mark-handled", "refunded instead")
    book.followed()

    again = ops.cli("--json", "payments", "refund", pid, "--reason", "checking", "--yes")
    assert (again["outcome"], again["refunded"], again["credits_reversed_total"]) == (
        "already_refunded", payment["amount"], 2000)
    ops.cli("reconcile", "--full")  # exits 0: the books agree


def test_runbook_RenewalChargeStuck(ops):
    """A renewal charge stays SETTLING at the processor for over a day; it finally settles at the
    orchestrator, its webhook lost. The runbook reads it and records it: nothing is in flight."""
    co, _ = ops.paid("user_stuck")
    term_runs_out(ops.sandbox, co["subscription_id"])
    ops.sandbox.renew_due()
    ops.cli("sandbox", "async-charges", "SETTLING")
    ops.cli("renewals", "run")
    ops.advance(25 * 3600)
    ops.cli("renewals", "run")
    assert value(ops.scrape(), "billing_renewal_charge_in_flight_oldest_age_seconds") > 86400
    [charge] = [p for p in ops.sandbox.store.all("payment")
                if (p.get("paymentMethod") or {}).get("paymentType") == "SUBSCRIPTION"]
    ops.cli("sandbox", "finish", charge["id"], "--drop-webhook")  # settled at last; its webhook lost
    ops.cli("sandbox", "async-charges", "off")

    book = ops.runbook("RenewalChargeStuck")
    assert charge["id"] in book.run("health", expect=3).stdout
    listed = book.run("renewals list").stdout
    assert charge["id"] in listed
    book.run("payments record PAYMENT_ID --dry-run", PAYMENT_ID=charge["id"])
    book.run("payments record PAYMENT_ID", PAYMENT_ID=charge["id"])
    book.run("renewals run")
    book.followed()

    assert value(ops.scrape(), "billing_renewal_charge_in_flight_oldest_age_seconds") == 0
    assert ops.cli("--json", "users", "show", "user_stuck")["credits"] == 4000


# ---- the poller, jobs and the provider ------------------------------------------------------------------

def test_runbook_NoEventsPolled(ops):
    """Customers check out (the provider emits events) while no poll runs: the poller read nothing for
    five minutes. The runbook's poll reads them."""
    start = ops.scrape()
    create_checkout(ops.c, "user_quiet", "credits-pro-USD-monthly")
    ops.advance(360)
    assert value(ops.scrape(), "events_polled_total") == value(start, "events_polled_total")

    book = ops.runbook("NoEventsPolled")
    book.run("health", expect=(0, 3))
    book.run("jobs list")
    book.run("poll --watchdog", expect=(0, 3))
    book.run("poll")
    book.followed()

    assert value(ops.scrape(), "events_polled_total") > value(start, "events_polled_total")


def test_runbook_EventPollerStale(ops):
    """The poll timer stopped ten minutes ago; the runbook runs the job and the newest run is fresh."""
    ops.cli("jobs", "run", "poll")
    ops.advance(600)
    assert ops.now() - value(ops.scrape(), "billing_event_poller_last_run_timestamp_seconds") > 300

    book = ops.runbook("EventPollerStale")
    assert "event_poller" in book.run("health", expect=3).stdout
    book.run("jobs list")
    book.run("jobs run poll")
    book.followed()

    assert ops.now() - value(ops.scrape(), "billing_event_poller_last_run_timestamp_seconds") <= 300


def test_runbook_JobNotRunning(ops):
    """The activations job fails on every run while the provider is down (its newest run failed); after
    the outage the runbook runs it and its newest run succeeded."""
    co = create_checkout(ops.c, "user_job", "credits-pro-USD-monthly")
    ops.sandbox.store.add_fault("provider", "503", path="update_for_items", count=-1)
    ops.sandbox.pay(co["order_id"])  # recorded; its activation waits for the provider
    ops.advance(120)
    ops.cli("jobs", "run", "activations", expect=5)
    fired = ops.scrape()
    assert (value(fired, "billing_job_last_failure_timestamp_seconds", job_name="activations")
            > value(fired, "billing_job_last_success_timestamp_seconds", job_name="activations"))
    ops.sandbox.store.clear_faults()
    ops.advance(120)

    book = ops.runbook("JobNotRunning")
    listed = table(book.run("jobs list").stdout)
    assert any(row.get("job") == "activations" or row.get("name") == "activations" for row in listed)
    book.run("jobs run NAME", NAME="activations")
    book.followed()

    after = ops.scrape()
    assert (value(after, "billing_job_last_success_timestamp_seconds", job_name="activations")
            > value(after, "billing_job_last_failure_timestamp_seconds", job_name="activations"))
    assert ops.sandbox.subscription(co["subscription_id"])["status"] == "active"


def test_runbook_ProviderRateLimited(ops):
    """The provider answers 429 to the poller; the runbook finds nothing looping, and the next poll is
    answered."""
    start = ops.scrape()
    ops.sandbox.store.add_fault("provider", "429", path="/events", count=1, retry_after=0)
    ops.cli("poll", expect=(0, 4))
    fired = ops.scrape()
    limited = "billing_provider_rate_limit_errors_total"
    assert value(fired, limited) > value(start, limited)

    book = ops.runbook("ProviderRateLimited")
    book.run("jobs list")
    book.run("health", expect=(0, 3))
    book.followed()

    ops.cli("poll")
    assert value(ops.scrape(), "billing_provider_rate_limit_errors_total") == \
        value(fired, "billing_provider_rate_limit_errors_total")


def test_runbook_SyncErrors(ops):
    """An operator's sync fails while the provider is down (counted); after the outage the runbook's
    sync-all and the named subscription's sync succeed and count nothing more."""
    co, _ = ops.paid("user_sync")
    ops.sandbox.store.add_fault("provider", "503", path="/subscriptions/", count=-1)
    failed = ops.cli("sync", co["subscription_id"], expect=4)
    assert co["subscription_id"] in failed.stderr or "provider" in failed.stderr
    fired = ops.scrape()
    assert value(fired, "billing_sync_errors_total") >= 1
    ops.sandbox.store.clear_faults()
    ops.advance(120)

    book = ops.runbook("SyncErrors")
    book.run("health", expect=(0, 3))
    book.run("sync-all --since 1d")
    book.run("sync SUB --dry-run", SUB=co["subscription_id"])
    book.followed()

    assert value(ops.scrape(), "billing_sync_errors_total") == value(fired, "billing_sync_errors_total")


def test_runbook_CircuitBreakerOpen(ops):
    """Every provider call fails: the breaker opens for every process (Redis). After the outage the
    runbook's probe read closes it."""
    co, _ = ops.paid("user_breaker")
    ops.sandbox.store.add_fault("provider", "503", count=-1)
    for _ in range(6):
        billingctl(["sync", co["subscription_id"], "--dry-run"], ops.env)
    assert value(ops.scrape(), "billing_circuit_breaker_state", dependency="subscription_provider") == 2
    ops.sandbox.store.clear_faults()
    ops.advance(120)  # past the breaker's cool-down: the next call is its probe

    internal = serve_internal_app(ops)
    try:
        book = ops.runbook("CircuitBreakerOpen")
        assert "open" in book.run("curl", **{"http://127.0.0.1:8001": internal.url}).stdout
        book.run("health", expect=(0, 3, 4))
        book.run("subscriptions show SUB --customer USER", SUB=co["subscription_id"], USER="user_breaker")
        book.run("sync SUB --dry-run", SUB=co["subscription_id"])
        book.followed()
    finally:
        internal.close()
    assert value(ops.scrape(), "billing_circuit_breaker_state", dependency="subscription_provider") == 0


class Served:
    """The internal app on a loopback port (werkzeug's server in a thread)."""

    def __init__(self, app):
        import threading

        from werkzeug.serving import make_server

        self.server = make_server("127.0.0.1", 0, app, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def serve_internal_app(ops) -> Served:
    import os

    from webhooks_app import create_internal_app

    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(ops.metrics_dir)
    try:
        return Served(create_internal_app(container=ops.c))
    finally:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)


def test_runbook_MetricsScrapeFailing(ops):
    """The internal app is down: the scrape fails. The runbook's checks see it refuse; once the service is
    started again they see the metrics served, and Prometheus's scrape succeeds."""
    import httpx

    from tests.servers import free_port

    port = free_port()
    book = ops.runbook("MetricsScrapeFailing")
    url = f"http://127.0.0.1:{port}"
    down = book.run("curl", expect=(0, 7), **{"http://127.0.0.1:8081": url})
    assert down.stdout.startswith("000")
    ops.cli("jobs", "run", "velocity-watch")  # a job wrote its metrics meanwhile
    internal = serve_internal_app(ops)  # `systemctl restart billing-internal`, on a loopback port
    try:
        up = book.run("curl", **{"http://127.0.0.1:8081": internal.url})
        assert up.stdout.startswith("200 text/plain")
        files = int(book.run("ls", **{"/run/billing-metrics": str(ops.metrics_dir)}).stdout.strip())
        assert 1 <= files <= 8
        book.followed()
        scraped = httpx.get(f"{internal.url}/metrics")
        assert scraped.status_code == 200 and "billing_job_runs_total" in scraped.text
    finally:
        internal.close()


def test_runbook_MetricsDependencyDown(ops, tmp_path):
    """Redis stops: the scrape says so (billing_dependency_up{dependency="redis"} 0) and still serves the
    rest. The runbook's health names it; once Redis is back the scrape reads it again."""
    from billingctl.bootstrap import Container as Built
    from tests.servers import RedisServer

    redis = RedisServer()
    url = redis.start()
    settings = ops.c.settings.model_copy(update={"redis_url": url})
    own = Built(settings)
    try:
        redis.stop()
        ops.env["BILLING_REDIS_URL"] = url
        assert value(scrape_of(own, ops), "billing_dependency_up", dependency="redis") == 0

        book = ops.runbook("MetricsDependencyDown")
        down = {row["check"]: row["status"] for row in table(book.run("health", expect=(3, 4)).stdout)}
        assert down["redis"] != "ok"
        redis.restart()  # `systemctl start redis-server`
        up = {row["check"]: row["status"] for row in table(book.run("health", expect=(0, 3)).stdout)}
        assert up["redis"] == "ok"
        book.followed()

        assert value(scrape_of(own, ops), "billing_dependency_up", dependency="redis") == 1
    finally:
        own.close()
        redis.stop()


def scrape_of(container, ops) -> dict:
    return scrape(container, ops.metrics_dir)


# ---- processor locks ------------------------------------------------------------------------------------

NSFW_PRO, NSFW_MAX = "credits-pro-nsfw-USD-monthly", "credits-max-nsfw-USD-monthly"


def _recorded_by_cli(ops, user: str, plan: str, processor: str) -> dict:
    """Settled on `processor` with its webhook lost, then recorded by `billingctl payments record`."""
    co, payment = ops.paid(user, plan, processor=processor, drop_webhook=True)
    ops.cli("payments", "record", payment["id"])
    return payment


def test_runbook_ProcessorLockAssignError(ops):
    """The lock table cannot be written while a payment is recorded: counted assign_error, the lane left
    unlocked. The runbook finds the user and repairs the lock from the payment history."""
    from tests.helpers import table_away

    start = ops.scrape()
    co, payment = ops.paid("user_unlocked", NSFW_PRO, processor="NSFW_SEGPAY", drop_webhook=True)
    with table_away(ops.c.engine, "user_credits"):
        ops.cli("payments", "record", payment["id"])
    fired = ops.scrape()
    assert value(fired, "billing_processor_lock_outcome_total", outcome="assign_error", lane="nsfw") > \
        value(start, "billing_processor_lock_outcome_total", outcome="assign_error", lane="nsfw")

    book = ops.runbook("ProcessorLockAssignError")
    assert "user_unlocked" in book.run("lock list --problem unlocked").stdout
    book.run("lock show USER", USER="user_unlocked")
    book.run("lock repair USER --lane nsfw", USER="user_unlocked")
    book.followed()

    assert "user_unlocked" not in ops.cli("lock", "list", "--problem", "unlocked").stdout
    assert ops.cli("--json", "lock", "show", "user_unlocked")["nsfw_processor"] == "NSFW_SEGPAY"
    _recorded_by_cli(ops, "user_unlocked", NSFW_MAX, "NSFW_SEGPAY")
    assert value(ops.scrape(), "billing_processor_lock_outcome_total", outcome="assign_error") == \
        value(fired, "billing_processor_lock_outcome_total", outcome="assign_error")


def test_runbook_ProcessorLockUnknownProcessor(ops):
    """A payment settles on a processor no lane lists: counted, nothing locked. The runbook adds it to the
    lanes (an environment change) and repairs the user's lock."""
    start = ops.scrape()
    _recorded_by_cli(ops, "user_mystery", NSFW_PRO, "NSFW_NEWPSP")
    fired = ops.scrape()
    assert value(fired, "billing_processor_lock_outcome_total", outcome="unknown_processor") > \
        value(start, "billing_processor_lock_outcome_total", outcome="unknown_processor")

    book = ops.runbook("ProcessorLockUnknownProcessor")
    assert "user_mystery" in book.run("lock list --problem unknown").stdout
    book.run("lock show USER", USER="user_mystery")
    lanes = {**ops.c.settings.processor_lanes, "NSFW_NEWPSP": "nsfw"}
    ops.env["BILLING_PROCESSOR_LANES"] = json.dumps(lanes)  # "add the processor to BILLING_PROCESSOR_LANES"
    book.run("lock repair USER --lane LANE", USER="user_mystery", LANE="nsfw")
    book.followed()

    assert ops.cli("--json", "lock", "show", "user_mystery")["nsfw_processor"] == "NSFW_NEWPSP"
    _recorded_by_cli(ops, "user_mystery", NSFW_MAX, "NSFW_NEWPSP")
    assert value(ops.scrape(), "billing_processor_lock_outcome_total", outcome="unknown_processor") == \
        value(fired, "billing_processor_lock_outcome_total", outcome="unknown_processor")


def test_runbook_ProcessorLockDriftNSFW(ops):
    """A user's NSFW lock names a processor they never paid on (a backfilled lock) while their payments
    settle on another: drift. The runbook clears the wrong lock and repairs it from the history."""
    from sqlalchemy import insert

    from billingctl.adapters.db.tables import user_credits, users

    now = ops.c.clock.now()
    with ops.c.uow() as uow:
        uow.execute(insert(users).values(id="user_drift", created_at=now))
        uow.execute(insert(user_credits).values(user_id="user_drift", nsfw_processor="NSFW_SEGPAY", created_at=now))
        uow.commit()
    start = ops.scrape()
    _recorded_by_cli(ops, "user_drift", NSFW_PRO, "NSFW_CCBILL")
    fired = ops.scrape()
    assert value(fired, "billing_processor_lock_drift_total", lane="nsfw") > \
        value(start, "billing_processor_lock_drift_total", lane="nsfw")

    book = ops.runbook("ProcessorLockDrift")
    assert "user_drift" in book.run("lock list --problem drift").stdout
    book.run("lock show USER", USER="user_drift")
    book.run("users show USER", USER="user_drift")
    book.run("lock clear USER --lane nsfw", USER="user_drift", R='"backfilled lock; cards live at CCBILL"')
    book.run("lock repair USER --lane nsfw", USER="user_drift")
    book.followed()

    assert ops.cli("--json", "lock", "show", "user_drift")["nsfw_processor"] == "NSFW_CCBILL"
    _recorded_by_cli(ops, "user_drift", NSFW_MAX, "NSFW_CCBILL")
    assert value(ops.scrape(), "billing_processor_lock_drift_total", lane="nsfw") == \
        value(fired, "billing_processor_lock_drift_total", lane="nsfw")


def test_runbook_ProcessorLockDriftSFW(ops):
    """Most SFW settles fall back to the other SFW processor (the primary is failing at the orchestrator):
    the ratio pages. The runbook shows the users; no lock is wrong, so none is cleared. Once the primary
    is healthy again, settles land on the locked processor and the ratio falls."""
    def ratio(before, after):
        drift = (value(after, "billing_processor_lock_drift_total", lane="sfw")
                 - value(before, "billing_processor_lock_drift_total", lane="sfw"))
        locked = (value(after, "billing_processor_lock_outcome_total", lane="sfw", outcome="already_locked")
                  - value(before, "billing_processor_lock_outcome_total", lane="sfw", outcome="already_locked"))
        return drift / max(locked, 1)

    start = ops.scrape()
    for user in ("user_fall_1", "user_fall_2"):
        _recorded_by_cli(ops, user, "credits-basic-USD-monthly", "SFW_STRIPE")
        _recorded_by_cli(ops, user, "credits-pro-USD-monthly", "SFW_ADYEN")
    fired = ops.scrape()
    assert ratio(start, fired) > 0.5

    book = ops.runbook("ProcessorLockDrift")
    listed = book.run("lock list --problem drift").stdout
    assert "user_fall_1" in listed and "user_fall_2" in listed
    book.run("lock show USER", USER="user_fall_1")
    book.run("users show USER", USER="user_fall_1")
    book.not_taken_here("lock clear USER --lane nsfw", "SFW: a fallback between processors is expected")
    book.not_taken_here("lock repair USER --lane nsfw", "SFW: the locks are right")
    book.followed()

    _recorded_by_cli(ops, "user_fall_3", "credits-basic-USD-monthly", "SFW_STRIPE")
    _recorded_by_cli(ops, "user_fall_3", "credits-pro-USD-monthly", "SFW_STRIPE")
    assert ratio(fired, ops.scrape()) <= 0.5


def test_runbook_ProcessorRepairUnavailable(ops):
    """A lock repair runs while the orchestrator is down: counted unavailable. After the outage the
    runbook's repair locks the user."""
    from tests.helpers import table_away

    co, payment = ops.paid("user_repair", NSFW_PRO, processor="NSFW_SEGPAY", drop_webhook=True)
    with table_away(ops.c.engine, "user_credits"):
        ops.cli("payments", "record", payment["id"])
    start = ops.scrape()
    ops.sandbox.store.add_fault("orchestrator", "503", count=-1)
    billingctl(["lock", "repair", "user_repair", "--lane", "nsfw"], ops.env)
    fired = ops.scrape()
    assert value(fired, "billing_processor_repair_outcome_total", outcome="unavailable") > \
        value(start, "billing_processor_repair_outcome_total", outcome="unavailable")
    ops.sandbox.store.clear_faults()
    ops.advance(120)

    book = ops.runbook("ProcessorRepairUnavailable")
    book.run("health", expect=(0, 3))
    assert "user_repair" in book.run("lock list --problem unlocked").stdout
    book.run("lock repair USER --lane LANE", USER="user_repair", LANE="nsfw")
    book.followed()

    assert ops.cli("--json", "lock", "show", "user_repair")["nsfw_processor"] == "NSFW_SEGPAY"
    assert value(ops.scrape(), "billing_processor_repair_outcome_total", outcome="unavailable") == \
        value(fired, "billing_processor_repair_outcome_total", outcome="unavailable")


def test_runbook_IllegalLifecycleTransition(ops):
    """The orchestrator reports DECLINED for a payment we hold captured: refused, counted, alerted. The
    runbook finds the alert, the notification and the payment; the orchestrator holds it settled, our books
    agree, and reading it again counts nothing more."""
    co, payment = ops.paid("user_contradicted")
    illegal = ("billing_lifecycle_illegal_transitions_total", {"lifecycle": "payment"})
    before = ops.c.metrics.sample(*illegal)
    ops.sandbox.send_webhook("PAYMENT.STATUS", {**payment, "status": "DECLINED"})  # signed, to the receiver
    assert ops.c.metrics.sample(*illegal) == before + 1  # the webhook app's counter, scraped from its worker
    start = ops.scrape()

    book = ops.runbook("IllegalLifecycleTransition")
    pending = book.run("alerts list --state pending").stdout
    assert f"illegal:payment:{payment['id']}:captured:declined" in pending
    assert f"PAYMENT.STATUS:{payment['id']}:DECLINED" in book.run("events list --state processed | grep ID",
                                                                    ID=payment["id"]).stdout
    assert "SETTLED" in book.run("payments record PAYMENT_ID --dry-run", PAYMENT_ID=payment["id"]).stdout
    book.run("orphans show PAYMENT_ID", PAYMENT_ID=payment["id"], expect=3)  # never held for review
    book.followed()

    ops.cli("trace", payment["id"])  # how you know: no disagreement across the books (exit 0)
    assert value(ops.scrape(), *illegal[:1], **illegal[1]) == value(start, *illegal[:1], **illegal[1])
    assert ops.c.metrics.sample(*illegal) == before + 1
    assert ops.cli("--json", "users", "show", "user_contradicted")["credits"] == 2000
