"""The demo behind `billingctl demo`: a newcomer's walk through the main job on the embedded default
(SQLite, in-process sandbox providers, no servers). Every step goes through the real services and
the real HTTP clients; it is re-runnable (each run uses new users) and finishes with a clean reconcile."""

from __future__ import annotations

import uuid

PRO, NSFW = "credits-pro-USD-monthly", "credits-pro-nsfw-USD-monthly"


class Narrator:
    def __init__(self, say, rich: bool):
        self.say, self.rich, self.n = say, rich, 0

    def step(self, title: str) -> None:
        self.n += 1
        if self.rich:
            from rich.console import Console

            Console(stderr=True).rule(f"[bold]{self.n}. {title}")
        else:
            self.say(f"\n{self.n}. {title}")

    def line(self, text: str) -> None:
        self.say(f"   {text}")


def run_demo(container, say=print, rich: bool = False) -> dict:
    from billingctl.adapters.db.engine import redact
    from billingctl.domain.errors import AlreadySubscribed
    from billingctl.services import events, orphans
    from billingctl.services.checkout import create_checkout
    from billingctl.services.payments import record_payment
    from billingctl.services.reconcile import reconcile
    from billingctl.services.reconcile.rules import subject
    from billingctl.services.renewals import run_renewals
    from billingctl.services.sync import cancel_subscription
    from billingctl.services.users import show_user

    sandbox = container.sandbox
    out = Narrator(say, rich)
    tag = uuid.uuid4().hex[:6]
    ada, bo, cy = f"ada_{tag}", f"bo_{tag}", f"cy_{tag}"
    say(f"database: {redact(container.settings.database_url)} (created and migrated on first use)")
    say(f"sandbox:  {container.settings.sandbox_db} (provider and orchestrator simulators, in-process)")

    out.step(f"{ada} starts an SFW checkout")
    co = create_checkout(container, ada, PRO)
    out.line(f"pending subscription {co['subscription_id']} (future, start over a year ahead), order "
             f"{co['order_id']}, {co['amount']} {co['currency_code']} minor units from the catalog")

    out.step("the payment settles on SFW_ADYEN; the signed webhook is recorded and activates the subscription")
    paid = sandbox.pay(co["order_id"], processor="SFW_ADYEN")
    user = show_user(container, ada)
    out.line(f"payment {paid['id']} SETTLED; credits={user['credits']} (ledger {user['ledger_sum']}); "
             f"sfw lock={user['sfw_processor']}; subscription {sandbox.subscription(co['subscription_id'])['status']}")

    out.step("the same webhook arrives twice more and the pollers see the payment too")
    for _ in range(2):
        sandbox.send_webhook("PAYMENT.STATUS", paid)
    late = [record_payment(container, paid, p)["outcome"] for p in ("event_poller", "settled_poller")]
    out.line(f"outcomes: {', '.join(late)}; credits still {show_user(container, ada)['credits']}")

    out.step(f"{bo} pays, but the orchestrator's webhook is lost: the settled-payments poller catches it")
    co_bo = create_checkout(container, bo, NSFW)
    lost = sandbox.pay(co_bo["order_id"], method="PAYPAL", drop_webhook=True)
    found = orphans.handle_payment(container, sandbox.summary(lost))  # what its list of settled payments holds
    polled = events.poll(container)
    out.line(f"settled-payments poller: {found}; event poll: {polled['events_processed']} events; {bo} credits="
             f"{show_user(container, bo)['credits']}, nsfw lock={show_user(container, bo)['nsfw_processor']}")

    out.step(f"a month later {bo}'s renewal comes due; the stored wallet is swapped for the vaulted card (NSFW)")
    sandbox.add_instrument(bo, "PAYMENT_CARD")
    sandbox.store.advance_clock(sandbox.subscription(co_bo["subscription_id"])["current_term_end"] - sandbox.now() + 1)
    renewals = run_renewals(container)
    outcomes = ", ".join(f"{k} {v}" for k, v in renewals["outcomes"].items())
    out.line(f"renewals: {outcomes}; {bo} credits={show_user(container, bo)['credits']} "
             "(log marker nsfw_renewal_card_substitution)")

    out.step(f"{cy}'s first checkout is cancelled, then its old session is paid: an orphan")
    co_cy = create_checkout(container, cy, PRO)
    cancel_subscription(container, co_cy["subscription_id"], "checkout abandoned", "demo")
    orphan = sandbox.pay(co_cy["order_id"])
    outcome = orphans.handle_payment(container, sandbox.store.get("payment", orphan["id"]))
    out.line(f"settled-payments poller: {outcome}; {cy} credits={show_user(container, cy)['credits']}")

    out.step(f"{ada} opens a second checkout of the plan she holds, then pays her first payment form again")
    try:
        create_checkout(container, ada, PRO)
    except AlreadySubscribed as refused:
        out.line(f"second checkout refused: {refused.message} (one live subscription per plan)")
    charged = sandbox.pay(co["order_id"])  # a second payment in the same form: a same-plan duplicate
    outcome = orphans.handle_payment(container, sandbox.store.get("payment", charged["id"]))
    refunded = sandbox.store.get("payment", charged["id"])["processor"]["amountRefunded"]
    out.line(f"recovery: {outcome}; refunded {refunded}; chat alert queued; credits still "
             f"{show_user(container, ada)['credits']}")

    out.step("reconcile: every settled payment recorded once, ledger and credits agree, subscriptions match")
    report = reconcile(container)
    own, foreign = _judged(sandbox, (ada, bo, cy), report["violations"])
    out.line("clean" if not own else f"{len(own)} violation(s) of this run: "
             + "; ".join(f"{v['check']} {subject(v)}" for v in own[:3]))
    if foreign:  # an earlier run's or another tool's data in the same files: not the demo's to judge
        out.line(f"{len(foreign)} violation(s) of other data in this database, not this run's: `billingctl "
                 f"reconcile` lists them; to start clean, remove {container.settings.sandbox_db} and the database "
                 "file (`make clean`)")

    say("\nnext: `billingctl health`, `billingctl users show " + ada + "`, `billingctl events list`, "
        "`billingctl orphans list`, `billingctl alerts list`")
    return {"users": {u: show_user(container, u) for u in (ada, bo, cy)}, "reconcile_ok": not own,
            "violations": own, "other_violations": len(foreign)}


def _judged(sandbox, users: tuple[str, ...], violations: list[dict]) -> tuple[list[dict], list[dict]]:
    """The violations that name this run's users or anything of theirs (payments, orders, subscriptions,
    invoices at the sandbox), and the others."""
    mine = set(users)
    for kind, owner in (("payment", "customerId"), ("subscription", "customer_id"), ("invoice", "customer_id")):
        for item in sandbox.store.all(kind):
            if item.get(owner) in users:
                mine.update(str(v) for v in (item.get("id"), item.get("orderId")) if v)
    own, foreign = [], []
    for violation in violations:
        ids = set()
        for value in violation.values():
            ids.update(value if isinstance(value, list) else [value])
        (own if ids & mine else foreign).append(violation)
    return own, foreign
