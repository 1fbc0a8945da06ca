"""Webhook HTTP: the signed payments webhook on its fast path (a duplicate) under gunicorn with 2
workers, loaded by wrk with 4 connections for a bounded time, against a Flask hello world under the same
gunicorn settings in the same run."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import httpx

from bench.common import container, seed_payments, workdir
from billingctl.sandbox.model import sign_body
from tests.servers import free_port

DURATION = int(os.environ.get("BENCH_WRK_SECONDS", "10"))


def _gunicorn(app: str, env: dict, cwd) -> tuple[subprocess.Popen, int]:
    port = free_port()
    binary = shutil.which("gunicorn") or os.path.join(os.path.dirname(sys.executable), "gunicorn")
    proc = subprocess.Popen([binary, "--bind", f"127.0.0.1:{port}", "--workers", "2", "--log-level", "warning",
                             app], env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=0.5)
            break
        except httpx.TransportError:
            time.sleep(0.05)
    return proc, port


def _wrk(port: int, script: str) -> dict:
    out = subprocess.run(["wrk", "-t", "2", "-c", "4", "-d", f"{DURATION}s", "--latency", "-s", script,
                          f"http://127.0.0.1:{port}/webhooks/orchestrator/payments"],
                         capture_output=True, text=True, timeout=DURATION + 60).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))

    def pct(label):
        m = re.search(rf"\s{label}%\s+([\d.]+)(us|ms|s)", out)
        value, unit = float(m.group(1)), m.group(2)
        return round(value / 1000 if unit == "us" else value * 1000 if unit == "s" else value, 2)

    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"requests_per_s": rps, "p50_ms": pct("50"), "p99_ms": pct("99"),
            "non_2xx": int(non2xx.group(1)) if non2xx else 0}


def run(database_url: str) -> dict:
    if not shutil.which("wrk"):
        return {"skipped": "wrk is not installed (Debian package wrk)"}
    wd = workdir()
    c = container(database_url, wd)
    payment = seed_payments(c, 1, prefix="wh")[0]
    body = json.dumps({"eventType": "PAYMENT.STATUS", "signedAt": str(int(time.time())), "payment": payment})
    signature = sign_body(c.settings.secret("orchestrator_webhook_secret"), body.encode())
    from billingctl.services.webhook_events import dispatch

    dispatch(c, "orchestrator", "PAYMENT.STATUS", {"payment": payment})  # recorded: every request is a duplicate
    c.close()
    script = wd / "post.lua"
    script.write_text('wrk.method = "POST"\nwrk.body = ' + json.dumps(body) + "\n"
                      'wrk.headers["Content-Type"] = "application/json"\n'
                      f'wrk.headers["X-Signature-Primary"] = "{signature}"\n')
    env = {"PATH": os.environ["PATH"], "BILLING_DATABASE_URL": database_url,
           "BILLING_SANDBOX_DB": str(wd / "sandbox.db"),
           "BILLING_LOG_LEVEL": "WARNING", "PYTHONPATH": os.getcwd()}
    results = {}
    for name, app in (("webhook", "webhooks_app.wsgi:public()"), ("hello_world", "bench.hello:app")):
        proc, port = _gunicorn(app, env, os.getcwd())
        try:
            results[name] = _wrk(port, str(script))
        finally:
            proc.terminate()
            proc.wait(30)
    results["ratio"] = round(results["webhook"]["requests_per_s"] / results["hello_world"]["requests_per_s"], 2)
    results["seconds_each"] = DURATION
    return results
