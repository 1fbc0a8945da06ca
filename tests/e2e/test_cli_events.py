"""`billingctl poll | sync | sync-all | invalidate | subscriptions | events` as an operator runs them."""

import json

import pytest

from billingctl.services.checkout import create_checkout
from tests.helpers import billingctl

pytestmark = pytest.mark.e2e






def test_poll_sync_invalidate_cancel_and_inspect(container, env):
    co = create_checkout(container, "user_e", "credits-pro-USD-monthly")
    container.sandbox.pay(co["order_id"])
    polled = json.loads(billingctl(["--json", "poll"], env).stdout)
    assert polled["events_failed"] == 0 and polled["events_processed"] >= 3
    user = json.loads(billingctl(["--json", "users", "show", "user_e"], env).stdout)
    assert user["credits"] == 2000
    assert billingctl(["poll", "--since", "last tuesday"], env).returncode == 2
    dry = json.loads(billingctl(["--json", "--dry-run", "sync", co["subscription_id"]], env).stdout)
    assert dry["dry_run"] is True and dry["changed"] is False
    assert billingctl(["sync", "sub_missing"], env).returncode == 3
    synced = json.loads(billingctl(["--json", "sync-all", "--since", "2020-01-01T00:00:00Z"], env).stdout)
    assert synced["listed"] == 1 and synced["failed"] == []
    assert json.loads(billingctl(["--json", "invalidate", "user_e"], env).stdout)["invalidated"] is True
    no_yes = billingctl(["subscriptions", "cancel", co["subscription_id"], "--reason", "test"], env)
    assert no_yes.returncode == 3
    cancelled = billingctl(["--json", "subscriptions", "cancel", co["subscription_id"], "--reason", "test", "--yes"],
                           env)
    assert json.loads(cancelled.stdout)["status"] == "cancelled"
    shown = json.loads(billingctl(["--json", "subscriptions", "show", co["subscription_id"], "--customer",
                                   "user_e"], env).stdout)
    assert shown["status"] == "cancelled"
    inbox = json.loads(billingctl(["--json", "events", "list", "--source", "provider"], env).stdout)
    assert inbox and {row["status"] for row in inbox} == {"processed"} and {r["source"] for r in inbox} == {"provider"}
    paid = next(r for r in inbox if r["event_type"] == "payment_succeeded")
    assert paid["seen_by"] == ["poller"]
    shown = json.loads(billingctl(["--json", "events", "show", str(paid["id"])], env).stdout)
    assert shown["payload"]["event_type"] == "payment_succeeded"
    assert billingctl(["events", "replay", str(paid["id"]), "--reason", "check"], env).returncode == 3  # no --yes
    replayed = json.loads(billingctl(["--json", "events", "replay", str(paid["id"]), "--reason", "check", "--yes"],
                                     env).stdout)
    assert replayed["status_after"] == "processed"
    assert json.loads(billingctl(["--json", "users", "show", "user_e"], env).stdout)["credits"] == 2000  # no-op
    assert billingctl(["events", "show", "999999"], env).returncode == 3
    watch = billingctl(["--json", "poll", "--watchdog"], env)
    assert watch.returncode == 0 and json.loads(watch.stdout)["stale"] is False
