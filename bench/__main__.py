"""`make bench`: run every benchmark, print the figures, write bench/results/latest.json."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from bench import budget, recording, startup, webhook
from bench.common import postgres


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    pg = subprocess.run(["psql", "--version"], capture_output=True, text=True).stdout.strip()
    return {"python": platform.python_version(), "platform": platform.platform(), "cpu": cpu,
            "cores": __import__("os").cpu_count(), "postgresql": pg}


def main() -> None:
    started = time.monotonic()
    results = {"when": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine()}
    print("provider-call budget …", file=sys.stderr)
    results["provider_call_budget"] = budget.run()
    print("CLI start-up …", file=sys.stderr)
    results["cli_startup"] = startup.run()
    with postgres() as url:
        print("recording under a duplicate storm …", file=sys.stderr)
        results["recording"] = recording.run(url)
        print("webhook HTTP …", file=sys.stderr)
        results["webhook_http"] = webhook.run(url)
    results["seconds"] = round(time.monotonic() - started, 1)
    out = Path(__file__).parent / "results" / "latest.json"
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(json.dumps(results, indent=2, default=str))
    print(f"written to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
