"""The CLI skeleton as a user runs it: a real subprocess, real databases."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def run(args, env=None, **kw):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("BILLING_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "billingctl", *args], capture_output=True, text=True,
                          env=full_env, timeout=120, **kw)


def test_help_and_version():
    assert "health" in run(["--help"]).stdout
    result = run(["--json", "version"])
    assert result.returncode == 0
    assert json.loads(result.stdout)["version"]


def test_help_does_not_import_heavy_libraries():
    code = ("import sys; sys.argv=['billingctl','--help'];\n"
            "from billingctl.cli.main import app\n"
            "try:\n    app()\nexcept SystemExit:\n    pass\n"
            "heavy=[m for m in ('sqlalchemy','flask','httpx','alembic','redis','psycopg') if m in sys.modules]\n"
            "print('HEAVY=' + ','.join(heavy))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY=\n" in result.stdout or result.stdout.strip().endswith("HEAVY=")


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"BILLING_ENV": "staging"}, "BILLING_ENV"),
        ({"BILLING_DATABASE_URL": "not a url"}, "BILLING_DATABASE_URL"),
        ({"BILLING_ENV": "production"}, "BILLING_ORCHESTRATOR_WEBHOOK_SECRET"),
    ],
)
def test_bad_configuration_is_one_line_and_exit_2(env, needle):
    result = run(["health"], env=env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0]
    assert "Traceback" not in result.stderr


def test_db_upgrade_then_health_reports_the_database(db_url):
    env = {"BILLING_DATABASE_URL": db_url}
    # The fixture's database is already migrated: upgrade is a safe no-op.
    upgraded = run(["--json", "db", "upgrade"], env=env)
    assert upgraded.returncode == 0, upgraded.stderr
    assert json.loads(upgraded.stdout)["changed"] is False
    health = run(["--json", "health"], env=env)
    checks = {c["name"]: c for c in json.loads(health.stdout)["checks"]}
    assert checks["database"]["ok"] and checks["migrations"]["ok"]
    # A poller that never ran needs attention (exit 3); after one run the report is clean.
    assert (health.returncode, checks["event_poller"]["detail"]) == (3, "never ran")
    assert run(["poll"], env=env).returncode == 0
    assert run(["--json", "health"], env=env).returncode == 0
    assert checks["database"]["data"]["dialect"] == db_url.split(":")[0].split("+")[0]


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_db_upgrade_on_an_empty_database(dialect, tmp_path, pg_server_url):
    from tests.conftest import create_database

    if dialect == "sqlite":
        url = f"sqlite:///{tmp_path / 'empty.db'}"
    else:
        url = create_database(pg_server_url, "billing_empty_cli")
    env = {"BILLING_DATABASE_URL": url}
    before = run(["--json", "health"], env=env)
    assert before.returncode == 3  # migrations behind: needs attention
    upgraded = run(["--json", "db", "upgrade"], env=env)
    assert upgraded.returncode == 0, upgraded.stderr
    assert json.loads(upgraded.stdout)["before"] is None
    after = {c["name"]: c["ok"] for c in json.loads(run(["--json", "health"], env=env).stdout)["checks"]}
    assert after["database"] and after["migrations"]


def test_health_reports_an_unreachable_database_as_external_failure():
    result = run(["--json", "health"], env={"BILLING_DATABASE_URL": "postgresql+psycopg://x@127.0.0.1:1/db"})
    assert result.returncode == 4
    assert json.loads(result.stdout)["checks"][0]["ok"] is False


def test_health_with_real_redis(redis_url, db_url):
    result = run(["--json", "health"], env={"BILLING_DATABASE_URL": db_url, "BILLING_REDIS_URL": redis_url})
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["redis"]["ok"] and checks["redis"]["data"]["configured"]
    down = run(["--json", "health"], env={"BILLING_DATABASE_URL": db_url,
                                          "BILLING_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert down.returncode == 4


def test_wsgi_entry_point_stops_with_one_line_on_missing_secret():
    code = "from webhooks_app.wsgi import public; public()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={"PATH": os.environ["PATH"], "BILLING_ENV": "production"})
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: configuration error")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_a_command_on_a_database_behind_the_code_says_to_upgrade_it(dialect, tmp_path, pg_server_url):
    """A release whose code reached the hosts before `billingctl db upgrade` ran (or a database nobody
    migrated): every command and job that meets a missing table or column says so in one line, names both
    revisions and the command that fixes it, and exits 4 like any dependency not ready, where it used to
    print "unexpected ProgrammingError" with the SQL and a traceback. The embedded SQLite database is
    migrated on first use, so there the same commands simply run."""
    from billingctl.adapters.db.engine import make_engine
    from billingctl.adapters.db.migrate import head_revision, upgrade
    from tests.conftest import create_database

    if dialect == "sqlite":
        empty, behind = (f"sqlite:///{tmp_path / name}.db" for name in ("empty", "behind"))
    else:
        empty, behind = (create_database(pg_server_url, f"billing_{name}_cli") for name in ("empty", "behind"))
    engine = make_engine(behind)
    upgrade(engine, "0018")  # before subscription.deleted_at
    engine.dispose()
    head = head_revision()
    for url, args, at in ((empty, ["jobs", "run", "poll"], "no revision"),
                          (behind, ["activate", "sub_missing"], "0018")):
        result = run(args, env={"BILLING_DATABASE_URL": url, "BILLING_SANDBOX_DB": str(tmp_path / "sandbox.db")})
        if dialect == "sqlite":
            assert result.returncode in (0, 3), result.stderr  # migrated, then run (3: no such subscription)
            continue
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 4, result.stderr
        assert lines == [f"error: the database schema is behind this code (database at {at}, code at {head}): "
                         "run `billingctl db upgrade`"], result.stderr
