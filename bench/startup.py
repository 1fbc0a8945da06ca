"""CLI start-up: `billingctl --help` against `python -c "import typer"`, and an idle one-shot
`billingctl poll` against `python -c "import sqlalchemy, httpx, psycopg"`; medians of repeated runs
(hyperfine when installed) and the peak memory of each."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time

from bench.common import median, workdir

RUNS = int(os.environ.get("BENCH_STARTUP_RUNS", "15"))
MAXRSS = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, "
          "stderr=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def _median_seconds(cmd: list[str], env: dict) -> float:
    if shutil.which("hyperfine"):
        out = workdir() / "h.json"
        subprocess.run(["hyperfine", "--warmup", "2", "--runs", str(RUNS), "--export-json", str(out), "-N",
                        shlex.join(cmd)], env=env, capture_output=True, check=True, timeout=600)
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


def run() -> dict:
    from tests.servers import free_port

    wd = workdir()
    billingctl = shutil.which("billingctl") or os.path.join(os.path.dirname(sys.executable), "billingctl")
    port = free_port()
    base = {"PATH": os.environ["PATH"], "BILLING_SANDBOX_DB": str(wd / "sandbox.db")}
    # As in production the provider is remote: the sandbox is served on loopback, not imported.
    sandbox = subprocess.Popen([billingctl, "sandbox", "serve", "--port", str(port)], env=base,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.5)
    env = {**base, "BILLING_DATABASE_URL": f"sqlite:///{wd / 'startup.db'}",
           "BILLING_PROVIDER_URL": f"http://127.0.0.1:{port}/provider", "BILLING_PROVIDER_API_KEY": "k",
           "BILLING_ORCHESTRATOR_URL": f"http://127.0.0.1:{port}/orchestrator", "BILLING_ORCHESTRATOR_API_KEY": "k"}
    subprocess.run([billingctl, "poll"], env=env, capture_output=True)  # migrate and catch up once
    pairs = {
        "help": ([billingctl, "--help"], [sys.executable, "-c", "import typer"]),
        "idle_poll": ([billingctl, "poll"], [sys.executable, "-c", "import sqlalchemy, httpx, psycopg"]),
    }
    result = {}
    try:
        for name, (ours, baseline) in pairs.items():
            ours_s, base_s = _median_seconds(ours, env), _median_seconds(baseline, env)
            result[name] = {"ours_ms": round(ours_s * 1000, 1), "baseline_ms": round(base_s * 1000, 1),
                            "ratio": round(ours_s / base_s, 2), "ours_peak_mib": round(_peak_kib(ours, env) / 1024, 1),
                            "baseline_peak_mib": round(_peak_kib(baseline, env) / 1024, 1), "target_ratio": 1.5}
    finally:
        sandbox.terminate()
        sandbox.wait(10)
    return result
