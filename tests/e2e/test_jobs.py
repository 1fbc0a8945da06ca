"""Jobs: one table, leases across processes, crashed holders, generated crontab and systemd units."""

import json
import os
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from billingctl.adapters.db.tables import job_lease
from billingctl.domain.errors import LeaseHeld
from jobs import runner
from jobs.schedule import BY_NAME, JOBS
from jobs.units import render_crontab, render_units
from tests.helpers import billingctl, term_runs_out

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]






def test_the_table_covers_the_design(container):
    assert {"poll", "orphans", "renewals", "checkout-cleanup", "poller-watchdog", "velocity-watch",
            "reconcile"} <= set(BY_NAME)
    assert BY_NAME["poll"].interval_seconds == 15 and BY_NAME["renewals"].interval_seconds == 900
    for job in JOBS:
        assert callable(runner.resolve(job))


def test_a_second_runner_exits_75_and_an_expired_lease_is_taken_over(container):
    job = BY_NAME["poll"]
    assert runner.acquire(container, job, "host-a:1")
    with pytest.raises(LeaseHeld):
        runner.run_once(container, job)
    # host-a crashes: its lease expires and the next runner takes over.
    with container.uow() as uow:
        uow.execute(update(job_lease).where(job_lease.c.name == "poll").values(
            expires_at=container.clock.now() - timedelta(seconds=1)))
        uow.commit()
    result = runner.run_once(container, job)
    assert result["job"] == "poll"
    row = {r["job"]: r for r in runner.leases(container)}["poll"]
    assert row["holder"] is None and row["last_success_at"] is not None and row["last_error"] is None


def test_a_free_lease_is_taken_in_one_statement(container):
    """Issue 39 item 5: a job's usual run finds its row free and takes it with one conditional update; the
    row's creation (a job's first run ever) and the read of its holder (a held lease) come after."""
    from tests.helpers import RoundTrips

    job = BY_NAME["poll"]
    assert runner.acquire(container, job, "host-a:1:x")  # the first run ever creates the row
    runner.release(container, job, "host-a:1:x", None)
    counter = RoundTrips(container)
    try:
        with counter.measure() as seen:
            assert runner.acquire(container, job, "host-b:2:y")
        with counter.measure() as held:
            assert not runner.acquire(container, job, "host-c:3:z")
    finally:
        counter.close()
    leases = [s for s in seen["statements"] if "job_lease" in s]
    assert len(leases) == 1 and "UPDATE job_lease" in leases[0], seen["statements"]
    assert len([s for s in held["statements"] if "job_lease" in s]) == 3, held["statements"]  # take, create, read
    with container.uow() as uow:
        assert uow.leases.holder("poll").holder == "host-b:2:y"


def test_a_lease_held_by_a_process_of_this_host_that_is_gone_is_taken_at_once(container):
    """A holder on this host whose process no longer exists (killed, or its database went away before it
    released) is taken over now; one that is alive, or on another host, holds its lease until it expires."""
    import socket

    gone = subprocess.Popen(["true"])
    gone.wait()
    here = socket.gethostname()
    job = BY_NAME["poll"]
    for holder, taken in ((f"{here}:{os.getpid()}:alive", False), ("elsewhere:1:x", False),
                          (f"{here}:{gone.pid}:gone", True)):
        with container.uow() as uow:
            if not uow.leases.create("poll", holder, container.clock.now(), container.clock.now() + timedelta(hours=1)):
                uow.execute(update(job_lease).where(job_lease.c.name == "poll").values(
                    holder=holder, expires_at=container.clock.now() + timedelta(hours=1)))
            uow.commit()
        assert runner.acquire(container, job, "me:2:y") is taken, holder
    with container.uow() as uow:
        assert uow.leases.holder("poll").holder == "me:2:y"


def test_two_processes_racing_for_one_job(env, container):
    # Hold the lease from a third party, as a long run on another host would.
    assert runner.acquire(container, BY_NAME["reconcile"], "other-host:1")
    held = billingctl(["jobs", "run", "reconcile"], env)
    assert held.returncode == 75 and "running elsewhere" in held.stderr
    procs = [subprocess.Popen([sys.executable, "-m", "billingctl", "jobs", "run", "poll"], env={
        "PATH": os.environ["PATH"], **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)]
    codes = sorted(p.wait(120) for p in procs)
    assert codes in ([0, 0], [0, 75])  # never both at once; a fast first run may finish before the second starts
    listed = json.loads(billingctl(["--json", "jobs", "list"], env).stdout)
    poll = next(r for r in listed if r["job"] == "poll")
    assert poll["last_success_at"] and poll["command"] == "billingctl poll"


def test_loop_mode_runs_at_the_interval(env):
    result = billingctl(["--json", "jobs", "run", "velocity-watch", "--loop", "--interval", "0.2", "--max-runs", "2"],
                        env)
    assert result.returncode == 0 and result.stdout.count('"job": "velocity-watch"') == 2


def test_unknown_job_is_refused(env):
    result = billingctl(["jobs", "run", "nope"], env)
    assert result.returncode == 3 and "jobs list" in result.stderr


def test_committed_crontab_and_units_match_the_table():
    assert (ROOT / "crontab").read_text() == render_crontab()
    units = render_units()
    committed = {p.name: p.read_text() for p in (ROOT / "systemd").iterdir()}
    assert committed == units
    for job in JOBS:
        if job.interval_seconds <= 60:  # issue "Performance" 4: the frequent jobs are long-lived loops
            assert f"jobs run {job.name} --loop" in units[f"billing-job-{job.name}.service"]
            assert f"billing-job-{job.name}.timer" not in units
        else:
            assert f"billing-job-{job.name}.timer" in units and f"OnUnitActiveSec={job.interval_seconds}s" in \
                units[f"billing-job-{job.name}.timer"]
        assert f"jobs run {job.name}" in render_crontab()
    assert "NoNewPrivileges=yes" in units["billing-public.service"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_units_pass_systemd_analyze_verify(tmp_path):
    billingctl_path = shutil.which("billingctl") or str(Path(sys.executable).parent / "billingctl")
    for name, text in render_units(billingctl_path).items():
        (tmp_path / name).write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", *sorted(str(p) for p in tmp_path.iterdir())],
                            capture_output=True, text=True, timeout=120)
    problems = [line for line in result.stderr.splitlines() if "billing" in line and "User" not in line]
    assert result.returncode == 0 or not problems, result.stderr


def test_reconcile_finds_each_planted_violation(container, env):
    from sqlalchemy import insert

    from billingctl.adapters.db.tables import credit_ledger, subscription, users
    from billingctl.services.checkout import create_checkout

    co = create_checkout(container, "user_ok", "credits-pro-USD-monthly")
    container.sandbox.pay(co["order_id"])
    clean = billingctl(["--json", "reconcile"], env)
    assert clean.returncode == 0 and json.loads(clean.stdout)["ok"] is True
    missed = create_checkout(container, "user_m", "credits-basic-USD-monthly")
    lost = container.sandbox.pay(missed["order_id"], drop_webhook=True)  # settled, never recorded
    container.sandbox.store.put("payment", lost["id"], {**lost, "date": lost["date"] - 60})
    now = container.clock.now() - timedelta(minutes=1)
    with container.uow() as uow:
        uow.execute(insert(users).values(id="user_bad", created_at=now, credits=500))  # credits without ledger
        uow.execute(insert(credit_ledger).values(user_id="user_bad", amount=0, source_key="payment:pay_ghost",
                                                 reason="payment", payment_id="pay_ghost", created_at=now))
        uow.execute(insert(subscription).values(id="sub_ghost", status="active", customer_id="user_bad",
                                                created_at=now, coupon_ids=[]))
        uow.commit()
    report = billingctl(["--json", "reconcile"], env)
    checks = {v["check"] for v in json.loads(report.stdout)["violations"]}
    assert report.returncode == 5
    assert {"payment_unrecorded", "credits_differ_from_ledger", "ledger_without_purchase",
            "subscription_missing_at_provider"} <= checks


def test_reconcile_exits_5_naming_the_money_path_checks(container, env):
    """Issue "Money paths": the invariant checks seen through the command cron and on-call run."""
    from sqlalchemy import insert, update

    from billingctl.adapters.db.tables import fraud_event, purchase, users
    from billingctl.services.checkout import create_checkout

    co = create_checkout(container, "user_f", "credits-pro-USD-monthly")
    payment = container.sandbox.pay(co["order_id"])
    second = container.sandbox.pay(co["order_id"], drop_webhook=True)  # charged twice for one checkout
    for settled in (payment, second):  # older than the 15 s a fresh payment is given
        container.sandbox.store.put("payment", settled["id"], {**container.sandbox.store.get(
            "payment", settled["id"]), "date": settled["date"] - 60})
    now = container.clock.now()
    with container.uow() as uow:
        uow.execute(update(users).where(users.c.id == "user_f").values(frozen_at=now - timedelta(days=1),
                                                                       frozen_reason="fraud", frozen_ledger_id=0))
        uow.execute(update(purchase).where(purchase.c.transaction_id == payment["id"]).values(
            provider_recorded_at=None, created_at=now - timedelta(hours=2)))
        for i in range(6):
            uow.execute(insert(fraud_event).values(user_id="user_f", event_type="authorization_attempt",
                                                   created_at=now - timedelta(hours=i + 1),
                                                   metadata={"merchant_context": "full"}))
        uow.commit()
    report = billingctl(["--json", "reconcile"], env)
    assert report.returncode == 5
    checks = {v["check"] for v in json.loads(report.stdout)["violations"]}
    assert {"credits_after_freeze", "recorded_not_on_provider_invoice", "order_charged_twice"} <= checks
    assert "quota_over_limit" not in checks  # not enforced outside production (its own test plants it there)


def test_a_scheduled_job_logs_the_spec_info_markers(container, env):
    """Issue "Observability" 6: jobs logged at WARNING, so nsfw_renewal_card_substitution never appeared."""
    from billingctl.services.checkout import create_checkout

    co = create_checkout(container, "user_w", "credits-pro-nsfw-USD-monthly")
    container.sandbox.pay(co["order_id"], method="PAYPAL")
    container.sandbox.add_instrument("user_w", "PAYMENT_CARD")
    term_runs_out(container.sandbox, co["subscription_id"])
    quiet_env = {k: v for k, v in env.items() if k != "BILLING_LOG_LEVEL"}
    result = billingctl(["jobs", "run", "renewals"], quiet_env)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert "nsfw_renewal_card_substitution" in [line.get("message") for line in lines]
    plain = billingctl(["renewals", "list", "--user", "user_w"], quiet_env)  # an operator command stays quiet
    assert plain.stderr == ""


def test_a_job_runs_without_its_metrics_directory(env, tmp_path):
    """Issue "Observability" 5: jobs crashed (FileNotFoundError, exit 1) when /run/billing-metrics did
    not exist. The job creates it; one it cannot create costs the scrape, never the run."""
    missing = tmp_path / "run" / "billing-metrics"
    result = billingctl(["jobs", "run", "velocity-watch"], {**env, "PROMETHEUS_MULTIPROC_DIR": str(missing)})
    assert result.returncode == 0, result.stderr
    assert any(p.suffix == ".db" for p in missing.iterdir())  # its samples are there for the scrape
    blocked = tmp_path / "file"
    blocked.write_text("")
    result = billingctl(["jobs", "run", "velocity-watch"], {**env, "PROMETHEUS_MULTIPROC_DIR": str(blocked / "x")})
    assert result.returncode == 0, result.stderr
    assert "metrics directory unavailable" in result.stderr


def test_the_cron_line_runs_end_to_end_with_one_env_file_format(env, tmp_path, container):
    """Issue "Observability" 5: one env file read by systemd and by sh; a JSON value in single quotes
    reaches the job intact; unquoted, sh mangles it and the job refuses to start with exit 2."""
    import os
    import sys

    from sqlalchemy import select

    from billingctl.adapters.db.tables import job_lease
    from jobs.units import cron_command

    lanes = '{"SFW_STRIPE": "sfw", "SFW_ADYEN": "sfw", "NSFW_SEGPAY": "nsfw", "NSFW_CCBILL": "nsfw", ' \
            '"NSFW_NMI": "nsfw"}'
    env_file = tmp_path / "billing.env"
    env_file.write_text("".join(f"{k}='{v}'\n" for k, v in env.items()) + f"BILLING_PROCESSOR_LANES='{lanes}'\n")
    billingctl_bin = f"{sys.executable} -m billingctl"
    line = cron_command(BY_NAME["velocity-watch"], env_file=str(env_file), billingctl=billingctl_bin)
    line = line.replace("/run/billing-metrics", str(tmp_path / "metrics"))
    subprocess.run(["sh", "-c", line], env={"PATH": os.environ["PATH"]}, timeout=120, check=False)
    with container.uow() as uow:
        lease = uow.execute(select(job_lease).where(job_lease.c.name == "velocity-watch")).mappings().one()
    assert lease["last_success_at"] is not None and lease["last_error"] is None
    compact = lanes.replace(" ", "")  # without spaces sh sources it, but strips its quotes
    env_file.write_text("".join(f"{k}='{v}'\n" for k, v in env.items()) + f"BILLING_PROCESSOR_LANES={compact}\n")
    unquoted = subprocess.run(["sh", "-c", f"set -a && . {env_file} && {billingctl_bin} jobs run velocity-watch"],
                              env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, timeout=120)
    assert unquoted.returncode == 2 and "BILLING_PROCESSOR_LANES" in unquoted.stderr


def test_an_env_file_that_fails_to_source_is_logged_not_mailed(tmp_path):
    """Issue 38 item 5: `set -a && . env && cmd 2>&1 | logger` piped only the command's output: the shell's
    own error about an env file it could not source went to cron mail, which nobody reads. The whole line's
    output now reaches syslog (here a stand-in `logger` that keeps what it reads)."""
    import os
    import stat

    from jobs.units import cron_command

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    logged = tmp_path / "syslog"
    fake_logger = bin_dir / "logger"
    fake_logger.write_text(f"#!/bin/sh\ncat >> {logged}\n")
    fake_logger.chmod(fake_logger.stat().st_mode | stat.S_IEXEC)
    line = cron_command(BY_NAME["velocity-watch"], env_file=str(tmp_path / "missing.env"), billingctl="true")
    mail = subprocess.run(["sh", "-c", line], env={"PATH": f"{bin_dir}:{os.environ['PATH']}"},
                          capture_output=True, text=True, timeout=60)
    assert mail.stdout == "" and mail.stderr == ""  # cron mails what is left here: nothing
    assert "missing.env" in logged.read_text()


def test_jobs_yield_the_cpu_to_the_web_apps_under_systemd_and_cron(tmp_path):
    """Issue 39 item 3: on a shared host a catch-up took the CPU a webhook's answer waited on. Every job runs
    at a lower priority (its unit's Nice=, the cron line's `nice`); the web apps keep the default."""
    import os
    import stat

    from jobs.units import JOB_NICE, cron_command

    units = render_units()
    for job in JOBS:
        assert f"\nNice={JOB_NICE}\n" in units[f"billing-job-{job.name}.service"]
    assert "Nice=" not in units["billing-public.service"] and "Nice=" not in units["billing-internal.service"]
    bin_dir, seen = tmp_path / "bin", tmp_path / "niceness"
    bin_dir.mkdir()
    (bin_dir / "logger").write_text("#!/bin/sh\ncat > /dev/null\n")
    fake = bin_dir / "billingctl"
    fake.write_text(f"#!/bin/sh\nnice > {seen}\n")  # the niceness the job's command runs at
    for script in (bin_dir / "logger", fake):
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    env_file = tmp_path / "billing.env"
    env_file.write_text("BILLING_LOG_LEVEL=INFO\n")
    line = cron_command(BY_NAME["velocity-watch"], env_file=str(env_file), billingctl=str(fake))
    subprocess.run(["sh", "-c", line], env={"PATH": f"{bin_dir}:{os.environ['PATH']}"}, timeout=60, check=True)
    assert int(seen.read_text()) == min(19, os.nice(0) + JOB_NICE)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # on SQLite a missing table reads as an outage
def test_a_crashing_job_logs_one_json_record_with_its_traceback_and_its_name(env, container):
    """Issue 38 item 5: a job that crashed logged one plain-text line: no traceback, no job, not JSON. Its
    stderr (the journal's, syslog's) now carries a JSON record with the command, the job and the traceback,
    beside the one readable line."""
    from sqlalchemy import text

    with container.uow() as uow:  # a table the velocity watch reads, gone: a crash, not an expected refusal
        uow.execute(text("ALTER TABLE \"transaction\" RENAME TO transaction_away"))
        uow.commit()
    try:
        result = billingctl(["jobs", "run", "velocity-watch"], env)
    finally:
        with container.uow() as uow:
            uow.execute(text("ALTER TABLE transaction_away RENAME TO \"transaction\""))
            uow.commit()
    assert result.returncode != 0
    records = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    [crash] = [r for r in records if r["message"].startswith("command crashed")]
    assert crash["level"] == "error" and crash["job"] == "velocity-watch"
    assert crash["command"] == "jobs run" and "Traceback" in crash["exc"]


def test_state_gauges_report_the_live_state_not_the_max_over_exited_processes(container, env, tmp_path,
                                                                              monkeypatch):
    """Issue "Observability" 2: reconcile_violations (and the breaker state) were a max over the metric
    files of every process that ever ran, so an alert kept firing after the condition ended."""
    from prometheus_client.parser import text_string_to_metric_families
    from sqlalchemy import insert, update

    from billingctl.adapters.db.tables import users
    from webhooks_app import create_internal_app

    metrics_dir = tmp_path / "metrics"
    job_env = {**env, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    with container.uow() as uow:
        uow.execute(insert(users).values(id="user_v", created_at=container.clock.now(), credits=7))
        uow.commit()
    assert billingctl(["reconcile"], job_env).returncode == 5  # a process that saw one violation, then exited
    with container.uow() as uow:
        uow.execute(update(users).where(users.c.id == "user_v").values(credits=0))
        uow.commit()
    assert billingctl(["reconcile"], job_env).returncode == 0
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(metrics_dir))
    scrape = create_internal_app(container=container).test_client().get("/metrics")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(scrape.get_data(as_text=True)) for s in family.samples}
    assert samples[("billing_reconcile_violations", ())] == 0
    assert samples[("billing_circuit_breaker_state", (("dependency", "subscription_provider"),))] == 0
    assert sum(1 for name, _ in samples if name == "billing_reconcile_violations") == 1


def test_job_processes_fold_their_metric_files_so_the_directory_stays_small(env, tmp_path, monkeypatch, container):
    """Issue "Observability" 4: three files per job process (about 39,000 a day), scrape time growing."""
    from prometheus_client.parser import text_string_to_metric_families

    from webhooks_app import create_internal_app

    metrics_dir = tmp_path / "metrics"
    for _ in range(4):
        assert billingctl(["jobs", "run", "velocity-watch"], {**env, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
                          ).returncode == 0
    files = sorted(p.name for p in metrics_dir.glob("*.db"))
    assert all(name.endswith("_archive.db") for name in files) and len(files) <= 4, files
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(metrics_dir))
    scrape = create_internal_app(container=container).test_client().get("/metrics").get_data(as_text=True)
    runs = {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(scrape)
            for s in f.samples if s.name == "billing_job_runs_total"}
    assert runs[(("job", "velocity-watch"), ("outcome", "ok"))] == 4  # nothing lost in the folding


def _counter_file(directory, pid: int, value: float) -> None:
    """A process's counter file, as prometheus_client writes it (billing_job_runs_total)."""
    import json

    from prometheus_client.mmap_dict import MmapedDict

    key = json.dumps(("billing_job_runs", "billing_job_runs_total", {"job": "poll", "outcome": "ok"},
                      "Job runs by outcome."), sort_keys=True)
    file = MmapedDict(str(directory / f"counter_{pid}.db"))
    file.write_value(key, value, 0.0)
    file.close()


def _scraped_runs(directory) -> float:
    from billingctl.adapters.metrics import FoldedDirectory

    return sum(s.value for family in FoldedDirectory(str(directory)).collect() for s in family.samples
               if s.name == "billing_job_runs_total")


def test_a_fold_never_runs_during_a_scrape_and_a_half_written_file_never_fails_one(tmp_path, monkeypatch):
    """Issue 38 item 4: an exiting job added its counts to the archive before removing its own file, so a
    scrape in between counted it twice and the next saw the counter go back (a reset to Prometheus); a file
    a starting process had just created raised struct.error. The fold now waits for a scrape in progress,
    every scrape sees each count once, and an unwritten file is left out of that scrape."""
    import threading

    from billingctl.adapters.metrics import archive_process_metrics, folding_lock

    directory = tmp_path / "metrics"
    directory.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
    _counter_file(directory, 1001, 3)
    with folding_lock(str(directory), exclusive=False):  # a scrape reading the files
        fold = threading.Thread(target=archive_process_metrics, args=(1001,))
        fold.start()
        fold.join(0.3)
        assert fold.is_alive() and (directory / "counter_1001.db").exists()  # the fold waits
    fold.join(10)
    assert not (directory / "counter_1001.db").exists() and _scraped_runs(directory) == 3

    for pid in range(2000, 2150):  # processes exiting while scrapes run: each scrape sees the same total
        _counter_file(directory, pid, 1)
    seen, done = [], threading.Event()

    def scrape():
        while not done.is_set():
            seen.append(_scraped_runs(directory))

    scraper = threading.Thread(target=scrape)
    scraper.start()
    for pid in range(2000, 2150):
        archive_process_metrics(pid)
    done.set()
    scraper.join(10)
    assert seen and set(seen) == {153}, sorted(set(seen))
    (directory / "counter_3000.db").write_bytes(b"")  # created, not yet written
    assert _scraped_runs(directory) == 153


def test_a_job_that_cannot_use_the_metrics_directory_leaves_nothing_behind(tmp_path, env):
    """Issue 38 item 4: each such run left a billing-metrics-* directory in the temporary directory (about
    13,000 a day from the crontab)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    for _ in range(2):
        result = billingctl(["jobs", "run", "velocity-watch"],
                            {**env, "PROMETHEUS_MULTIPROC_DIR": "/proc/no-such-dir", "TMPDIR": str(scratch)})
        assert result.returncode == 0, result.stderr[-500:]
        assert "metrics directory unavailable" in result.stderr
    assert list(scratch.glob("billing-metrics-*")) == []


def test_a_run_that_finds_the_lease_held_stops_before_the_jobs_heavy_imports(container, env):
    """Issue "Performance at production shape" item 4: the lease is checked before the heavy imports, so
    an overlapping timer run costs little. Python's own import log shows what the exit-75 run loaded."""
    from datetime import UTC, datetime

    runner.acquire(container, BY_NAME["poll"], "elsewhere:1:x")
    with container.uow() as uow:
        uow.execute(update(job_lease).where(job_lease.c.name == "poll").values(
            holder="elsewhere:1:x", expires_at=datetime(2099, 1, 1, tzinfo=UTC)))
        uow.commit()
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "billingctl", "jobs", "run", "poll"],
                            capture_output=True, text=True, timeout=120, env={"PATH": os.environ["PATH"], **env})
    assert result.returncode == 75, result.stderr[-500:]
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    assert "sqlalchemy" in imported  # the lease is a database row
    heavy = {"httpx", "limits", "tenacity", "redis", "flask", "billingctl.services.events", "rich"}
    assert not heavy & imported, sorted(heavy & imported)


def _one_shot(env: dict, prelude: str = "", job: str = "poll", **more: str) -> subprocess.CompletedProcess:
    """A production-shape one-shot `jobs run JOB` (the provider unreachable: it fails its item, exit 5)
    with `prelude` run before the CLI's entry point."""
    production = {**env, "BILLING_PROVIDER_URL": "http://127.0.0.1:9", "BILLING_ORCHESTRATOR_URL": "http://127.0.0.1:9"}
    code = (f"{prelude}\nimport sys\nsys.argv = ['billingctl', 'jobs', 'run', {job!r}]\n"
            "from billingctl.cli import run\nrun()\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={"PATH": os.environ["PATH"], **production, **more})
    assert '"job finished"' in result.stderr, result.stderr[-500:]
    return result


def _modules_at_exit(env: dict, job: str = "poll", **more: str) -> set[str]:
    """The modules a one-shot job's process held at exit (`importlib.import_module` is not in `-X
    importtime`'s log)."""
    shown = "atexit.register(lambda: sys.stderr.write('MODULES ' + ' '.join(sorted(sys.modules)) + '\\n'))"
    result = _one_shot(env, f"import atexit, sys\n{shown}", job, **more)
    return set(result.stderr.rsplit("MODULES ", 1)[1].split())


def test_a_jobs_start_up_is_never_collected_before_its_freeze(env):
    """Decision 266: a one-shot job's start-up makes 105,000 to 141,000 objects before its first engine
    (the poll, on SQLite and on PostgreSQL with Redis); at the start-up threshold of decision 262 (100,000)
    the collector walked them all once, just before the engine froze them: about 25 ms of a one-shot poll.
    No collection runs between the CLI's `begin` and its first engine's `end`; the collector stays on."""
    result = _one_shot(env, (
        "import gc, sys\n"
        "from billingctl import startup\n"
        "seen, begin, end = [], startup.begin, startup.end\n"
        "def began():\n"
        "    begin()\n"
        "    gc.callbacks.append(lambda phase, info: phase == 'start' and seen.append(info['generation']))\n"
        "def ended():\n"
        "    sys.stderr.write(f'ENABLED {gc.isenabled()} COLLECTED {seen}\\n')\n"
        "    gc.callbacks.clear()\n"
        "    return end()\n"
        "startup.begin, startup.end = began, ended"))
    assert "ENABLED True COLLECTED []" in result.stderr, result.stderr[-500:]


def test_a_job_on_redis_loads_no_asyncio_client(env, redis_url):
    """Issue 39 item 5, decision 267: no `redis.asyncio` on a job's path. The limiter (through `limits`), the
    locks and the breakers reach Redis; the package `redis.asyncio` exists, its client, pool, cluster and
    sentinel are never loaded."""
    imported = _modules_at_exit(env, BILLING_REDIS_URL=redis_url)
    assert {"redis", "redis.client", "limits.storage.redis"} <= imported
    assert sorted(m for m in imported if m.startswith("redis.asyncio.") and ".observability" not in m) == []


@pytest.mark.parametrize(("operator_says", "scanned"), [(None, False), ("", True)])
def test_a_command_looks_for_no_pydantic_plugin_unless_the_operator_asks(env, operator_says, scanned):
    """Decision 266: looking for pydantic's plugins reads every installed distribution's entry points before
    the first model is built. The CLI does not look unless PYDANTIC_DISABLE_PLUGINS is set (empty: all)."""
    result = _one_shot(env, (
        "import importlib.metadata, sys\n"
        "real = importlib.metadata.entry_points\n"
        "def asked(**kw):\n"
        "    sys.stderr.write(f\"ENTRY POINTS {kw.get('group')}\\n\")\n"
        "    return real(**kw)\n"
        "importlib.metadata.entry_points = asked"),
        **({} if operator_says is None else {"PYDANTIC_DISABLE_PLUGINS": operator_says}))
    assert ("ENTRY POINTS pydantic" in result.stderr) is scanned


@pytest.mark.parametrize("job", ["checkout-cleanup", "poll"])
def test_a_production_job_never_imports_the_sandbox_or_flask(env, job):
    """Issue 39 item 5: every production job start imported Flask through the sandbox (the container
    imported the sandbox's app factories before knowing the real provider and orchestrator were set). With
    their URLs set, a job's run holds no Flask, Werkzeug, Jinja or sandbox simulator. Nor SQLAlchemy's ORM
    (about 34 ms of a one-shot poll's start): the tables are Core, and one alias in the dunning repository
    had imported the whole ORM. Nor another command's module: `jobs run` loaded all twenty of the CLI's.
    The modules are read at exit."""
    imported = _modules_at_exit(env, job)  # it ran (the unreachable provider fails its item: exit 5)
    assert "sqlalchemy" in imported and "httpx" in imported and "billingctl.cli.jobs" in imported
    assert not {m for m in imported if m.split(".")[0] in ("flask", "werkzeug", "jinja2")
                or m in {f"billingctl.sandbox.{part}" for part in (
                    "apps", "model", "store", "base", "provider", "orchestrator")}}
    assert not {m for m in imported if m == "sqlalchemy.orm" or m.startswith("sqlalchemy.orm.")}
    shared = {"__init__", "main", "context", "output", "exitcodes", "jobs"}  # the CLI's frame and this noun
    others = {f"billingctl.cli.{path.stem}" for path in (ROOT / "billingctl" / "cli").glob("*.py")
              if path.stem not in shared}
    assert not others & imported, sorted(others & imported)
    if job == "poll":  # a run with no event to handle loads no handler, nor any payment service
        assert not {m for m in imported if m == "billingctl.services.provider_events"
                    or m.startswith("billingctl.services.payments")}


def test_the_web_units_start_gunicorn_without_a_control_socket(tmp_path):
    """Issue 37 item 5: gunicorn 25+ opens a control socket by default, at one path for both services
    ($HOME/.gunicorn/gunicorn.ctl): the second took it from the first. The units turn it off, and the
    version range in pyproject.toml is one where the flag exists."""
    import os
    import shlex
    import subprocess
    import sys

    from tests.servers import free_port, serving

    units = render_units()
    for app in ("public", "internal"):
        start = next(line for line in units[f"billing-{app}.service"].splitlines() if line.startswith("ExecStart="))
        args = shlex.split(start.removeprefix("ExecStart="))
        assert "--no-control-socket" in args
    args[0] = os.path.join(os.path.dirname(sys.executable), "gunicorn")
    port = free_port()
    args[args.index("--bind") + 1] = f"127.0.0.1:{port}"
    args[args.index("--workers") + 1] = "1"
    log = tmp_path / "gunicorn.log"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "BILLING_SANDBOX_DB": str(tmp_path / "s.db"),
           "BILLING_DATABASE_URL": f"sqlite:///{tmp_path / 'b.db'}"}
    with open(log, "wb") as out:
        server = subprocess.Popen(args, env=env, cwd=ROOT, stdout=out, stderr=out)
        try:
            serving(f"http://127.0.0.1:{port}/metrics", attempts=100)
        finally:
            server.terminate()
            server.wait(30)
    text = log.read_text()
    assert "Listening at" in text and "Control socket" not in text and "[ERROR]" not in text, text
    assert not (tmp_path / ".gunicorn").exists()


@pytest.mark.parametrize("columns", [80, 120])
def test_reconcile_shows_every_id_whole_in_a_terminal(container, env, columns):
    """Issues 36 item 3 and 38 item 9: the human report names every id of each violation (invoice, payments,
    user), and on a terminal of 80 or 120 columns no id is split across lines or cut; lines fit the width."""
    import re

    from sqlalchemy import insert, select

    from billingctl.adapters.db.tables import purchase
    from billingctl.services.checkout import create_checkout
    from tests.helpers import billingctl_in_terminal

    co = create_checkout(container, "user_double_charged_at_3am", "credits-pro-USD-monthly")
    container.sandbox.pay(co["order_id"])
    now = container.clock.now()
    with container.uow() as uow:
        invoice_id = uow.execute(select(purchase.c.invoice_id)).scalar_one()
        uow.execute(insert(purchase).values(invoice_id=invoice_id, transaction_id="pay_second_charge_e5355d", amount=1,
                                            subscription_id=co["subscription_id"], credits=10, created_at=now,
                                            user_id="user_double_charged_at_3am", provider_recorded_at=now))
        assert uow.ledger.apply("user_double_charged_at_3am", 10, "payment:pay_second_charge_e5355d", "payment",
                                "pay_second_charge_e5355d", now)
        uow.commit()
    report = json.loads(billingctl(["--json", "reconcile"], env).stdout)
    [twice] = [v for v in report["violations"] if v["check"] == "invoice_paid_twice"]
    screen = billingctl_in_terminal(["reconcile"], env, columns)
    words = set(re.split(r"[\s│┃=,]+", screen))
    for id_ in [twice["invoice_id"], *twice["payment_ids"], twice["user_id"]]:
        assert id_ in words, (id_, screen)
    assert max(len(line) for line in screen.splitlines()) <= columns


@pytest.mark.parametrize("columns", [80, 120])
def test_users_show_lays_out_nested_values_and_shows_what_was_refunded(container, env, columns):
    """Issue 38 item 10: nested values printed as one long `k=v` line, and a refunded payment read as
    credited. The payments are a table under their key, ids whole, each with where it stands."""
    from billingctl.services.checkout import create_checkout
    from tests.helpers import billingctl_in_terminal

    co = create_checkout(container, "user_refunded_at_their_request", "credits-pro-USD-monthly")
    payment = container.sandbox.pay(co["order_id"])
    container.sandbox.refund(payment["id"])
    shown = json.loads(billingctl(["--json", "users", "show", "user_refunded_at_their_request"], env).stdout)
    [bought] = shown["recent_payments"]
    assert (bought["status"], bought["refund_credits"]) == ("refunded", bought["credits"])
    screen = billingctl_in_terminal(["users", "show", "user_refunded_at_their_request"], env, columns)
    assert "recent_payments:" in screen and "transaction_id=" not in screen
    assert payment["id"] in screen.split() or f"│ {payment['id']}" in screen or f"{payment['id']} " in screen
    assert "refunded" in screen
    assert max(len(line) for line in screen.splitlines()) <= columns
