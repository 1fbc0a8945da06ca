"""The client-side budget is per API key and shared by every process through Redis."""

import json
import subprocess
import sys
import textwrap

import pytest

from billingctl.adapters.ratelimit import BATCH, INTERACTIVE, MONEY, RateLimiter, budget, key_for
from billingctl.domain.errors import RateLimited

pytestmark = pytest.mark.integration

WORKER = textwrap.dedent("""
    import json, sys, time
    from billingctl.bootstrap import Container
    from billingctl.settings import load_settings
    settings = load_settings(redis_url=sys.argv[1], sandbox_db=sys.argv[2], database_url=sys.argv[3],
                             provider_api_key="shared-key", provider_rate_limit=4,
                             provider_rate_window_seconds=2, provider_rate_max_wait_seconds=30)
    c = Container(settings)
    stamps = []
    c.provider.http.client.event_hooks["request"].append(lambda req: stamps.append(time.time()))
    from billingctl.adapters.ratelimit import MONEY, budget
    with budget(MONEY):  # the whole budget (the class shares are tested below)
        for _ in range(int(sys.argv[4])):
            c.provider.get_item_price("credits-pro-USD-monthly")
    print(json.dumps(stamps))
""")


def test_two_processes_never_exceed_the_shared_budget(redis_url, tmp_path):
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, redis_url, str(tmp_path / f"sbx{i}.db"),
                          f"sqlite:///{tmp_path / f'db{i}.db'}", "6"], stdout=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    stamps = sorted(t for p in procs for t in json.loads(p.communicate(timeout=120)[0]))
    assert all(p.returncode == 0 for p in procs)
    assert len(stamps) == 12
    # In any rolling 2 s window at most 4 requests: the 5th after any request is >= 2 s later.
    gaps = [stamps[i + 4] - stamps[i] for i in range(len(stamps) - 4)]
    assert min(gaps) >= 2.0 - 0.05, gaps


def test_a_caller_that_cannot_wait_gets_the_rate_limit_error():
    limiter = RateLimiter(2, 60, key_for("k", "subscription_provider"), max_wait=0)
    with budget(MONEY):
        limiter.acquire()
        limiter.acquire()
        with pytest.raises(RateLimited) as info:
            limiter.acquire()
    assert info.value.details["client_side"] is True


def test_the_classes_share_the_budget_and_money_always_finds_its_part():
    """Issue "Hardening" 5: interactive (30 %) and batch (50 %) are capped; money is bounded only by the
    whole budget, so a user flood or a catch-up job can never take what recording needs."""
    limiter = RateLimiter(10, 60, key_for("k-shares", "subscription_provider"), max_wait=0)
    spent = {}
    for kind in (INTERACTIVE, BATCH):
        with budget(kind):
            spent[kind] = 0
            while True:
                try:
                    limiter.acquire()
                except RateLimited as exc:
                    assert exc.details["budget"] == kind and exc.details["retry_after"] > 0
                    break
                spent[kind] += 1
    assert spent == {INTERACTIVE: 3, BATCH: 5}
    with budget(MONEY):
        limiter.acquire()
        limiter.acquire()  # the two left of ten
        with pytest.raises(RateLimited):
            limiter.acquire()


def test_inside_a_web_request_nothing_waits():
    waited = []
    limiter = RateLimiter(1, 60, key_for("k-web", "subscription_provider"), max_wait=30, sleep=waited.append)
    with budget(MONEY, no_wait=True):
        limiter.acquire()
        with pytest.raises(RateLimited):
            limiter.acquire()
    assert waited == []


def test_the_limiter_waits_within_its_bound():
    waited = []
    limiter = RateLimiter(1, 1, key_for("k2", "subscription_provider"), max_wait=5, sleep=waited.append, shares={})
    limiter.acquire()
    # The fake sleep does not pass time, so the limiter keeps waiting until the bound: it asked to wait.
    limiter.max_wait = 0.05
    with pytest.raises(RateLimited):
        limiter.acquire()
    assert waited and all(0 < w <= 1.0 for w in waited)


def test_the_key_is_hashed_never_stored():
    assert "secret-api-key" not in key_for("secret-api-key", "subscription_provider")
    assert key_for("a", "subscription_provider") != key_for("b", "subscription_provider")


def test_redis_down_falls_back_to_the_in_process_budget():
    limiter = RateLimiter(1, 60, key_for("k3", "p"), redis_url="redis://127.0.0.1:1/0", max_wait=0, shares={})
    limiter.acquire()
    with pytest.raises(RateLimited):
        limiter.acquire()


def _spend(limiter, kind) -> int:
    """Calls of `kind` admitted until the budget refuses one."""
    spent = 0
    with budget(kind):
        while True:
            try:
                limiter.acquire()
            except RateLimited:
                return spent
            spent += 1


def test_a_money_backlog_leaves_the_interactive_floor_to_checkouts():
    """Issue 39 item 2: with 120 renewals due, 42 of 49 checkouts got 429 (money had no cap and took the
    whole budget). Interactive calls have a floor (20 %): while they are idle the others borrow only half
    of it, so the first checkouts after a quiet window are admitted at once; while they are being made
    the others leave its whole unused part."""
    limiter = RateLimiter(10, 60, key_for("k-floor-idle", "subscription_provider"), max_wait=0)
    assert _spend(limiter, MONEY) == 9  # ten less half the floor of two
    assert _spend(limiter, INTERACTIVE) == 1  # the half kept: a checkout after the backlog is admitted
    assert _spend(limiter, MONEY) == 0

    limiter = RateLimiter(10, 60, key_for("k-floor-active", "subscription_provider"), max_wait=0)
    with budget(INTERACTIVE):
        limiter.acquire()  # checkouts are being made
    assert _spend(limiter, MONEY) == 8  # the floor's unused part (one) is left
    assert _spend(limiter, INTERACTIVE) == 1
    assert _spend(limiter, BATCH) == 0


def test_the_floor_is_shared_by_every_process_of_the_key(redis_url):
    """Two processes' limiters on one Redis: the floor one process's checkouts need is kept from the other's
    backlog."""
    key = key_for("k-floor-shared", "subscription_provider")
    web = RateLimiter(10, 60, key, redis_url=redis_url, max_wait=0)
    jobs = RateLimiter(10, 60, key, redis_url=redis_url, max_wait=0)
    with budget(INTERACTIVE):
        web.acquire()
    assert _spend(jobs, MONEY) == 8
    assert _spend(web, INTERACTIVE) == 1


def test_threads_hitting_the_in_process_budget_at_once_start_no_expiry_timer_twice():
    """The in-process budget (`limits`' MemoryStorage, 5.8) schedules its expiry timer unlocked: two threads
    hitting it at once could start one timer twice, whose thread then died on a KeyError in `threading`
    (an exploration run's web threads hit it; fixed upstream in alisaifee/limits#352, not released). Its
    calls are serialized per limiter; pytest turns the dead thread's exception into this test's failure."""
    import sys
    import threading
    import time

    limiter = RateLimiter(limit=100_000, window_seconds=60, key="threads")
    rounds, at_once = 300, threading.Barrier(8)

    def hammer():
        with budget(MONEY):
            for _ in range(rounds):  # all at once, each round after the last round's timer has ended
                at_once.wait(10)
                limiter.acquire()
                time.sleep(0.012)

    switching = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave between any two bytecodes, as on a loaded machine
    try:
        threads = [threading.Thread(target=hammer) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(switching)
    assert limiter._memory.get_window_stats(limiter.item, limiter.key).remaining == 100_000 - 8 * rounds
