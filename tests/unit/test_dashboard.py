"""The committed Grafana dashboard: valid JSON, every expression parses (promtool reads them as
recording rules), lane series are always read per lane (spec 6), every spec metric has a panel."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "prometheus" / "grafana-dashboard.json"
SPEC_METRICS = ("payment_recording_latency_seconds", "events_polled_total", "billing_provider_rate_limit_errors_total",
                "billing_processor_lock_outcome_total", "billing_processor_repair_outcome_total",
                "billing_processor_lock_drift_total")


def expressions() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in board["panels"] for t in p["targets"]]


def test_every_spec_metric_has_a_panel_and_lanes_are_never_summed():
    exprs = expressions()
    for metric in SPEC_METRICS:
        assert any(metric in e for e in exprs), metric
    for e in exprs:
        for selector in re.findall(r"billing_processor_\w+(\{[^}]*\})?", e):
            assert 'lane="' in selector, f"a lane metric read across lanes: {e}"
    joined = " ".join(exprs)
    for extra in ("billing_circuit_breaker_state", "billing_event_poller_last_run_timestamp_seconds",
                  "billing_outbox_pending", "billing_job_last_success_timestamp_seconds"):
        assert extra in joined


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is installed by make servers")
def test_every_expression_parses(tmp_path):
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr_{i}", "expr": e.replace("$__rate_interval", "5m")}
        for i, e in enumerate(expressions())]}]}
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
