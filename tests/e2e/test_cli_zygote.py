"""The test workers' CLI zygote (tests/cli_zygote.py, decision 167) runs `billingctl` as a fresh interpreter
does: the same exit codes, stdout and stderr, nothing of one run left in the next, the exit handlers run
(a process's metrics folded into the archives as it exits). Each run here is made both ways and compared."""

import os

import pytest

from tests.helpers import billingctl

pytestmark = pytest.mark.e2e


def both(args, env, monkeypatch):
    """The run through the zygote, then the same run in a fresh interpreter."""
    monkeypatch.delenv("BILLING_TEST_CLI", raising=False)
    zygote = billingctl(args, env)
    monkeypatch.setenv("BILLING_TEST_CLI", "fresh")
    fresh = billingctl(args, env)
    monkeypatch.delenv("BILLING_TEST_CLI")
    return zygote, fresh


@pytest.mark.parametrize("args", [
    ["--help"],                                      # 0, Typer's screen
    ["--helpx"],                                     # 2, a usage error on stderr
    ["--json", "version"],                           # 0, JSON on stdout
    ["--json", "users", "show", "user_nobody"],      # 3, one line on stderr
    ["payments", "record"],                          # 2, an argument missing
    ["jobs", "run", "no-such-job"],
])
def test_a_run_through_the_zygote_is_the_run_of_a_fresh_interpreter(args, env, monkeypatch):
    zygote, fresh = both(args, env, monkeypatch)
    assert (zygote.returncode, zygote.stdout, zygote.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert "Traceback" not in zygote.stderr


def test_nothing_of_one_run_is_left_in_the_next(env, monkeypatch):
    """A run whose configuration is refused, then one whose configuration is good: each reads its own."""
    bad, fresh_bad = both(["health"], {**env, "BILLING_ENV": "staging"}, monkeypatch)
    assert bad.returncode == fresh_bad.returncode == 2 and "BILLING_ENV" in bad.stderr
    good = billingctl(["--json", "version"], env)
    assert good.returncode == 0, good.stderr
    assert billingctl(["health"], {**env, "BILLING_DATABASE_URL": "not a url"}).returncode == 2


def test_the_exit_handlers_fold_the_runs_metrics(env, monkeypatch, tmp_path):
    from prometheus_client.mmap_dict import MmapedDict

    def books(directory):
        names = sorted(os.listdir(directory))
        counters = sorted((key, value) for key, value, _, _ in
                          MmapedDict.read_all_values_from_file(str(directory / "counter_archive.db")))
        return names, counters

    zygote, fresh = both(["--json", "health"], {**env, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "m")},
                         monkeypatch)
    assert zygote.returncode == fresh.returncode
    # The second run added its counts to the first's archive; no process file is left behind.
    names, counters = books(tmp_path / "m")
    assert names == ["archive.lock", "counter_archive.db", "gauge_max_archive.db", "histogram_archive.db"]
    assert counters and all(value % 2 == 0 for _, value in counters)


def test_a_started_run_is_a_process_of_its_own_that_a_signal_ends(env, monkeypatch, tmp_path):
    """`billingctl_started` (the month in separate processes starts its jobs with it): a loop killed with
    SIGKILL reports -9 either way, and its pid was its own."""
    import os
    import signal
    import time

    from tests.helpers import billingctl_started

    full = {"PATH": os.environ["PATH"], **env}
    codes = []
    for mode in ("zygote", "fresh"):
        monkeypatch.setenv("BILLING_TEST_CLI", mode)
        run = billingctl_started(["jobs", "run", "checkout-cleanup", "--loop", "--interval", "1"], full, tmp_path)
        assert run.pid not in (os.getpid(), None)
        time.sleep(1.5)
        assert run.poll() is None, run.communicate(10)  # the loop runs
        run.send_signal(signal.SIGKILL)
        codes.append(run.wait(30))
        run.communicate(10)
    assert codes == [-signal.SIGKILL, -signal.SIGKILL]
