"""The cyclic collector through a command's start-up (decision 262): collected rarely until the first engine,
then the start-up's objects frozen and the default thresholds back; nothing changes in a process that did not
begin so (the web apps, the tests)."""

import gc
from pathlib import Path

import pytest

from billingctl import startup
from billingctl.bootstrap import Container


@pytest.fixture
def collector():
    """The test process's collector as it was, whatever the test did to it."""
    thresholds = gc.get_threshold()
    yield
    startup.end()
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_the_cli_collects_its_start_up_rarely_until_the_first_engine(collector, settings, monkeypatch):
    from billingctl.cli import run

    defaults = gc.get_threshold()
    monkeypatch.delenv("PYDANTIC_DISABLE_PLUGINS", raising=False)  # `begin` sets it: undone after the test
    monkeypatch.setattr("sys.argv", ["billingctl", "version"])
    with pytest.raises(SystemExit) as done:
        run()
    assert done.value.code == 0
    assert gc.get_threshold() == startup.START_THRESHOLDS  # `version` builds no engine: still starting
    assert gc.isenabled()  # collected rarely, never switched off

    first = Container(settings)
    first.engine  # noqa: B018 - the first engine ends the start-up
    assert gc.get_threshold() == defaults
    frozen = gc.get_freeze_count()
    assert frozen > 0
    second = Container(settings)
    second.engine  # noqa: B018 - a later engine changes nothing
    assert gc.get_freeze_count() <= frozen  # nothing more frozen (a frozen object may still be freed)
    assert gc.get_threshold() == defaults
    first.close()
    second.close()


def test_a_process_that_did_not_begin_so_keeps_its_collector(collector, container):
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    container.engine  # noqa: B018
    assert (gc.get_threshold(), gc.get_freeze_count()) == (thresholds, frozen)
    assert startup.end() is False


def test_the_console_script_begins_before_typer_is_imported():
    """The entry point (`billingctl.cli:run`, and `python -m billingctl`) sets the policy before any of the
    start-up's imports: its package imports no library (Typer and Click were imported at the default
    thresholds when the entry point was `billingctl.cli.main:main`: `--help` 428 million instructions, 364
    now)."""
    import subprocess
    import sys

    code = ("import sys, gc\nimport billingctl.cli\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('typer', 'click', 'billingctl')))")
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert shown.stdout.strip() == "['billingctl', 'billingctl.cli']"
    entry = [line for line in (Path(__file__).parents[2] / "pyproject.toml").read_text().splitlines()
             if line.startswith("billingctl = ")]
    assert entry == ['billingctl = "billingctl.cli:run"']


_TEARDOWN = """
import atexit, gc, os, sys
# Registered before `begin`: runs after its handler, as the interpreter's teardown would see the heap.
atexit.register(lambda: os.write(1, f"{len(gc.get_objects())} {gc.get_freeze_count()}".encode()))
from billingctl import startup
if sys.argv[1] == "began":
    startup.begin()
made = [[n] for n in range(50_000)]  # the start-up's
if sys.argv[1] == "began":
    startup.end()
more = [[n] for n in range(50_000)]  # the command's own work, after its first engine
"""


@pytest.mark.parametrize(("how", "frozen_at_exit"), [("began", True), ("did_not_begin", False)])
def test_the_interpreters_teardown_finds_a_commands_objects_frozen(how, frozen_at_exit):
    """Decision 264: the teardown's collections walk what is not frozen, several times; a command that began
    so is frozen whole once every other exit handler has run. A process that did not begin so (a web
    worker, a test) is left as it was."""
    import subprocess
    import sys

    shown = subprocess.run([sys.executable, "-c", _TEARDOWN, how], capture_output=True, text=True, timeout=60,
                           check=True)
    tracked, frozen = map(int, shown.stdout.split())
    if frozen_at_exit:
        assert frozen > 100_000 and tracked < 1_000
    else:
        assert frozen == 0 and tracked > 100_000


def test_a_command_closes_what_it_opened_whatever_it_answered(settings, monkeypatch):
    """Decision 264: the CLI closes the container a command built when the command ends, so its connections
    end with a goodbye, not with the process (and not in a teardown collection)."""
    from typer.testing import CliRunner

    import billingctl.bootstrap
    from billingctl.cli.main import app

    built = []
    real = billingctl.bootstrap.bootstrap

    def recording(*args, **kw):
        built.append(real(*args, **kw))
        return built[-1]

    monkeypatch.setattr(billingctl.bootstrap, "bootstrap", recording)
    env = {"BILLING_DATABASE_URL": settings.database_url, "BILLING_SANDBOX_DB": settings.sandbox_db}
    for args, code in ((["users", "show", "nobody"], 3), (["jobs", "list"], 0)):
        result = CliRunner().invoke(app, args, env=env)
        assert result.exit_code == code, result.output
    assert built, "no command built a container"
    for container in built:
        assert container.engine.pool.checkedin() == 0  # disposed: no connection left open in its pool
