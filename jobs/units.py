"""Renders `crontab` and `systemd/` from the schedule table. `billingctl jobs render` writes them;
tests/e2e/test_jobs.py fails when the committed files drift from the table."""

from __future__ import annotations

from jobs.schedule import JOBS, Job

BILLINGCTL = "/opt/billing/.venv/bin/billingctl"
ENV_FILE = "/etc/billing/billing.env"
STATE_DIR = "/var/lib/billing"
HARDENING = """NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
PrivateDevices=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectControlGroups=yes
RestrictSUIDSGID=yes
RestrictNamespaces=yes
LockPersonality=yes
MemoryDenyWriteExecute=yes
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6
SystemCallArchitectures=native
CapabilityBoundingSet=
ReadWritePaths=/var/lib/billing /run/billing-metrics"""
METRICS_DIR = "/run/billing-metrics"
# The jobs yield the CPU to the web apps on a shared host: a catch-up is limited by the provider's budget,
# not by CPU, while a webhook's answer waits on every millisecond it does not get (issue 39 item 3).
JOB_NICE = 10
COMMON = f"""User=billing
Group=billing
WorkingDirectory={STATE_DIR}
EnvironmentFile={ENV_FILE}
Environment=PROMETHEUS_MULTIPROC_DIR={METRICS_DIR}
{HARDENING}"""


# Every service: the metrics directory it creates, then the user, environment and hardening.
RUNTIME = f"""RuntimeDirectory=billing-metrics
RuntimeDirectoryPreserve=yes
{COMMON}"""
LONG_RUNNING_TAIL = f"""{RUNTIME}

[Install]
WantedBy=multi-user.target
"""


def cron_command(job: Job, env_file: str = ENV_FILE, billingctl: str = BILLINGCTL) -> str:
    """The env file is read by `sh` here and by systemd in the units: one format for both (values with
    spaces, quotes or JSON in single quotes). Output goes to syslog (the journal), which every host has;
    the metrics directory is the units' (the job creates it when it can)."""
    # One group for all of it: an env file that fails to source is logged too, not sent as cron mail.
    return (f"{{ set -a && . {env_file} && PROMETHEUS_MULTIPROC_DIR={METRICS_DIR} nice -n {JOB_NICE} {billingctl} jobs "
            f"run {job.name}; }} 2>&1 | logger -t billing-job-{job.name}")


def cron_lines(job: Job) -> list[str]:
    command = cron_command(job)
    seconds = job.interval_seconds
    if seconds < 60:
        return [f"* * * * * billing {'sleep ' + str(offset) + ' && ' if offset else ''}{command}"
                for offset in range(0, 60, seconds)]
    if seconds < 3600:
        return [f"*/{seconds // 60} * * * * billing {command}" if seconds > 60 else f"* * * * * billing {command}"]
    if seconds < 86400:
        return [f"0 */{seconds // 3600} * * * billing {command}" if seconds > 3600 else f"0 * * * * billing {command}"]
    return [f"30 3 * * * billing {command}"]


def render_crontab() -> str:
    lines = ["# Generated from jobs/schedule.py by `billingctl jobs render`; do not edit by hand.",
             "# /etc/cron.d/billing: every host may carry it; the job lease lets one run at a time.",
             "SHELL=/bin/sh", ""]
    for job in JOBS:
        lines.append(f"# {job.name}: {job.description} (every {job.interval_seconds} s)")
        lines.extend(cron_lines(job))
    return "\n".join(lines) + "\n"


LOOP_AT_MOST_SECONDS = 60  # jobs this frequent run as long-lived loops: no start-up cost every 15 s


def render_units(billingctl: str = BILLINGCTL) -> dict[str, str]:
    units = {}
    for job in JOBS:
        if job.interval_seconds <= LOOP_AT_MOST_SECONDS:
            units[f"billing-job-{job.name}.service"] = f"""# Generated from jobs/schedule.py; do not edit by hand.
[Unit]
Description=billing job {job.name} (a loop every {job.interval_seconds} s): {job.description}
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
# One run per interval under the job's lease (another host holding it just skips that run).
ExecStart={billingctl} jobs run {job.name} --loop
Nice={JOB_NICE}
Restart=always
RestartSec=5
{LONG_RUNNING_TAIL}"""
            continue
        units[f"billing-job-{job.name}.service"] = f"""# Generated from jobs/schedule.py; do not edit by hand.
[Unit]
Description=billing job {job.name}: {job.description}
After=network-online.target
Wants=network-online.target

[Service]
Type=oneshot
ExecStart={billingctl} jobs run {job.name}
Nice={JOB_NICE}
# 75: another host holds the lease; that is not a failure.
SuccessExitStatus=75
TimeoutStartSec={job.lease_seconds}
{RUNTIME}
"""
        units[f"billing-job-{job.name}.timer"] = f"""# Generated from jobs/schedule.py; do not edit by hand.
[Unit]
Description=every {job.interval_seconds} s: billing job {job.name}

[Timer]
OnBootSec={min(job.interval_seconds, 60)}s
OnUnitActiveSec={job.interval_seconds}s
AccuracySec={1 if job.interval_seconds < 60 else 5}s
Unit=billing-job-{job.name}.service

[Install]
WantedBy=timers.target
"""
    gunicorn = billingctl.replace("billingctl", "gunicorn")
    # No control socket (gunicorn 25+): both services would share its default path ($HOME/.gunicorn/
    # gunicorn.ctl, the second taking it from the first), and nothing here uses gunicornc (issue 37).
    # Both listen on loopback only: the public app behind nginx (deploy/nginx/billing-public.conf), which
    # buffers every request so a sync worker never waits on a slow client (issue 37), the internal one private.
    for app, port in (("public", 8000), ("internal", 8001)):
        units[f"billing-{app}.service"] = f"""# Generated from jobs/units.py; do not edit by hand.
[Unit]
Description=billing {app} web app (gunicorn)
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
ExecStart={gunicorn} --bind 127.0.0.1:{port} --workers 4 --timeout 30 --no-control-socket 'webhooks_app.wsgi:{app}()'
Restart=on-failure
RestartSec=2
{LONG_RUNNING_TAIL}"""
    return units
