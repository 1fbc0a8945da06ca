"""Runbooks as tests (issue 38 item 8): a runbook's commands are read from its fenced `sh` blocks and run as
an on-call engineer runs them, each line through bash with `billingctl` on the PATH, its placeholders (ID,
PAYMENT_ID, USER, SUB, ...) filled with what an earlier command of the same runbook printed. A test ends by
checking that every command of the runbook was run, or is named as the alternative not taken (or as a host
command: the service manager and its journal are not on a test machine), so a runbook that gains a command
its test does not follow fails."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

RUNBOOKS = Path(__file__).resolve().parents[2] / "docs" / "runbooks"
ALERTS = Path(__file__).resolve().parents[2] / "prometheus" / "alerts.yml"
HOST_TOOLS = ("systemctl", "journalctl")  # the host's service manager and journal: not on a test machine


def runbook_commands(name: str) -> list[str]:
    """Each command line of the runbook's fenced `sh` blocks, in order (comment-only lines left out)."""
    text = (RUNBOOKS / f"{name}.md").read_text()
    return [line.strip() for block in re.findall(r"```sh\n(.*?)```", text, re.S) for line in block.splitlines()
            if line.strip() and not line.strip().startswith("#")]


@dataclass
class Runbook:
    name: str
    env: dict
    ran: dict = field(default_factory=dict)
    not_taken: dict = field(default_factory=dict)

    def __post_init__(self):
        self.lines = runbook_commands(self.name)
        assert self.lines, f"{self.name}: no commands"

    def line(self, start: str) -> str:
        """The one command of the runbook that starts with `start` (after `billingctl `, if it is one)."""
        def command(line):
            return line.split(" #")[0].strip()

        exact = [line for line in self.lines if command(line) in (start, f"billingctl {start}")]
        found = exact or [line for line in self.lines
                          if line.startswith(start) or line.startswith(f"billingctl {start}")]
        assert len(found) == 1, f"{self.name}: {len(found)} commands start with {start!r}: {self.lines}"
        return found[0]

    def run(self, start: str, expect: int | tuple = 0, **fills: str) -> subprocess.CompletedProcess:
        """Run the runbook's command as written, its placeholders replaced by `fills` (each must appear)."""
        line = self.line(start)
        command = line
        for placeholder, value in fills.items():
            pattern = rf"(?<![\w$-]){re.escape(placeholder)}(?![\w-])"
            assert re.search(pattern, command), f"{self.name}: no {placeholder} in {line!r}"
            command = re.sub(pattern, lambda _, v=value: v, command)
        bindir = str(Path(sys.executable).parent)
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120,
                              env={"PATH": f"{bindir}:{os.environ['PATH']}", **self.env})
        codes = expect if isinstance(expect, tuple) else (expect,)
        assert done.returncode in codes, (f"{self.name}: `{command}` exited {done.returncode}\n"
                                          f"{done.stdout}\n{done.stderr}")
        self.ran[line] = done
        return done

    def not_taken_here(self, start: str, why: str) -> None:
        """A command this test does not run: the runbook's other branch, and why."""
        self.not_taken[self.line(start)] = why

    def followed(self) -> None:
        """Every command of the runbook was run or is accounted for."""
        left = [line for line in self.lines if line not in self.ran and line not in self.not_taken
                and line.split()[0] not in HOST_TOOLS]
        assert not left, f"{self.name}: commands the test did not follow: {left}"


def alert_names() -> list[str]:
    return re.findall(r"- alert: (\w+)", ALERTS.read_text())


def scrape(container, metrics_dir) -> dict:
    """The internal app's /metrics as Prometheus would read it: {(name, ((label, value), ...)): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    from webhooks_app import create_internal_app

    previous = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    try:
        response = create_internal_app(container=container).test_client().get("/metrics")
    finally:
        if previous is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous
    assert response.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.get_data(as_text=True)) for s in family.samples}


def value(series: dict, name: str, **labels) -> float:
    """The sum of a metric's samples whose labels include `labels` (0 when there are none)."""
    return sum(v for (n, ls), v in series.items() if n == name and set(labels.items()) <= set(ls))


def ids(text: str, prefix: str) -> list[str]:
    """Ids printed in a command's human output that start with `prefix` (`pay_`, `ev_`, ...), in order."""
    found = re.findall(rf"(?<![\w-])({re.escape(prefix)}[\w-]+)", text)
    return list(dict.fromkeys(found))


def table(text: str) -> list[dict]:
    """The rows of a command's table as printed to a pipe (a header line, then tab-separated rows)."""
    lines = [line for line in text.splitlines() if "\t" in line]
    if not lines:
        return []
    header = lines[0].split("\t")
    return [dict(zip(header, line.split("\t"), strict=False)) for line in lines[1:]]
