"""CLI start-up: `billingctl --help` against `python -c "import typer"`, and the command the poll timer
runs when it is not a loop, an idle one-shot `billingctl jobs run poll` on PostgreSQL with Redis (the
provider served on loopback, as production's is remote), against `python -c "import sqlalchemy, httpx,
psycopg"`; medians of repeated runs (hyperfine when installed) and the peak memory of each. Also the
run that finds the lease held (exit 75): it stops before the job's heavy imports."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime

from bench.common import median, workdir

RUNS = int(os.environ.get("BENCH_STARTUP_RUNS", "15"))
MAXRSS = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, "
          "stderr=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def _median_seconds(cmd: list[str], env: dict, ok_codes: tuple[int, ...] = (0,)) -> float:
    if shutil.which("hyperfine"):
        out = workdir() / "h.json"
        ignore = ["--ignore-failure"] if ok_codes != (0,) else []
        subprocess.run(["hyperfine", "--warmup", "2", "--runs", str(RUNS), "--export-json", str(out), "-N",
                        *ignore, shlex.join(cmd)], env=env, capture_output=True, check=True, timeout=600)
        return json.loads(out.read_text())["results"][0]["median"]
    samples = []
    for _ in range(RUNS):
        started = time.perf_counter()
        subprocess.run(cmd, env=env, capture_output=True)
        samples.append(time.perf_counter() - started)
    return median(samples)


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
    }
    result = {}
    try:
        for name, (ours, baseline) in pairs.items():
            ours_s, base_s = _median_seconds(ours, env), _median_seconds(baseline, env)
            result[name] = {"ours_ms": round(ours_s * 1000, 1), "baseline_ms": round(base_s * 1000, 1),
                            "ratio": round(ours_s / base_s, 2), "ours_peak_mib": round(_peak_kib(ours, env) / 1024, 1),
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
        ours_s, base_s = _median_seconds(poll, env, ok_codes=(75,)), _median_seconds(baseline, env)
        return {"ours_ms": round(ours_s * 1000, 1), "baseline_ms": round(base_s * 1000, 1),
                "ratio": round(ours_s / base_s, 2)}
    finally:
        with engine.begin() as conn:
            conn.execute(update(job_lease).where(job_lease.c.name == "poll").values(holder=None, expires_at=None))
        engine.dispose()
