"""Operator commands for payments and locks, run as subprocesses on a shared sandbox."""

import json

import pytest

from billingctl.bootstrap import Container
from billingctl.services.checkout import create_checkout
from tests.helpers import billingctl

pytestmark = pytest.mark.e2e


def test_a_double_charge_is_closed_by_its_runbook(container, env):
    """Issue 38 item 6: the ReconcileViolations runbook on a double charge. Recording the second charge of a
    paid order is refused with the way out (it credited a second term without a warning); `payments
    refund` refunds it at the orchestrator, audited, and again is a no-op; reconcile then exits 0 (the
    refunded duplicate no longer counts)."""
    from sqlalchemy import select

    from billingctl.adapters.db.tables import audit_log

    co = create_checkout(container, "user_twice", "credits-pro-USD-monthly")
    first = container.sandbox.pay(co["order_id"])
    second = container.sandbox.pay(co["order_id"], drop_webhook=True)  # the same checkout charged again
    container.sandbox.store.put("payment", second["id"], {**second, "date": second["date"] - 60})
    assert billingctl(["reconcile"], env).returncode == 5
    refused = billingctl(["payments", "record", second["id"]], env)
    assert refused.returncode == 3 and f"already paid by {first['id']}" in refused.stderr
    assert f"payments refund {second['id']}" in refused.stderr
    term = json.loads(billingctl(["--json", "users", "show", "user_twice"], env).stdout)["credits"]
    assert term == 2000  # one term of the plan, nothing recorded by the refusal
    assert billingctl(["payments", "refund", second["id"], "--reason", "charged twice"], env).returncode == 3
    refunded = json.loads(billingctl(["--json", "payments", "refund", second["id"], "--reason", "charged twice",
                                      "--yes"], env).stdout)
    assert (refunded["outcome"], refunded["refunded"]) == ("refunded", second["amount"])
    again = billingctl(["--json", "payments", "refund", second["id"], "--reason", "charged twice", "--yes"], env)
    assert again.returncode == 0, again.stderr
    again = json.loads(again.stdout)
    assert again["outcome"] == "already_refunded" and again["credits_reversed"] == 0
    clean = billingctl(["--json", "reconcile"], env)
    assert clean.returncode == 0, clean.stdout
    with container.uow() as uow:
        assert len(uow.execute(select(audit_log).where(audit_log.c.action == "payments.refund")).all()) == 2



def test_pay_record_activate_and_inspect(container, env):
    co = create_checkout(container, "user_cli", "credits-pro-nsfw-USD-monthly")
    refused = billingctl(["activate", co["subscription_id"]], env)
    assert refused.returncode == 3
    assert refused.stderr.strip() == (f"error: no purchase exists for subscription {co['subscription_id']}: "
                                      "the payment was never recorded")
    paid = json.loads(billingctl(["--json", "sandbox", "pay", co["order_id"], "--drop-webhook"], env).stdout)
    recorded = json.loads(billingctl(["--json", "payments", "record", paid["id"]], env).stdout)
    assert recorded["outcome"] == "recorded" and recorded["credits_applied"] == 3000
    again = json.loads(billingctl(["--json", "payments", "record", paid["id"]], env).stdout)
    assert again["outcome"] == "duplicate"
    user = json.loads(billingctl(["--json", "users", "show", "user_cli"], env).stdout)
    assert (user["credits"], user["ledger_sum"], user["nsfw_processor"]) == (3000, 3000, "NSFW_SEGPAY")
    assert json.loads(billingctl(["--json", "activate", co["subscription_id"]], env).stdout)["outcome"] == \
        "already_active"


def test_lock_commands_exit_codes(container, env):
    co = create_checkout(container, "user_l", "credits-pro-USD-monthly")
    container.sandbox.pay(co["order_id"])
    assert json.loads(billingctl(["--json", "lock", "show", "user_l"], env).stdout)["sfw_processor"] == "SFW_STRIPE"
    assert billingctl(["lock", "show", "nobody"], env).returncode == 3
    no_yes = billingctl(["lock", "clear", "user_l", "--lane", "sfw", "--reason", "test"], env)
    assert no_yes.returncode == 3 and "--yes" in no_yes.stderr
    refused = billingctl(["lock", "clear", "user_l", "--lane", "sfw", "--reason", "test", "--yes"], env)
    assert refused.returncode == 3 and "successful transaction" in refused.stderr
    assert billingctl(["lock", "clear", "user_l", "--lane", "purple", "--reason", "x", "--yes"], env).returncode == 2
    assert json.loads(billingctl(["--json", "lock", "show", "user_l"], env).stdout)["sfw_processor"] == "SFW_STRIPE"
    dry = json.loads(billingctl(["--json", "--dry-run", "lock", "backfill-mid"], env).stdout)
    assert dry == {"dry_run": True, "filled": [], "without_history": []}
    assert json.loads(billingctl(["--json", "lock", "repair", "user_q", "--lane", "nsfw"], env).stdout)["outcome"] == \
        "no_history"


def test_activate_pending_lists_and_retries(container, env):
    co = create_checkout(container, "user_p", "credits-basic-USD-monthly")
    container.sandbox.store.add_fault("provider", "503", path="update_for_items", count=1)
    container.sandbox.pay(co["order_id"])
    health = billingctl(["--json", "health"], env)
    assert health.returncode == 3
    assert any(c["name"] == "pending_activations" and not c["ok"] for c in json.loads(health.stdout)["checks"])
    assert json.loads(billingctl(["--json", "activate", "--pending"], env).stdout) == {"completed": 1, "failed": 0}
    assert billingctl(["poll"], env).returncode == 0
    assert billingctl(["--json", "health"], env).returncode == 0
    c = Container(container.settings)
    assert c.sandbox.subscription(co["subscription_id"])["status"] == "active"


def test_quota_products_and_cleanup_verbs(container, env):
    create_checkout(container, "user_q", "credits-pro-nsfw-USD-monthly")
    quota = json.loads(billingctl(["--json", "quota", "show", "user_q"], env).stdout)
    daily = quota["windows"][0]
    assert (daily["window"], daily["used"], daily["limit"], daily["customer_limit"]) == ("daily", 1, 5, 4)
    assert daily["next_slot_frees_at"] and quota["enforced"] is False
    products = json.loads(billingctl(["--json", "products", "list"], env).stdout)
    assert {p["item_price_id"] for p in products} >= {"credits-pro-USD-monthly", "credits-pro-nsfw-USD-monthly"}
    dry = json.loads(billingctl(["--json", "--dry-run", "checkout", "cleanup"], env).stdout)
    # the checkout is younger than a day, and no checkout authorization waits for its capture
    assert dry == {"dry_run": True, "would_cancel": [], "would_capture": [], "would_void": []}


def test_freeze_renewals_and_velocity_verbs(container, env):
    co = create_checkout(container, "user_f", "credits-pro-USD-monthly")
    container.sandbox.pay(co["order_id"])
    unknown = billingctl(["users", "freeze", "user_typo", "--reason", "fraud", "--yes"], env)
    assert (unknown.returncode, unknown.stderr.strip()) == (3, "error: user user_typo not found")
    no_yes = billingctl(["users", "freeze", "user_f", "--reason", "fraud"], env)
    assert no_yes.returncode == 3
    dry = json.loads(billingctl(["--json", "--dry-run", "users", "freeze", "user_f", "--reason", "fraud"], env).stdout)
    assert dry["dry_run"] is True and dry["already_frozen"] is False
    frozen = json.loads(billingctl(["--json", "users", "freeze", "user_f", "--reason", "fraud", "--notify", "--yes"],
                                   env).stdout)
    assert frozen["changed"] is True
    again = json.loads(billingctl(["--json", "users", "freeze", "user_f", "--reason", "fraud", "--yes"], env).stdout)
    assert again["changed"] is False
    user = json.loads(billingctl(["--json", "users", "show", "user_f"], env).stdout)
    assert user["frozen"] is True and user["frozen_reason"] == "fraud" and len(user["recent_payments"]) == 1
    assert json.loads(billingctl(["--json", "renewals", "run"], env).stdout) == {"outcomes": {}, "errors": []}
    assert json.loads(billingctl(["--json", "renewals", "list", "--user", "user_f"], env).stdout) == []
    assert json.loads(billingctl(["--json", "fraud", "velocity"], env).stdout)["offenders"] == []
    thawed = json.loads(billingctl(["--json", "users", "unfreeze", "user_f", "--reason", "cleared", "--yes"],
                                   env).stdout)
    assert (thawed["changed"], thawed["held_payments"]) == (True, [])
    assert json.loads(billingctl(["--json", "users", "show", "user_f"], env).stdout)["frozen"] is False


def test_orphans_verbs(container, env):
    assert json.loads(billingctl(["--json", "orphans", "run"], env).stdout) == {"outcomes": {}, "cursor": None}
    assert json.loads(billingctl(["--json", "orphans", "list"], env).stdout) == []
    assert billingctl(["orphans", "show", "pay_nope"], env).returncode == 3
    both = billingctl(["orphans", "resolve", "pay_nope", "--refund", "--mark-handled", "--reason", "x", "--yes"], env)
    assert both.returncode == 2 and "exactly one" in both.stderr
    no_yes = billingctl(["orphans", "resolve", "pay_nope", "--refund", "--reason", "x"], env)
    assert no_yes.returncode == 3 and "--yes" in no_yes.stderr


def test_trace_is_the_first_command_of_i_paid_and_have_no_credits(container, env):
    """Issue 38 item 12 through the command: the timeline names the lost payment and the check, exit 5;
    once recorded, the books agree (exit 0)."""
    co = create_checkout(container, "user_no_credits", "credits-pro-USD-monthly")
    lost = container.sandbox.pay(co["order_id"], drop_webhook=True)
    flagged = billingctl(["--json", "trace", "user_no_credits"], env)
    assert flagged.returncode == 5
    report = json.loads(flagged.stdout)
    assert [(d["check"], d["payment"]) for d in report["disagreements"]] == [("payment_unrecorded", lost["id"])]
    assert billingctl(["payments", "record", lost["id"]], env).returncode == 0
    agreed = billingctl(["trace", lost["id"]], env)
    assert agreed.returncode == 0 and "the books agree" in agreed.stderr and lost["id"] in agreed.stdout


def test_lock_list_names_the_users_behind_a_processor_lock_alert(container, env):
    """Issue 38 item 7: ProcessorLockDrift and ProcessorLockUnknownProcessor carry a lane, and their
    runbooks asked for a user no command listed. `lock list --problem` lists them, with the payment."""
    co = create_checkout(container, "user_drifting", "credits-pro-USD-monthly")
    container.sandbox.pay(co["order_id"], processor="SFW_STRIPE")  # locked on SFW_STRIPE
    other = create_checkout(container, "user_drifting", "credits-basic-USD-monthly")
    drifted = container.sandbox.pay(other["order_id"], processor="SFW_ADYEN")  # settles on the other one
    unknown_co = create_checkout(container, "user_acme", "credits-pro-USD-monthly")
    unknown = container.sandbox.pay(unknown_co["order_id"], processor="ACME_PAY")
    listed = billingctl(["--json", "lock", "list", "--problem", "drift"], env)
    assert listed.returncode == 0, listed.stderr
    drift = json.loads(listed.stdout)
    assert [(r["user_id"], r["lane"], r["locked"], r["settled"], r["payment_id"]) for r in drift] == [
        ("user_drifting", "sfw", "SFW_STRIPE", "SFW_ADYEN", drifted["id"])]
    odd = json.loads(billingctl(["--json", "lock", "list", "--problem", "unknown"], env).stdout)
    assert [(r["user_id"], r["payment_id"]) for r in odd] == [("user_acme", unknown["id"])]
    assert billingctl(["lock", "list", "--problem", "nonsense"], env).returncode == 2
