"""CLI start-up: `billingctl --help` against `python -c "import typer"`, and the command the poll timer
runs when it is not a loop, an idle one-shot `billingctl jobs run poll` on PostgreSQL with Redis (the
provider served on loopback, as production's is remote), against `python -c "import sqlalchemy, httpx,
psycopg"`; each pair of commands run in turn, the median of the pairs' own ratios with its spread, and
the peak memory of each. Also the run that finds the lease held (exit 75): it stops before the job's heavy
imports; and what limits the poll's figure, the libraries it loads imported alone (`job_libraries_alone`), and
imported alone as the CLI loads them, under its start-up's collector policy (`job_libraries_as_loaded`)."""

from __future__ import annotations

import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime

from bench.common import median, workdir

RUNS = int(os.environ.get("BENCH_STARTUP_RUNS", "15"))
# The libraries an idle one-shot poll on PostgreSQL with Redis loads (issue 39 item 5), nothing of ours.
JOB_LIBRARIES = ("sqlalchemy, httpx, psycopg, redis, pydantic_settings, typer, limits.storage, limits.strategies, "
                 "prometheus_client, tenacity, httpcore, sqlalchemy.dialects.postgresql.psycopg, "
                 "sqlalchemy.dialects.sqlite")
MAXRSS = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, "
          "stderr=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def _paired(ours: list[str], baseline: list[str], env: dict, ours_codes: tuple[int, ...] = (0,)) -> dict:
    """Ours and the baseline run in turn, RUNS pairs after two warm-up pairs (ours first in even pairs, the
    baseline in odd ones), so a machine that speeds up or slows down through the run favours neither. The
    ratio is the median of the pairs' own ratios, with their spread (quartiles, extremes); also the CPU
    (user + system) each took, which the machine's other load moves less than the wall time."""
    import resource

    def once(cmd, codes):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        returncode = _wait_for(cmd, env)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if returncode not in codes:
            raise RuntimeError(f"{shlex.join(cmd)} exited {returncode}")
        return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)

    walls: dict[str, list[float]] = {"ours": [], "baseline": []}
    cpus: dict[str, list[float]] = {"ours": [], "baseline": []}
    for number in range(RUNS + 2):
        order = (("ours", ours, ours_codes), ("baseline", baseline, (0,)))
        for name, cmd, codes in (order if number % 2 == 0 else order[::-1]):
            wall, cpu = once(cmd, codes)
            if number >= 2:  # the first two pairs warm the page cache and the servers
                walls[name].append(wall)
                cpus[name].append(cpu)
    ratios = sorted(o / b for o, b in zip(walls["ours"], walls["baseline"], strict=True))
    cpu_ratios = sorted(o / b for o, b in zip(cpus["ours"], cpus["baseline"], strict=True))

    def ms(values):
        return round(median(values) * 1000, 1)

    first, _, third = statistics.quantiles(ratios, n=4)
    return {"ours_ms": ms(walls["ours"]), "baseline_ms": ms(walls["baseline"]), "ratio": round(median(ratios), 2),
            "ratio_quartiles": [round(first, 2), round(third, 2)],
            "ratio_range": [round(ratios[0], 2), round(ratios[-1], 2)], "pairs": len(ratios),
            "cpu_ours_ms": ms(cpus["ours"]), "cpu_baseline_ms": ms(cpus["baseline"]),
            "cpu_ratio": round(median(cpu_ratios), 2)}


def _wait_for(cmd: list[str], env: dict, limit: float = 120) -> int:
    """Run a command to its end and return its exit code, the end seen when it happens. Not
    `subprocess.run(..., timeout=)`: with a timeout, CPython waits by polling, sleeping 1, 2, 4 … then 50 ms
    between looks, so every time over 63 ms read as the next 50 ms step (2026-12-06: the start-up's figures
    of every earlier run were 314.7, 364.8, 415.0, 515.5 ms …). A blocking wait, and a timer that kills a
    command past the limit."""
    import threading

    process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    watchdog = threading.Timer(limit, process.kill)
    watchdog.start()
    try:
        return process.wait()
    finally:
        watchdog.cancel()


def _peak_kib(cmd: list[str], env: dict) -> int:
    return int(subprocess.run([sys.executable, "-c", MAXRSS, *cmd], env=env, capture_output=True, text=True,
                              timeout=120).stdout.strip())


def run(database_url: str | None = None, redis_url: str | None = None) -> dict:
    from tests.servers import free_port

    wd = workdir()
    billingctl = shutil.which("billingctl") or os.path.join(os.path.dirname(sys.executable), "billingctl")
    port = free_port()
    base = {"PATH": os.environ["PATH"], "BILLING_SANDBOX_DB": str(wd / "sandbox.db")}
    # As in production the provider is remote: the sandbox is served on loopback, not imported.
    sandbox = subprocess.Popen([billingctl, "sandbox", "serve", "--port", str(port)], env=base,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.5)
    env = {**base, "BILLING_DATABASE_URL": database_url or f"sqlite:///{wd / 'startup.db'}",
           **({"BILLING_REDIS_URL": redis_url} if redis_url else {}),
           "BILLING_PROVIDER_URL": f"http://127.0.0.1:{port}/provider", "BILLING_PROVIDER_API_KEY": "k",
           "BILLING_ORCHESTRATOR_URL": f"http://127.0.0.1:{port}/orchestrator", "BILLING_ORCHESTRATOR_API_KEY": "k"}
    poll = [billingctl, "jobs", "run", "poll"]
    subprocess.run(poll, env=env, capture_output=True)  # migrate and catch up once
    heavy = [sys.executable, "-c", "import sqlalchemy, httpx, psycopg"]
    pairs = {
        "help": ([billingctl, "--help"], [sys.executable, "-c", "import typer"]),
        "idle_poll": (poll, heavy),
        # What limits the poll's figure: the libraries its run loads, imported and unused.
        "job_libraries_alone": ([sys.executable, "-c", f"import {JOB_LIBRARIES}"], heavy),
        # The same as the CLI loads them: under its start-up's collector policy (decision 262).
        "job_libraries_as_loaded": ([sys.executable, "-c", "from billingctl import startup; startup.begin(); "
                                     f"import {JOB_LIBRARIES}; startup.end()"], heavy),
    }
    result = {}
    try:
        for name, (ours, baseline) in pairs.items():
            result[name] = {**_paired(ours, baseline, env), "ours_peak_mib": round(_peak_kib(ours, env) / 1024, 1),
                            "baseline_peak_mib": round(_peak_kib(baseline, env) / 1024, 1), "target_ratio": 1.5}
        result["lease_held_poll"] = _lease_held(poll, heavy, env)
    finally:
        sandbox.terminate()
        sandbox.wait(10)
    result["shape"] = "PostgreSQL + Redis" if database_url and redis_url else "SQLite, no Redis"
    return result


def _lease_held(poll: list[str], baseline: list[str], env: dict) -> dict:
    """The poll while another host holds its lease (exit 75 before the job's imports)."""
    from sqlalchemy import update

    from billingctl.adapters.db.engine import make_engine
    from billingctl.adapters.db.tables import job_lease

    engine = make_engine(env["BILLING_DATABASE_URL"])
    with engine.begin() as conn:
        conn.execute(update(job_lease).where(job_lease.c.name == "poll").values(
            holder="elsewhere:1:bench", expires_at=datetime(2099, 1, 1, tzinfo=UTC)))
    try:
        assert subprocess.run(poll, env=env, capture_output=True).returncode == 75
        return _paired(poll, baseline, env, ours_codes=(75,))
    finally:
        with engine.begin() as conn:
            conn.execute(update(job_lease).where(job_lease.c.name == "poll").values(holder=None, expires_at=None))
        engine.dispose()
