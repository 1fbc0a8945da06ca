"""A 5,000-renewal day against the provider's real limit (issue 39 item 2): the renewals tick, the poll and
checkouts arriving all day share one key's 60 requests a minute. Each operation spends what
`bench/budget.py` counts at the sandbox (a renewal: the tick's list page per hundred, and before decision
151 two money calls from its webhook; its confirmation: the poll's pages; a checkout: two calls for a new
customer, one for a returning one). The budget is the production `RateLimiter` (its classes, caps and
floor) on a virtual clock, so a day runs in seconds; it is a model of the call pattern, not of the
services' latency. Printed before decisions 151 and 152 (two money calls a renewal, no floor), with the
floor alone, and now: when the renewals finished, and how many checkouts the budget refused."""

from __future__ import annotations

import random
import sys

RENEWALS = 5000
DAY = 86_400
LIMIT, WINDOW = 60, 60
CHECKOUTS_PER_HOUR = 120  # one every 30 s on average, a new customer one time in two
EVENTS_PER_RENEWAL = 3  # payment_succeeded, invoice_updated, subscription_renewed
POLL_EVERY, TICK_EVERY = 15, 60


class VirtualTime:
    """time.time / monotonic / sleep for the limiter and its `limits` storage: sleeping moves the clock."""

    def __init__(self):
        self.now = 1_800_000_000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _day(two_money_calls: bool, floor: bool, seed: int = 7) -> dict:
    import limits.storage.memory as memory

    from billingctl.adapters import ratelimit
    from billingctl.adapters.ratelimit import BATCH, INTERACTIVE, MONEY, RateLimiter, budget, key_for
    from billingctl.domain.errors import RateLimited

    clock = VirtualTime()
    saved = memory.time, ratelimit.time
    memory.time = ratelimit.time = clock
    try:
        limiter = RateLimiter(LIMIT, WINDOW, key_for(f"day-{two_money_calls}-{floor}", "subscription_provider"),
                              max_wait=0, sleep=clock.sleep)
        if not floor:
            limiter.floor = 0  # before decision 152: money bounded only by the whole budget
        start = clock.now
        rng = random.Random(seed)
        arrivals = sorted(rng.uniform(0, DAY) for _ in range(CHECKOUTS_PER_HOUR * 24))
        due, listed, money_owed, events_unread = RENEWALS, 0, 0, 0
        checkouts = refused = calls = 0
        finished_at = None
        next_poll = next_tick = 0.0

        def spend(kind: str) -> bool:
            nonlocal calls
            with budget(kind, no_wait=True):
                try:
                    limiter.acquire()
                except RateLimited:
                    return False
            calls += 1
            return True

        second = 0
        while second < DAY:
            clock.now = start + second
            while arrivals and arrivals[0] <= second:  # checkouts first: a person waits on each
                arrivals.pop(0)
                checkouts += 1
                needed = 2 if rng.random() < 0.5 else 1
                if not all(spend(INTERACTIVE) for _ in range(needed)):
                    refused += 1
            if second >= next_tick and due:  # the renewals tick: one list page, then its charges' webhooks
                if spend(BATCH):
                    page = min(100, due)
                    due -= page
                    listed += page
                    money_owed += page * (2 if two_money_calls else 0)
                    events_unread += page * EVENTS_PER_RENEWAL
                next_tick = second + TICK_EVERY
            while money_owed and spend(MONEY):  # the webhooks' provider calls (renewals of the old policy)
                money_owed -= 1
            if second >= next_poll:
                if spend(BATCH):
                    events_unread = max(0, events_unread - 100)
                next_poll = second + POLL_EVERY
            if finished_at is None and not due and not money_owed and not events_unread:
                finished_at = second
            second += 1
        return {"renewals": RENEWALS, "finished_after_hours": round(finished_at / 3600, 2) if finished_at else None,
                "checkouts": checkouts, "checkouts_refused_for_budget": refused, "provider_calls": calls}
    finally:
        memory.time, ratelimit.time = saved


def run() -> dict:
    return {"before_151_and_152": _day(two_money_calls=True, floor=False),
            "floor_only_152": _day(two_money_calls=True, floor=True),
            "now_151_and_152": _day(two_money_calls=False, floor=True),
            "limit": f"{LIMIT} per {WINDOW} s", "checkouts_per_hour": CHECKOUTS_PER_HOUR}


if __name__ == "__main__":
    import json

    json.dump(run(), sys.stdout, indent=1)
    print()
