"""The cyclic collector through a command's start-up (decision 262): collected rarely until the first engine,
then the start-up's objects frozen and the default thresholds back; nothing changes in a process that did not
begin so (the web apps, the tests)."""

import gc

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
    from billingctl.cli.main import main

    defaults = gc.get_threshold()
    monkeypatch.setattr("sys.argv", ["billingctl", "version"])
    with pytest.raises(SystemExit) as done:
        main()
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
