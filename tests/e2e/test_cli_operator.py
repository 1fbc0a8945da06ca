"""The operator's CLI as on-call uses it (issue "The operator's CLI"): flags after the sub-command, a
real pseudo-terminal and a pipe, stored text that looks like markup, choices, partial failures in JSON."""

import json
import os
import shlex
import subprocess
import sys

import pytest

from billingctl.services.checkout import create_checkout
from billingctl.services.users import freeze
from tests.helpers import billingctl, term_runs_out

pytestmark = pytest.mark.e2e


def in_a_terminal(args, env, columns=80):
    """Run through `script`, which gives the command a real pseudo-terminal (80 columns)."""
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "billingctl", *args])
    result = subprocess.run(["script", "-qefc", f"stty cols {columns}; {command}", "/dev/null"],
                            capture_output=True, text=True, timeout=120,
                            env={"PATH": os.environ["PATH"], "TERM": "xterm", **env})
    return result.returncode, result.stdout.replace("\r\n", "\n")


def test_global_flags_work_after_the_sub_command(env):
    before = billingctl(["--json", "health"], env)
    after = billingctl(["health", "--json"], env)
    assert after.returncode == before.returncode and json.loads(after.stdout)["checks"]
    assert billingctl(["health", "--output", "json"], env).returncode == before.returncode
    dry = billingctl(["users", "freeze", "nobody", "--reason", "r", "--dry-run"], env)
    assert dry.returncode == 3 and "not found" in dry.stderr  # parsed, then refused like the real run


def test_a_pipe_gets_untruncated_tsv_and_no_python_repr(container, env):
    co = create_checkout(container, "user_with_a_rather_long_identifier_0123456789", "credits-pro-USD-monthly")
    container.sandbox.pay(co["order_id"])
    shown = billingctl(["users", "show", "user_with_a_rather_long_identifier_0123456789"], env)
    assert shown.returncode == 0
    assert "datetime.datetime(" not in shown.stdout and "None" not in shown.stdout and "['" not in shown.stdout
    fields = dict(line.split("\t", 1) for line in shown.stdout.splitlines())
    assert fields["frozen_at"] == "—" and fields["credits"] == "2000"
    listed = billingctl(["renewals", "list", "--user", "user_with_a_rather_long_identifier_0123456789"], env)
    assert listed.returncode == 0 and "…" not in listed.stdout
    orphans = billingctl(["events", "list"], env)
    header, *rows = orphans.stdout.splitlines()
    assert header.split("\t")[0] == "id" and all("…" not in r for r in rows) and rows


def test_stored_text_that_looks_like_markup_is_shown_as_is_in_a_terminal(container, env):
    co = create_checkout(container, "user_markup", "credits-pro-USD-monthly")
    container.sandbox.pay(co["order_id"])
    freeze(container, "user_markup", "chargeback [/] then [red]fraud[/red]", "ops")
    code, screen = in_a_terminal(["users", "show", "user_markup"], env)
    assert code == 0, screen
    assert "chargeback [/] then [red]fraud[/red]" in screen
    assert "datetime.datetime(" not in screen and "recent_payments" in screen  # the whole record printed


def test_a_typo_in_a_filter_exits_2_naming_the_valid_values(env):
    for args, valid in ((["events", "list", "--state", "parkd"], "parked"),
                        (["orphans", "list", "--state", "exhuasted"], "exhausted"),
                        (["alerts", "list", "--status", "pendng"], "pending"),
                        (["--log-level", "verbose", "health"], "WARNING")):
        result = billingctl(args, env)
        assert result.returncode == 2 and valid in result.stderr and "Traceback" not in result.stderr


def test_short_help_and_version(env):
    assert "Usage: billingctl" in billingctl(["-h"], env).stdout
    assert billingctl(["--version"], env).stdout.startswith("billingctl ")


def test_a_command_line_naming_a_noun_registers_it_alone_and_help_still_lists_everything(env):
    """Decision 240: `billingctl jobs ...` registers the jobs commands only; the root's help (however it is
    asked for, before a noun too), a root command and a typo see every command, and global options before
    the noun work as before."""
    for args in (["-h"], ["-h", "jobs"], ["--json", "-h"]):
        listing = billingctl(args, env).stdout
        assert all(word in listing for word in ("reconcile", "sandbox", "jobs", "lock", "version")), args
    jobs_help = billingctl(["--log-level", "ERROR", "jobs", "-h"], env)
    assert jobs_help.returncode == 0 and "run" in jobs_help.stdout and "render" in jobs_help.stdout
    listed = billingctl(["--output", "json", "jobs", "list"], env)
    assert listed.returncode == 0 and any(job["job"] == "poll" for job in json.loads(listed.stdout)), listed.stderr
    typo = billingctl(["job", "list"], env)
    assert typo.returncode == 2 and "Did you mean 'jobs'?" in typo.stderr


def test_json_prints_the_document_also_on_a_partial_failure(container, env):
    container.sandbox.store.add_fault("provider", "503", method="GET", path="/events", count=-1)
    result = billingctl(["poll", "--json"], {**env, "BILLING_HTTP_MAX_ATTEMPTS": "1"})
    assert result.returncode == 4
    document = json.loads(result.stdout)
    assert document["error"] and "events_seen" in document


def test_dry_runs_make_the_real_checks_and_exit_like_the_real_run(container, env):
    """Issue "The operator's CLI" 6: `--dry-run activate sub_nope` exited 0 where the real command exits
    3, and `--dry-run renewals run` listed invoices the real run then called not_a_renewal."""
    for args in (["activate", "sub_nope"], ["activate", "bad id!"]):
        real, dry = billingctl(args, env), billingctl([*args, "--dry-run"], env)
        assert dry.returncode == real.returncode != 0, (args, dry.stderr, real.stderr)
    co = create_checkout(container, "user_dry", "credits-pro-USD-monthly")  # a checkout's own invoice...
    container.sandbox.pay(co["order_id"])
    other = create_checkout(container, "user_due", "credits-pro-USD-monthly")
    container.sandbox.pay(other["order_id"])
    container.sandbox.cancel(co["subscription_id"])  # ...whose subscription renews no more
    term_runs_out(container.sandbox, other["subscription_id"])
    container.sandbox.renew_due()  # ...and one real renewal due
    planned = json.loads(billingctl(["renewals", "run", "--dry-run", "--json"], env).stdout)
    assert planned["dry_run"] is True and planned["outcomes"] == {"would_charge": 1}
    assert billingctl(["activate", co["subscription_id"], "--dry-run", "--json"], env).returncode == 0
    charged = json.loads(billingctl(["renewals", "run", "--json"], env).stdout)
    assert charged["outcomes"] == {"succeeded": 1}  # exactly what the plan said


def test_health_tells_not_configured_from_failing(container, env):
    """Issue "The operator's CLI" 9: right after `make demo`, health said ATTENTION (exit 3) because the
    development outbox has no chat URL."""
    from billingctl.services.alerts import raise_alert

    with container.uow() as uow:
        raise_alert(uow, container.clock, "an alert nobody can deliver here", "dev:1")
        uow.commit()
    checks = {c["name"]: c for c in json.loads(billingctl(["health", "--json"], env).stdout)["checks"]}
    assert checks["alert_outbox"]["ok"] is True and "not configured" in checks["alert_outbox"]["detail"]
    header = billingctl(["events", "list"], env).stdout.splitlines()[0].split("\t")
    assert header[:2] == ["id", "received_at"]


def test_logs_are_readable_lines_on_a_terminal_and_json_lines_otherwise(env):
    code, screen = in_a_terminal(["jobs", "run", "velocity-watch"], env)
    assert code == 0 and "info: job finished" in screen and '{"ts"' not in screen
    piped = billingctl(["jobs", "run", "velocity-watch"], env)
    assert any(json.loads(line)["message"] == "job finished" for line in piped.stderr.splitlines()
               if line.startswith("{"))


def test_since_takes_a_relative_span(env):
    assert billingctl(["events", "list", "--since", "2d"], env).returncode == 0
    wrong = billingctl(["events", "list", "--since", "yesterday"], env)
    assert wrong.returncode == 2 and "a span like 1h or 2d" in wrong.stderr


def test_health_says_a_breaker_it_cannot_see_is_unknown(env, redis_url):
    """Issue "The operator's CLI" 9: a fresh process without Redis reported every breaker closed."""
    checks = {c["name"]: c for c in json.loads(billingctl(["health", "--json"], env).stdout)["checks"]}
    assert checks["breaker:subscription_provider"]["data"]["state"] == "unknown"
    shared = {c["name"]: c for c in json.loads(billingctl(["health", "--json"], {
        **env, "BILLING_REDIS_URL": redis_url}).stdout)["checks"]}
    assert shared["breaker:subscription_provider"]["data"]["state"] == "closed"


def test_health_watch_repeats_the_report(env):
    result = billingctl(["health", "--watch", "1", "--count", "2", "--json"], env)
    reports = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(reports) == 2 and all("checks" in r for r in reports)
    assert result.returncode == billingctl(["health"], env).returncode


@pytest.mark.parametrize("args", [["orphans", "run"], ["renewals", "run"], ["reconcile"]])
def test_long_batches_show_progress_on_a_terminal_and_end_cleanly(env, args):
    code, screen = in_a_terminal(args, env)
    assert code == 0 and "Traceback" not in screen
    assert ("outcomes" in screen or "checked" in screen) and "{'" not in screen  # no Python repr either


def test_every_command_has_an_example_that_parses():
    """Issue "The operator's CLI" 9: help that teaches. Each example is parsed exactly as the command
    line would be (the global flags hoisted), so a wrong example fails here."""
    import shlex

    import typer
    from typer._click.exceptions import UsageError

    from billingctl.cli.main import EXAMPLES, app, hoist_global_flags

    root = typer.main.get_command(app)
    leaves = []

    def walk(command, path):
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])
        else:
            leaves.append(" ".join(path))

    walk(root, [])
    assert sorted(leaves) == sorted(EXAMPLES)
    for key, example in EXAMPLES.items():
        args = hoist_global_flags(shlex.split(example)[1:])
        try:
            ctx = root.make_context("billingctl", list(args))
            command, rest = root, ctx._protected_args + ctx.args
            while hasattr(command, "resolve_command") and rest:
                name, command, rest = command.resolve_command(ctx, rest)
                ctx = command.make_context(name, rest, parent=ctx)
                rest = ctx._protected_args + ctx.args if hasattr(command, "resolve_command") else []
        except UsageError as exc:
            raise AssertionError(f"{key}: {example!r} does not parse: {exc}") from None


def test_help_has_one_placeholder_style(capsys):
    """Issue "The operator's CLI" 9: help showed three metavar styles (`{user_id}`, `<str>`, `<a|b>`).
    Every placeholder is now the parameter's name in capitals, and a choice lists its values once."""
    import re

    from billingctl.cli.main import build_command

    root = build_command()
    leaves = []

    def walk(command, path):
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])
        if not hasattr(command, "commands"):
            leaves.append(path)

    walk(root, [])

    def help_of(path):
        capsys.readouterr()
        root.main([*path, "-h"], prog_name="billingctl", standalone_mode=False)  # what `billingctl` runs
        return capsys.readouterr().out

    assert len(leaves) > 40
    for path in leaves:
        text = help_of(path)
        assert "{" not in text and "<" not in text, (path, text)
        usage = text.splitlines()[0]
        placeholders = re.findall(r"\[?([A-Za-z_]+)\]?", usage.split(" ".join(path), 1)[1])
        assert all(p.isupper() for p in placeholders if p != "OPTIONS"), (path, usage)
        for line in text.splitlines():
            option = re.match(r"\s+(--[a-z-]+)(?:, -\w)? ([^\s]+)\s", line)
            if option and not option.group(2).startswith("-"):
                assert re.fullmatch(r"[A-Z_]+", option.group(2)), (path, line)
    state = help_of(["orphans", "list"])
    assert "--state STATE" in state and "needs_review" in state
    for listing in (["events", "list"], ["orphans", "list"], ["alerts", "list"]):  # one name for one filter
        assert "--state" in help_of(listing), listing
    groups = [[]] + [[name] for name, sub in root.commands.items() if hasattr(sub, "commands")]
    for group in groups:  # the command lists show each first sentence whole, never cut with "..."
        listing = help_of(group).split("Commands:", 1)[1]
        assert "..." not in listing, (group, listing)


def test_a_rate_limited_batch_says_one_warning_per_item_above_the_bar(container, env):
    """Issue "The operator's CLI" 7: rate-limit waits came out at ERROR as "crashed" with tracebacks, and
    log lines were printed onto the progress bar's line. Each item now gives one concise warning."""
    import re

    paid = [create_checkout(container, user, "credits-pro-USD-monthly") for user in ("user_rl_1", "user_rl_2")]
    for co in paid:
        container.sandbox.pay(co["order_id"])
    term_runs_out(container.sandbox, paid[-1]["subscription_id"])
    container.sandbox.renew_due()
    container.sandbox.store.add_fault("orchestrator", "429", method="POST", path="/payments", count=-1,
                                      retry_after=0)
    code, screen = in_a_terminal(["renewals", "run"], env)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen)
    lines = [part.strip() for line in text.split("\n") for part in line.split("\r") if part.strip()]
    warnings = [line for line in lines if "warning:" in line]
    assert "Traceback" not in text and "crashed" not in text and '{"' not in text, text
    assert len([w for w in warnings if "invoice" in w or "renewal" in w]) == 2, text  # one per invoice
    assert all(w.startswith("warning: renewal") for w in warnings), warnings  # never onto the bar's line
    assert "call failed" not in text  # the client's own failure line stays at INFO (the job's log)


def test_a_freeze_whose_void_the_provider_refuses_exits_5_and_names_the_invoice(container, env):
    """Decision 192: the provider refuses to void an invoice a cheque paid in part (a payment is linked to
    it). Before, `users freeze --void-invoices` reported the refusal inside a document that exited 0, so a
    runbook took the freeze for complete; now it is a partial failure (exit 5) naming the invoice."""
    co = create_checkout(container, "user_cheque", "credits-pro-USD-monthly")
    container.sandbox.pay(co["order_id"])
    term_runs_out(container.sandbox, co["subscription_id"])
    [invoice] = container.sandbox.renew_due()
    container.sandbox.record_payment(invoice["id"], 300, "cheque-1", payment_method="check")
    done = billingctl(["--json", "users", "freeze", "user_cheque", "--reason", "chargeback", "--void-invoices",
                       "--yes"], env)
    assert done.returncode == 5, done.stderr
    result = json.loads(done.stdout)
    assert result["frozen"] is True and result["voided"] == []
    assert [f["invoice_id"] for f in result["void_failed"]] == [invoice["id"]]
    assert container.sandbox.invoice(invoice["id"])["status"] == "payment_due"
