"""`billingctl jobs list|run|render`: the schedule table and the lease-holding runner."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import typer

from billingctl.cli.context import command, get_ctx, noun

app = noun("Scheduled jobs (cron and systemd run `jobs run NAME`).")


@command(app, "list")
def list_():
    """Every job: interval, command, lease holder, last success and lag."""
    from billingctl.services.job_status import leases
    from jobs.schedule import BY_NAME

    cli = get_ctx()
    rows = [{**row, "command": "billingctl " + " ".join(BY_NAME[row["job"]].command)}
            for row in leases(cli.container)]
    cli.output.table(rows, ["job", "every_seconds", "command", "holder", "last_success_at", "lag_seconds",
                            "last_error"], title="jobs", data=rows)


@command(app, "run")
def run(name: str, loop: bool = typer.Option(False, "--loop", help="Keep running at the job's interval."),
        interval: float = typer.Option(None, "--interval", help="With --loop: seconds between runs (default: "
                                                                "the table's)."),
        max_runs: int = typer.Option(0, "--max-runs", help="With --loop: stop after this many runs.")):
    """Run one job under its lease (exit 75 at once when another instance holds it)."""
    from billingctl.domain.errors import BillingError, LeaseHeld, NotFound
    from jobs.runner import run as run_job
    from jobs.schedule import BY_NAME

    cli = get_ctx()
    job = BY_NAME.get(name)
    if job is None:
        raise NotFound(f"no job {name!r}; see `billingctl jobs list`")
    if not cli.log_level_given:
        # Scheduled jobs log at INFO: the spec's markers (nsfw_renewal_card_substitution, …) are INFO lines.
        from billingctl.adapters.logs import set_level

        set_level("INFO")
    if cli.dry_run:
        from billingctl.services.job_status import leases

        lease = next(r for r in leases(cli.container) if r["job"] == name)
        cli.output.result({"dry_run": True, "job": name, "command": "billingctl " + " ".join(job.command),
                           "lease": lease})
        return
    if not loop:
        cli.output.result(run_job(cli.container, job))
        return
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    runs = 0
    while not stopping:
        started = time.monotonic()
        try:
            cli.output.result(run_job(cli.container, job))
        except LeaseHeld as exc:
            cli.output.info(exc.message)
        except BillingError as exc:  # a failed run is logged; the loop goes on
            cli.output.error(exc.message)
        runs += 1
        if max_runs and runs >= max_runs:
            break
        every = job.interval_seconds if interval is None else interval
        time.sleep(max(0.0, every - (time.monotonic() - started)))


@command(app, "render")
def render(out: Path = typer.Option(Path("."), "--out", help="Project root to write crontab and systemd/ into.")):
    """Write `crontab` and `systemd/` from the schedule table."""
    from jobs.units import render_crontab, render_units

    cli = get_ctx()
    (out / "systemd").mkdir(parents=True, exist_ok=True)
    (out / "crontab").write_text(render_crontab())
    units = render_units()
    for filename, text in units.items():
        (out / "systemd" / filename).write_text(text)
    cli.output.result({"crontab": str(out / "crontab"), "units": sorted(units)})
