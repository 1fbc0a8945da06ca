"""The demo behind `billingctl demo`: a newcomer's walk through the main job, on the embedded
default (SQLite, in-process sandbox providers). Every step goes through the real services."""

from __future__ import annotations

import uuid


def run_demo(container, say=print) -> dict:
    from billingctl.adapters.db.engine import redact
    from billingctl.services.checkout import create_checkout
    from billingctl.services.payments import record_payment
    from billingctl.services.users import show_user

    say(f"database: {redact(container.settings.database_url)} (created and migrated on first use)")
    say(f"sandbox:  {container.settings.sandbox_db} (provider and orchestrator simulators, in-process)")
    user_id = f"demo_{uuid.uuid4().hex[:8]}"

    say(f"\n1. {user_id} starts an NSFW checkout; the amount comes from the provider's catalog")
    checkout = create_checkout(container, user_id, "credits-pro-nsfw-USD-monthly")
    say(f"   pending subscription {checkout['subscription_id']} (status future), order {checkout['order_id']}, "
        f"{checkout['amount']} {checkout['currency_code']} minor units")

    say("2. the shopper pays; the orchestrator delivers its signed webhook three times")
    payment = container.sandbox.pay(checkout["order_id"], duplicates=3)
    say(f"   payment {payment['id']} SETTLED on {payment['processor']['name']}")

    say("3. the event poller and the settled-payments poller see the same payment later")
    late = [record_payment(container, payment, path)["outcome"] for path in ("event_poller", "settled_poller")]
    say(f"   outcomes: {', '.join(late)}")

    user = show_user(container, user_id)
    remote = container.sandbox.subscription(checkout["subscription_id"])["status"]
    say(f"\nresult: credits={user['credits']} (ledger {user['ledger_sum']}), purchases={user['purchases']}, "
        f"nsfw lock={user['nsfw_processor']} / {user['nsfw_processor_mid']}, subscription at provider={remote}")
    say("next: `billingctl users show " + user_id + "`, `billingctl lock show " + user_id + "`, `billingctl health`")
    return {"user_id": user_id, "credits": user["credits"], "purchases": user["purchases"],
            "nsfw_processor": user["nsfw_processor"], "subscription_status": remote}
