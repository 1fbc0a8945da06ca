"""Provider-call budget: requests to the subscription provider per operation, counted at the sandbox."""

from __future__ import annotations

import math

from bench.common import container, workdir
from billingctl.services import events
from billingctl.services.checkout import create_checkout
from billingctl.services.renewals import run_renewals
from billingctl.services.sync import sync_all
from jobs.schedule import JOBS

TARGETS = {"idle_poll": 1, "catch_up_10000_events": 100, "sync_all_5000": math.ceil(5000 / 100),
           "checkout_new_customer": 2, "checkout_warm_catalog": 1, "recording_with_activation": 2,
           "renewal_one_invoice": 1, "renewal_confirmation_poll": 1}


def run() -> dict:
    wd = workdir()
    c = container(f"sqlite:///{wd / 'budget.db'}", wd)
    store = c.sandbox.store

    def count(fn) -> int:
        before = store.count_requests("provider")
        fn()
        return store.count_requests("provider") - before

    figures = {}
    now = int(store.now())
    store.put_many("event", [{"id": f"ev_b{i:05d}", "occurred_at": now - 20_000 + i, "event_type": "customer_changed",
                              "content": {}} for i in range(10_000)])
    figures["catch_up_10000_events"] = count(lambda: events.poll(c))
    figures["idle_poll"] = count(lambda: events.poll(c))
    store.put_many("subscription", [{"id": f"sub_b{i}", "customer_id": f"cb{i}", "status": "active",
                                     "start_date": now, "current_term_end": now + 86400 * 30, "created_at": now,
                                     "updated_at": now, "coupons": [],
                                     "subscription_items": [{"item_price_id": "credits-basic-USD-monthly"}]}
                                    for i in range(5000)])
    store.put_many("customer", [{"id": f"cb{i}", "email": None, "created_at": now} for i in range(5000)])
    figures["sync_all_5000"] = count(lambda: sync_all(c, None))
    list(c.provider.list_item_prices())  # a warm catalog
    from billingctl.services.catalog import products

    products(c)
    checkouts = []
    # A new user: the provider's customer, then the subscription; a returning user: the subscription only.
    figures["checkout_new_customer"] = count(lambda: checkouts.append(create_checkout(c, "budget_user",
                                                                                      "credits-pro-USD-monthly")))
    figures["checkout_warm_catalog"] = count(lambda: create_checkout(c, "budget_user", "credits-basic-USD-monthly"))
    figures["recording_with_activation"] = count(lambda: c.sandbox.pay(checkouts[0]["order_id"]))
    c.close()

    # A renewal, measured alone: one subscription, one invoice due.
    wd2 = workdir()
    c = container(f"sqlite:///{wd2 / 'renewal.db'}", wd2)
    store = c.sandbox.store
    c.sandbox.pay(create_checkout(c, "renewal_user", "credits-pro-USD-monthly")["order_id"])
    store.advance_clock(31 * 86400)
    figures["renewal_one_invoice"] = count(lambda: run_renewals(c))  # the tick's list, charge and webhook
    # The workflow's record is confirmed by the provider's payment_succeeded, read by the poll's one page
    # (which the poll spends every minute anyway, and which confirms up to a hundred renewals' events).
    figures["renewal_confirmation_poll"] = count(lambda: events.poll(c))
    figures["renewal_tick_nothing_due"] = count(lambda: run_renewals(c))

    per_minute = {"poll": 60 / 15 * figures["idle_poll"], "renewals": figures["renewal_tick_nothing_due"] / 15}
    steady = sum(per_minute.values())
    figures["steady_state_requests_per_minute"] = round(steady, 2)
    figures["steady_state_share_of_60"] = round(steady / 60, 3)
    figures["targets"] = TARGETS
    figures["met"] = {k: figures[k] <= v for k, v in TARGETS.items()}
    figures["jobs_counted"] = [j.name for j in JOBS]
    c.close()
    return figures
