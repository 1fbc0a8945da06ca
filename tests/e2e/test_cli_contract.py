"""The CLI contract: the demo runs to completion; --dry-run changes nothing; --json is one document."""

import json
import os
import subprocess
import sys

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from billingctl.adapters.db.tables import metadata
from billingctl.cli.main import app
from billingctl.services.checkout import create_checkout

pytestmark = pytest.mark.e2e


def test_the_demo_runs_to_completion_on_a_fresh_directory(tmp_path):
    env = {"PATH": os.environ["PATH"]}
    for _ in range(2):  # re-runnable
        result = subprocess.run([sys.executable, "-m", "billingctl", "--json", "demo"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        report = json.loads(result.stdout)
        assert report["reconcile_ok"] is True and report["violations"] == []
        credits = sorted(u["credits"] for u in report["users"].values())
        assert credits == [2000, 4000, 6000]  # a month passes: Ada renews once, Bo once (wallet swapped)
    assert (tmp_path / "billing.db").exists() and (tmp_path / "billing-sandbox.db").exists()
    story = subprocess.run([sys.executable, "-m", "billingctl", "demo"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
    # Issue "The operator's CLI" 8: no JSON log lines inside the story, no Python repr in it.
    assert story.returncode == 0 and '{"ts"' not in story.stderr and "{'" not in story.stderr + story.stdout


def test_the_demo_judges_only_its_own_users_and_says_how_to_start_clean(tmp_path):
    """Issue 38 item 11: once the local database held any violation (another run's, another tool's), every
    `make demo` exited 5 printing a Python repr. It judges its own run, names the others apart, and says how
    to start clean."""
    from datetime import UTC, datetime

    from sqlalchemy import create_engine, text

    env = {"PATH": os.environ["PATH"]}
    first = subprocess.run([sys.executable, "-m", "billingctl", "--json", "demo"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    engine = create_engine(f"sqlite:///{tmp_path / 'billing.db'}")
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
    with engine.begin() as conn:  # someone else's data, wrong: a credit that matches no purchase
        conn.execute(text("INSERT INTO users (id, created_at, credits) VALUES ('someone_else', :now, 0)"),
                     {"now": now})
        conn.execute(text("INSERT INTO credit_ledger (user_id, amount, source_key, reason, payment_id, created_at) "
                          "VALUES ('someone_else', 0, 'payment:pay_ghost', 'payment', 'pay_ghost', :now)"),
                     {"now": now})
    engine.dispose()
    story = subprocess.run([sys.executable, "-m", "billingctl", "demo"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
    assert story.returncode == 0, story.stderr[-2000:]
    assert "clean" in story.stderr and "1 violation(s) of other data in this database" in story.stderr
    assert "make clean" in story.stderr and "{'" not in story.stderr + story.stdout


def snapshot(engine) -> dict:
    with engine.connect() as conn:
        return {t.name: sorted(map(repr, conn.execute(select(t)).all())) for t in metadata.sorted_tables}


def test_dry_run_changes_nothing(settings, container):
    from billingctl.demo import run_demo

    report = run_demo(container, say=lambda *_: None)
    ada = next(u for u in report["users"] if u.startswith("ada_"))
    sub = container.sandbox.store.all("subscription")[0]["id"]
    payment = container.sandbox.payments("SETTLED")[0]["id"]
    with container.uow() as uow:
        from billingctl.adapters.db.tables import event_inbox, orphan_recovery

        inbox_id = uow.execute(select(event_inbox.c.id)).scalars().first()
        orphan_id = uow.execute(select(orphan_recovery.c.payment_id)).scalars().first()
    open_checkout = create_checkout(container, ada, "credits-basic-USD-monthly")
    env = {"BILLING_DATABASE_URL": settings.database_url, "BILLING_SANDBOX_DB": settings.sandbox_db}
    commands = [
        ["db", "upgrade"], ["alerts", "send", "hello"], ["sandbox", "pay", open_checkout["order_id"]],
        ["activate", sub], ["activate", "--pending"], ["payments", "record", payment],
        ["lock", "clear", ada, "--lane", "sfw", "--reason", "x"], ["lock", "backfill-mid"],
        ["users", "freeze", ada, "--reason", "x"], ["checkout", "cleanup"], ["sync", sub],
        ["subscriptions", "cancel", sub, "--reason", "x"], ["events", "replay", str(inbox_id), "--reason", "x"],
        ["orphans", "retry", orphan_id], ["orphans", "resolve", orphan_id, "--refund", "--reason", "x"],
        ["renewals", "run"], ["poll"], ["poll", "--all-invoices"], ["sync-all", "--since", "2020-01-01T00:00:00Z"],
        ["invalidate", ada], ["orphans", "run"], ["alerts", "deliver"], ["jobs", "run", "poll"],
    ]
    before = snapshot(container.engine)
    sandbox_before = container.sandbox.store.count_requests("provider", "POST")
    runner = CliRunner()
    for args in commands:
        result = runner.invoke(app, ["--json", "--dry-run", *args], env=env)
        assert result.exit_code in (0, 3), (args, result.output)
        if result.exit_code == 0:
            doc = json.loads(result.stdout)
            assert isinstance(doc, dict | list), args
    assert snapshot(container.engine) == before
    assert container.sandbox.store.count_requests("provider", "POST") == sandbox_before


@pytest.mark.parametrize(("args", "code"), [
    (["lock", "show", "nobody"], 3), (["users", "show", "nobody"], 3), (["orphans", "show", "pay_x"], 3),
    (["events", "show", "123456"], 3), (["jobs", "run", "nope"], 3), (["sync-all"], 2), (["poll", "--since", "x"], 2),
    (["lock", "clear", "u", "--lane", "purple", "--reason", "r", "--yes"], 2), (["nonexistent-command"], 2),
])
def test_exit_codes(settings, args, code):
    env = {"BILLING_DATABASE_URL": settings.database_url, "BILLING_SANDBOX_DB": settings.sandbox_db}
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == code, result.output
