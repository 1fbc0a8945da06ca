"""A month of traffic as production runs it (issue "A month of traffic"): the same seeded model of
customers and of the outside world as `test_month.py`, but the public app is served by gunicorn (the
sandbox delivers its signed webhooks over HTTP) and every job runs as `billingctl jobs run NAME` in its own
process, the jobs of a tick started together as cron starts them. Every process reads the sandbox's
controllable clock (BILLING_CLOCK=sandbox), so all live on the same simulated day. Faults of the
infrastructure on top of the model's: Redis stopped for a day, PostgreSQL restarted in the middle of a
tick, a job process killed in the middle of its run; and every process's clock is 7 s ahead of the
sandbox's (SIM_CLOCK_SKEW). The end of each day runs the jobs in this process (the
quiet hours), then the same books are checked as in `test_month.py`.

Each job's process is forked from the suite's CLI zygote, which has imported the libraries (decision 167):
its own process, connections, environment and exit status, without the cold start's imports.
BILLING_TEST_CLI=fresh starts each cold, as `make simulate` does.

SIM_PROCESS_DAYS and SIM_SEEDS make it larger (`make simulate`)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from billingctl.adapters.db.engine import make_engine
from billingctl.adapters.db.migrate import upgrade
from billingctl.bootstrap import Container
from tests.conftest import create_database
from tests.helpers import billingctl_started
from tests.servers import PostgresServer, RedisServer, _pg_bin, free_port, serving
from tests.simulation.test_month import SEEDS, Model

pytestmark = pytest.mark.simulation

DAYS = int(os.environ.get("SIM_PROCESS_DAYS", 33))  # past the first renewals
TICK = 12 * 3600  # twice a simulated day every job runs, in its own process
ROOT = Path(__file__).resolve().parents[2]
JOBS = ("poll", "orphans", "activations", "renewals", "checkout-cleanup", "alerts-deliver")
REDIS_DOWN_DAY, JOB_KILLED_DAY, PG_RESTART_DAY = 2, 3, 4
# Our hosts' clock 7 s ahead of the provider's and the orchestrator's (issue 35: the simulations run with
# skewed clocks; the in-process month also runs 90 s behind).
SKEW = float(os.environ.get("SIM_CLOCK_SKEW", 7))


class ProcessModel(Model):
    """The model's customers and outside world; the system in processes of its own."""

    env: dict
    servers: dict

    def advance(self, seconds: int) -> None:
        self.sandbox.store.advance_clock(seconds)  # every process reads this clock
        self.sandbox.redeliver_due()

    def _spawn(self, name: str):
        return billingctl_started(["jobs", "run", name], self.env, ROOT)

    def jobs(self, quiet: bool = False) -> None:
        if quiet:  # the end of the day's quiet hours: the same jobs, in this process (each must succeed)
            super().jobs(quiet=True)
            return
        processes = {name: self._spawn(name) for name in JOBS}  # cron starts them in the same minute
        if getattr(self, "restart_postgres_now", False):
            self.restart_postgres_now = False
            time.sleep(0.3)
            self.servers["pg"]._run([_pg_bin("pg_ctl"), "-D", str(self.servers["pg"].data), "-m", "fast", "-w",
                                     "restart"])
            self.note("postgres restarted under running jobs")
        for name, process in processes.items():
            _, err = process.communicate(timeout=300)
            if process.returncode not in (0, 4, 5, 75):  # 4/5: visible and resumed by the next run
                raise AssertionError(f"{name} exited {process.returncode}: {err[-800:]}")
            if process.returncode:
                self.note(f"job {name}: exit {process.returncode}")

    def operator_cancel(self, subscription_id: str) -> str:
        """`billingctl subscriptions cancel` as an operator types it, in a process of its own."""
        done = subprocess.run([sys.executable, "-m", "billingctl", "subscriptions", "cancel", subscription_id,
                               "--reason", "simulated customer request", "--yes"], env=self.env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        if done.returncode not in (0, 4):  # 4: the provider failed; the operator sees it and tries again later
            raise AssertionError(f"subscriptions cancel exited {done.returncode}: {done.stderr[-800:]}")
        return "cancelled" if done.returncode == 0 else f"failed: {done.stderr.strip()[-200:]}"

    def kill_a_job_mid_run(self) -> None:
        self.sandbox.store.add_fault("provider", "slow", path="/events", count=1, delay=5)
        process = self._spawn("poll")
        time.sleep(1.5)  # it holds its lease and waits on the provider
        process.send_signal(signal.SIGKILL)
        process.wait(30)
        self.sandbox.store.clear_faults()
        self.note("poll killed mid-run (its lease left behind)")

    def one_day(self, day: int) -> None:  # the model's day, with the infrastructure's faults
        if day == REDIS_DOWN_DAY:
            self.servers["redis"].stop()
            self.note("redis stopped")
        if day == JOB_KILLED_DAY:
            self.kill_a_job_mid_run()
        if day == PG_RESTART_DAY:
            self.restart_postgres_now = True
        self.day()
        if day == REDIS_DOWN_DAY:
            self.servers["redis"].restart()
            self.note("redis back")


def _gunicorn(env: dict, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    binary = shutil.which("gunicorn") or os.path.join(os.path.dirname(sys.executable), "gunicorn")
    process = subprocess.Popen([binary, "--bind", f"127.0.0.1:{port}", "--workers", "2", "--log-level", "warning",
                                "--no-control-socket", "webhooks_app.wsgi:public()"], env=env, cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=open(log, "wb"))  # noqa: SIM115 - the log outlives this function
    url = f"http://127.0.0.1:{port}"
    if serving(f"{url}/robots.txt"):
        return process, url
    raise AssertionError("gunicorn did not start")


@pytest.mark.parametrize("seed", SEEDS)
def test_a_month_in_separate_processes_keeps_the_books(make_settings, tmp_path, seed):
    pg, redis = PostgresServer(), RedisServer()
    pg.start()
    redis_url = redis.start()
    app = None
    c = None
    try:
        url = create_database(f"postgresql+psycopg://postgres@127.0.0.1:{pg.port}/postgres", "billing_sim")
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        sandbox_db = str(tmp_path / "sandbox.db")
        env = {"PATH": os.environ["PATH"], "BILLING_DATABASE_URL": url, "BILLING_SANDBOX_DB": sandbox_db,
               "BILLING_REDIS_URL": redis_url, "BILLING_CLOCK": "sandbox", "BILLING_HTTP_MAX_ATTEMPTS": "2",
               "BILLING_HTTP_BACKOFF_MAX_SECONDS": "0", "BILLING_PROVIDER_RATE_LIMIT": "1000000",
               "BILLING_CHECKOUT_STARTS_PER_USER_PER_MINUTE": "1000",
               "BILLING_LOG_LEVEL": "WARNING", "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics"),
               "BILLING_CLOCK_SKEW_SECONDS": str(SKEW)}
        (tmp_path / "metrics").mkdir()
        app, app_url = _gunicorn(env, tmp_path / "gunicorn.log")
        env["BILLING_SANDBOX_WEBHOOK_URL"] = app_url
        c = Container(make_settings(database_url=url, sandbox_db=sandbox_db, redis_url=redis_url, clock="sandbox",
                                    clock_skew_seconds=SKEW, sandbox_webhook_url=app_url, http_max_attempts=2,
                                    provider_rate_limit=1_000_000))
        c.provider.http.sleep = c.orchestrator.http.sleep = lambda s: None
        model = ProcessModel(random.Random(seed), c, tick=TICK)
        model.env, model.servers = env, {"pg": pg, "redis": redis}
        model.live(DAYS, seed, label=" (processes)")
    finally:
        if c is not None:
            c.close()
        if app is not None:
            app.terminate()
            app.wait(30)
        redis.stop()
        pg.stop()
