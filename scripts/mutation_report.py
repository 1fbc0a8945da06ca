"""Survivors of `make mutation`, each with the line it changed: reads mutmut's results (mutants/*.meta)
and the mutated sources, so hundreds of survivors need no `mutmut show` each.

    python scripts/mutation_report.py             # score and survivors, one line each
    python scripts/mutation_report.py --counts    # the score only
    python scripts/mutation_report.py --markdown  # docs/mutation-survivors.md: every survivor and why

Why a survivor is equivalent or accepted is written once per kind in REASONS below (matched on the file,
the function and, optionally, a piece of the changed line); a survivor no reason matches is printed as
UNEXPLAINED, which is work to do: a test to write, or a reason to add here after reading the mutant.
"""

from __future__ import annotations

import ast
import difflib
import json
import sys
from pathlib import Path

# mutmut's exit codes (mutmut/stats.py): 0 survived; 5 and 33 no test reaches the mutant; None not checked
# yet; 34 skipped; anything else (1, 3, timeouts, signals) killed.
SURVIVED, NO_TESTS, NOT_CHECKED, SKIPPED = {0}, {5, 33}, {None}, {34}


_PAYMENTS = "billingctl/services/payments/"  # the payments area, one module per part

# (file, function name as mutmut spells it, a piece of the changed line or "" or "== " and the whole changed
# line, why it is not killed)
_RACE = ("accepted: a guard against another process changing the row between the read and the write; "
         "single-threaded tests cannot tell it apart")
_SQLITE = ("equivalent on SQLite, where identifiers and keywords are case-insensitive (the mutation run uses "
           "SQLite; the PostgreSQL tests reject it)")
_EXISTS = ("equivalent: `select(None)` renders SELECT NULL … WHERE …, which returns a row exactly when one "
           "matches, and only the row's existence is read")
_CRASH = "accepted: crash points are named by the crash tests, which run in subprocesses no mutant reaches"
_PROGRESS = ("accepted: the progress bar's arguments, checked by the CLI's pseudo-terminal tests, which run in "
             "subprocesses no mutant reaches")
_OWN_CANCELLED = ("equivalent: the orphan's own subscription is cancelled (that is what makes it an orphan), "
                  "so the query's active-or-non-renewing filter leaves it out anyway")
_OLD_ORDER = ("equivalent: without the new order id the payment's old order finds the old checkout, which "
              "supplies the same user, plan and (no) invoice; the metadata names the new subscription")
_NO_QUERY = "equivalent: without a query there is no verify parameter, and both spellings answer missing"
_LIMIT = ("accepted: the limit bounds the orchestrator reads; without it the same card (or an older checkout's) "
          "is found")
_SETTLED = "equivalent: SETTLED is list_payments' default status"
_ONE_CENT = ("accepted: differs only for a payment of zero or one cent or without an amount, which a settled "
             "payment never is")
_RANDOM_KEY = ("equivalent: without a key the HTTP client draws one per call, which the call's retries reuse; "
               "the start-date key differs between attempts too, so no test (nor the provider) can tell them "
               "apart")
_ACTIVATION_LOCK = ("accepted: the activation skips the per-subscription lock (a changed default `_locked=True`, or "
                    "the lock taken only for a dry run), which serializes two activations of one subscription "
                    "running at once (the activations job beside an operator's `billingctl subscriptions "
                    "activate`); the tests activate one at a time")
_READ_ONLY = ("equivalent: the block only reads; in one transaction (rolled back at its end) or statement "
              "by statement it reads the same (autocommit saves a round trip)")
_TERM_FALLBACK = ("accepted: decision 18's fallback for a start answered without a term end; the real provider "
                  "(and the sandbox after it) gives every started subscription its term, so no test reaches it")
_EVERY_AMOUNT = ("equivalent: both callers (recording and a status update) pass the amount, so the default for a "
                 "missing one is never read")
_OWN_CHECKS = ("equivalent: orphan recovery records a payment only after its own checks (the user not frozen, the "
               "subscription not cancelled) or on a subscription the payment is already bought on, so the gates "
               "would pass it anyway; only a freeze or cancellation between the two reads tells them apart")
_CHECKOUT_PLAN = ("equivalent: without the checkout's plan the next fallback reads the plan of the checkout's "
                  "subscription row, which the checkout wrote with the same plan")
_NOT_DIGITS = ("equivalent: the text then goes through the all-digits match, and no other JSON value (a float, a "
               "boolean, null, a list, an object) nor the filler text is written as digits alone, so it is refused "
               "either way")
_COUPONS = ("equivalent: the insert takes only the table's columns from the values, and the column's default is "
            "the same empty list")
REASONS: list[tuple[str, str, str, str]] = [
    ("billingctl/services/media.py", "x_signature", "XX=XX",
     "equivalent: the unpadded base64 of a 32-byte digest never ends in X (its last character carries four "
     "bits and two zero bits)"),
    ("billingctl/services/media.py", "x_check_origin", "parts.scheme and parts.netloc",
     "equivalent: an origin with only a scheme or only a host never starts with a single /, so the second "
     "branch refuses it too"),
    ("billingctl/services/media.py", "x_verify", "or True else url",
     "accepted: differs only for a relative URL with a #fragment, which no client sends to the edge"),
    ("billingctl/services/media.py", "x_verify", "(parts.query) or True",
     _NO_QUERY),
    ("billingctl/services/media.py", "x_verify", '"XXXX"',
     _NO_QUERY),
    ("billingctl/services/orphans.py", "x__refund_duplicate", "crash_point",
     _CRASH),
    ("billingctl/services/orphans.py", "x__resubscribe", "crash_point",
     _CRASH),
    ("billingctl/services/orphans.py", "x_resolve", "Refused(None)",
     "accepted: reached only when another runner claims the row between resolve's two statements"),
    (_PAYMENTS + "activation.py", "x__start_at_provider", "CancelledAtProvider(None)",
     "equivalent: activate_subscription catches the exception and never reads its argument (it orphans the "
     "subscription it was activating)"),
    (_PAYMENTS + "activation.py", "x__first_term_invoice", "",
     "accepted: a subscription whose first start is read back has exactly one invoice, its first term's, so "
     "the order of the list cannot matter"),
    ("billingctl/services/renewals.py", "x__exhaust", "apply_remote_subscription",
     "equivalent: the source only names a log field, and `force` only matters for an answer older than our "
     "copy, which the provider's answer to our own cancel never is"),
    ("billingctl/services/renewals.py", "x__latest_nsfw_checkout_token", "None)",
     _LIMIT),
    ("billingctl/adapters/db/purchases.py", "xǁPurchasesǁlatest_on_lane", "limit(None)",
     _LIMIT),
    (_PAYMENTS + "refunds.py", "x_reverse_refund", "lock(None)",
     "accepted: the user's row lock serializes concurrent refund reports; single-threaded tests cannot see it"),
    (_PAYMENTS + "refunds.py", "x_reverse_refund", '["amount"] or 1), 1)',
     "equivalent: max(…, 1) already turns a missing amount into 1"),
    ("billingctl/adapters/db/locks.py", "xǁProcessorLocksǁensure", "USER_ID", _SQLITE),
    ("billingctl/adapters/db/locks.py", "xǁProcessorLocksǁensure", "deleted_at is null", _SQLITE),
    ("billingctl/adapters/db/locks.py", "xǁProcessorLocksǁensure", "DELETED_AT IS NULL", _SQLITE),
    ("billingctl/adapters/db/locks.py", "xǁProcessorLocksǁrelock", "where(_live(user_id), )", _RACE),
    ("billingctl/adapters/db/locks.py", "xǁProcessorLocksǁclear", "where(_live(user_id), )", _RACE),
    ("billingctl/adapters/db/locks.py", "xǁProcessorLocksǁfill_mid", "", _RACE),
    ("billingctl/adapters/db/purchases.py", "xǁTransactionsǁcaptured_per_customer_since", "coalesce",
     "equivalent: the sum runs over at least one row per group and amount is NOT NULL"),
    ("webhooks_app/session.py", "x__verify", "and False",
     "equivalent: PyJWT requires the aud (iss) claim whenever an audience (issuer) is passed to decode"),
    ("webhooks_app/session.py", "x__verify", 'claims["exp"] - now >= max_age',
     "accepted: differs only when exp - now equals the maximum to the microsecond"),
    ("billingctl/services/processor_lock.py", "x_repair", "sorted(history",
     "accepted: the orchestrator lists payments by date; the sort defends against a list in another order"),
    ("billingctl/services/orphans.py", "x__finish_resubscription", "rderId", _OLD_ORDER),
    ("billingctl/services/orphans.py", "x__finish_resubscription", "ORDERID", _OLD_ORDER),
    ("billingctl/services/orphans.py", "x__finish_resubscription", '"orderid"', _OLD_ORDER),
    ("billingctl/services/orphans.py", "x__finish_resubscription", '"metadata": {**',
     "equivalent: the plan and the checkout supply the lane and the plan the dropped metadata held"),
    ("billingctl/services/renewals.py", "x__charged", "count_authorization(",
     "equivalent: the same authorization is counted again, idempotently by its payment id, when the answer "
     "is recorded"),
    ("billingctl/services/renewals.py", "x_attempt_invoice", "count_authorization(",
     "equivalent: the same authorization is counted again, idempotently by its payment id, when the answer "
     "is recorded (`_charged`, then recording)"),
    ("billingctl/services/orphans.py", "x__recorded_on", "autocommit",
     "equivalent: one read answers the same inside a transaction or outside one"),
    ("billingctl/services/orphans.py", "x__active_same_plan", "holding_plan(user_id, plan, None)",
     _OWN_CANCELLED),
    ("billingctl/services/orphans.py", "x__recover", "exclude=None",
     _OWN_CANCELLED),
    ("billingctl/services/orphans.py", "x_attempt", "item_failed(",
     "equivalent: the arguments of the failure's log line (its counter is asserted through the outcome)"),
    ("billingctl/adapters/db/orphans.py", "xǁOrphansǁclaim", "",
     "equivalent on SQLite, where the claim's read and its update run in one write transaction (BEGIN "
     "IMMEDIATE), so no other runner can change the row between them; on PostgreSQL the two-runner test "
     "(`test_same_plan_duplicate_refunds_once_even_with_two_runners`) needs them; `== None` is rendered as "
     "IS NULL, and every path after a claim writes updated_at again"),
    ("billingctl/services/orphans.py", "x__claim", "or True", _RACE),
    ("billingctl/services/orphans.py", "x_run_orphans", "progress(",
     _PROGRESS),
    ("billingctl/services/orphans.py", "x__read_cursor", "or True",
     "equivalent: parse_time(None) is None"),
    ("billingctl/adapters/db/fraud.py", "xǁFraudEventsǁexists", "select(None)", _EXISTS),
    ("billingctl/adapters/db/purchases.py", "xǁPurchasesǁexists_for_payment", "select(None)", _EXISTS),
    ("billingctl/adapters/db/purchases.py", "xǁPurchasesǁexists_for_subscription", "select(None)", _EXISTS),
    ("billingctl/adapters/db/purchases.py", "xǁPurchasesǁgates", "select(None).where(purchase.c.transaction_id",
     _EXISTS),
    (_PAYMENTS + "recording.py", "x__record_locally", "_unrecorded_gates(uow, facts) if", _OWN_CHECKS),
    (_PAYMENTS + "recording.py", "x__record_locally", "crash_point", _CRASH),
    (_PAYMENTS + "recording.py", "x__record_locally", 'coupon_ids', _COUPONS),
    (_PAYMENTS + "recording.py", "x__record_locally", 'COUPON_IDS', _COUPONS),
    (_PAYMENTS + "recording.py", "x__record_locally", '"credits_applied": facts.credits if',
     "equivalent: a new purchase is the first use of its ledger key (`payment:<id>`, written only with the "
     "purchase, in the same transaction), so the credits are always applied on this branch"),
    ("billingctl/adapters/db/purchases.py", "xǁLedgerǁapply", '["SOURCE_KEY"]', _SQLITE),
    ("billingctl/adapters/db/purchases.py", "xǁPurchasesǁadd", '["TRANSACTION_ID"]', _SQLITE),
    ("billingctl/adapters/db/purchases.py", "xǁTransactionsǁsave", '["TRANSACTION_ID"]', _SQLITE),
    ("billingctl/adapters/db/purchases.py", "xǁTransactionsǁsave", 'values.pop("amount", None)', _EVERY_AMOUNT),
    ("billingctl/adapters/db/purchases.py", "xǁTransactionsǁsave", 'values.pop("amount", )', _EVERY_AMOUNT),
    ("billingctl/adapters/db/purchases.py", "xǁTransactionsǁsave", 'values.pop("amount", 1)', _EVERY_AMOUNT),
    ("billingctl/adapters/db/purchases.py", "xǁPurchasesǁfirst_of_subscription", "order_by(None)",
     "accepted: without the order SQLite (the mutation run's database) reads a table in rowid order, which is "
     "the id order; PostgreSQL promises no order, so the query keeps it"),
    ("billingctl/adapters/db/purchases.py", "xǁPurchasesǁassign_invoice", "== )",
     "equivalent: the only invoice ever assigned for a checkout's subscription is its first term's (activation "
     "looks that one up), so writing it over an assigned one writes the same value"),
    ("billingctl/adapters/db/locks.py", "xǁProcessorLocksǁlock_first", "_lock_statement(None,",
     "equivalent on SQLite: without a dialect the statement is SQLite's insert, which is the mutation run's "
     "database; the PostgreSQL tests reject it"),
    ("billingctl/adapters/db/orphans.py", "xǁOrphansǁopen", "PAYMENT_ID", _SQLITE),
    ("billingctl/adapters/db/purchases.py", "xǁTransactionsǁsuccesses_on", "select(None)",
     "equivalent: `select(None)` returns one row per matching transaction, and only their number is read"),
    ("billingctl/adapters/db/purchases.py", "xǁPurchasesǁpaying_invoice", "order_by(None)",
     "accepted: one purchase pays an invoice (reconcile reports a second as invoice_paid_twice); the order "
     "only picks among such violations"),
    ("billingctl/services/renewals.py", "x_run_renewals", "started >= limit",
     "accepted: differs only when the tick's elapsed time equals its budget to the clock's resolution"),
    ("billingctl/services/renewals.py", "x_run_renewals", "progress(",
     _PROGRESS),
    ("billingctl/services/fraud_quota.py", "x_show", "now, )",
     "equivalent: CUSTOMER is authorization_quota's default initiator"),
    ("billingctl/adapters/db/purchases.py", "xǁTransactionsǁfirst_merchant_id",
     '== transaction.c.processor_merchant_id != "",',
     "equivalent: in SQL, NULL != '' is NULL, so the other condition already leaves a NULL merchant id out"),
    ("billingctl/services/orphans.py", "x_run_orphans", "list_payments(from_date=cursor)", _SETTLED),
    ("billingctl/services/processor_lock.py", "x_repair", "list_payments(customer_id=user_id)", _SETTLED),
    ("billingctl/services/processor_lock.py", "x_repair", "Refused(None)",
     "accepted: reached only when a settle locks the lane between the repair's read and its write"),
    ("billingctl/services/renewals.py", "x_list_attempts", "",
     "accepted: the default page size of an operator's listing (every caller names its own limit or reads "
     "fewer rows)"),
    ("webhooks_app/session.py", "x__verify", "== )", "equivalent: PyJWT's default leeway is 0"),
    (_PAYMENTS + "followups.py", "x_retry_pending", "hold(None)", _RACE),
    (_PAYMENTS + "refunds.py", "x_reverse_refund", '["amount"] or 0), 2)', _ONE_CENT),
    (_PAYMENTS + "invoice_record.py", "x_report_to_provider",
     '== container.provider.record_payment(row["invoice_id"], row["amount"] or 1, row["transaction_id"])',
     _ONE_CENT),
    (_PAYMENTS + "invoice_record.py", "x_report_to_provider",
     '== container.provider.record_payment(row["invoice_id"], None, row["transaction_id"])',
     "accepted: without an amount the provider records the invoice's amount due (as Chargebee does), which is "
     "the purchase's amount for every invoice our checkouts and renewals pay"),
    (_PAYMENTS + "invoice_record.py", "x_report_to_provider", "crash_point", _CRASH),
    (_PAYMENTS + "followups.py", "x__complete_followups", "container.uow(autocommit=",
     "equivalent: the unit of work only reads the unreported purchases; with or without autocommit it "
     "writes nothing"),
    (_PAYMENTS + "activation.py", "x__start_at_provider", "subscription_id, now, idempotency_key=None)",
     _RANDOM_KEY),
    (_PAYMENTS + "activation.py", "x__start_at_provider", "== subscription_id, now, )", _RANDOM_KEY),
    (_PAYMENTS + "followups.py", "x_complete_followups", "budget(None)",
     "equivalent: a budget class without a share is uncapped, as money is (ratelimit.SHARES caps only the "
     "interactive and batch classes); the class is read nowhere else"),
    ("billingctl/services/orphans.py", "x__recover", 'get("amount") or 1) > 0', _ONE_CENT),
    ("billingctl/services/orphans.py", "x__recover", 'get("amount") or 0) >= 0', _ONE_CENT),
    ("billingctl/services/orphans.py", "x__recover", 'get("amount") or 0) > 1', _ONE_CENT),
    ("billingctl/services/orphans.py", "x__reverse_credits", 'get("amountRefunded") or 1',
     "equivalent: a payment always names amountRefunded (0 when nothing was refunded), and reversing a "
     "refund of one cent reverses no credit"),
    ("billingctl/services/renewals.py", "x__resolve_token", "(cards) or True",
     "equivalent: without a usable card the preferred token matches none; only the orchestrator reads it "
     "saves differ"),
    ("billingctl/services/renewals.py", "x_attempt_invoice", 'amount = int(invoice.get("amount_due") or invoice.get(',
     "accepted: the provider's invoice always names amount_due (the sandbox, like Chargebee, cannot record a "
     "payment on one without it); the fallback to total is defensive"),
    ("billingctl/services/renewals.py", "x_attempt_invoice", "w.window == decision.blocking), )",
     "equivalent: a refused decision's blocking window is always one of its windows (domain/quota.py names it "
     "from the windows it builds), so the default is never reached"),
    ("billingctl/services/renewals.py", "x_attempt_invoice", 'invoice.get("currency_code"',
     "accepted: the provider's invoice always names its currency_code; the fallback is defensive"),
    ("billingctl/services/renewals.py", "x_attempt_invoice", 'invoice.get(None, "USD")',
     "accepted: the provider's invoice always names its currency_code; the fallback is defensive"),
    ("billingctl/services/orphans.py", "x_run_orphans", "settled_at >= newest",
     "equivalent: an equal time assigned again"),
    ("billingctl/services/orphans.py", "x_run_orphans", "(newest is not None and hold) or True",
     "equivalent: the minimum of a list of one is its element (None included)"),
    ("billingctl/services/orphans.py", "x_run_orphans", "new_cursor is not None or new_cursor != cursor",
     "equivalent: differs only by writing the cursor's same value again"),
    ("billingctl/services/renewals.py", "x_run_renewals", 'getattr(',
     "equivalent: str() of our own errors is their message, and other errors have no message attribute"),
    ("billingctl/services/renewals.py", "x_run_renewals", "item_failed(",
     "equivalent: the arguments of the failure's log line (the failure itself is asserted in the document)"),
    ("billingctl/services/orphans.py", "x__subscription_status", "local = ",
     "equivalent: a subscription cancelled in our copy is cancelled at the provider too; the local read only "
     "saves the provider's"),
    ("billingctl/services/orphans.py", "x__subscription_status", 'if local == "',
     "equivalent: a subscription cancelled in our copy is cancelled at the provider too; the local read only "
     "saves the provider's"),
    ("billingctl/services/orphans.py", "x_handle_payment", "not in payment",
     "equivalent: the list's summaries lack both fields and a payment read whole has both, so every spelling "
     "reads a summary whole; only the number of reads of a whole payment differs"),
    ("billingctl/services/orphans.py", "x_handle_payment", '"customerId" in payment or',
     "equivalent: the list's summaries lack both fields and a payment read whole has both, so every spelling "
     "reads a summary whole; only the number of reads of a whole payment differs"),
    ("billingctl/adapters/db/fraud.py", "xǁFraudEventsǁadd", "DEDUPE_KEY", _SQLITE),
    ("webhooks_app/signatures.py", "x_verify_timestamped", "rsplit(",
     "equivalent: a set's fields are t=<digits> and v1=<hex>, with no second '=' for the split to differ on"),
    ("webhooks_app/signatures.py", "x_verify_timestamped", 'ts, sig = fields.get(',
     "equivalent: a missing t or v1 is refused whatever it defaults to (no number; no signature a secret "
     "makes)"),
    ("webhooks_app/signatures.py", "x_verify_standard_webhook", "verified = None",
     "equivalent: None and False are both false"),
    ("webhooks_app/signatures.py", "x_verify_standard_webhook", "json_parse=None",
     "equivalent: None and False are both false"),
    ("billingctl/services/orphans.py", "x__failed", "due < now",
     "equivalent: when the attempt was due exactly now, both bases are now"),
    ("billingctl/services/orphans.py", "x__recover", '!= "XXcancelledXX"',
     "equivalent: for a re-subscription cancelled between attempts both paths reach _finish_resubscription on "
     "it (re-subscribing replays its creation by the attempt's idempotency key), which fails the attempt"),
    ("billingctl/services/orphans.py", "x__recover", '!= "CANCELLED"',
     "equivalent: for a re-subscription cancelled between attempts both paths reach _finish_resubscription on "
     "it (re-subscribing replays its creation by the attempt's idempotency key), which fails the attempt"),
    ("billingctl/services/orphans.py", "x__recover", "(recorded_on is not None or recorded_on ==",
     "equivalent: a payment recorded on another subscription than its row's was moved there by a "
     "re-subscription, which happens only when the row's own subscription is cancelled, so the next "
     "condition fails either way"),
    (_PAYMENTS + "activation.py", "x_activate_subscription", "== ", _ACTIVATION_LOCK),
    (_PAYMENTS + "activation.py", "x_activate_subscription", "== if not _locked and dry_run:",
     _ACTIVATION_LOCK),
    (_PAYMENTS + "activation.py", "x_activate_subscription", "container.uow(autocommit=None)", _READ_ONLY),
    (_PAYMENTS + "activation.py", "x_activate_subscription", "container.uow(autocommit=False)", _READ_ONLY),
    (_PAYMENTS + "activation.py", "x_activate_subscription", "if (local is not None) or True else None",
     "equivalent: a purchase's subscription always has a local copy (recording adds it in the same "
     "transaction), so the dry run's status is never read from a missing one"),
    (_PAYMENTS + "activation.py", "x_activate_subscription", "container.locks.hold(None)",
     "accepted: one lock named None for every subscription serializes more activations than needed, which "
     "is slower but not wrong; the tests activate one at a time"),
    (_PAYMENTS + "activation.py", "x_activate_subscription", "crash_point", _CRASH),
    (_PAYMENTS + "activation.py", "x_activate_subscription", "change_term_end", _TERM_FALLBACK),
    (_PAYMENTS + "activation.py", "x_activate_subscription", "period = ", _TERM_FALLBACK),
    (_PAYMENTS + "activation.py", "x_activate_subscription", "== remote = None", _TERM_FALLBACK),
    (_PAYMENTS + "recording.py", "x_record_payment", "container.locks.hold(None)",
     "accepted: one lock named None for every subscription serializes more recordings than needed, which "
     "is slower but not wrong (the purchase's unique payment id keeps it exactly once)"),
    (_PAYMENTS + "activation.py", "x__started_copy", "CancelledAtProvider(None)",
     "equivalent: the exception's argument is read nowhere; its handler has the subscription id"),
    ("billingctl/adapters/db/purchases.py", "xǁPurchasesǁfinished", "payment_id), purchase.c.provider_recorded_at",
     "equivalent: a purchase is marked recorded at the provider only after it was recorded on its invoice, so "
     "one with provider_recorded_at has an invoice"),
    ("billingctl/adapters/db/purchases.py", "xǁPurchasesǁfinished", '.is_not(None), subscription.c.status == "active"',
     "equivalent: a subscription is never active with its activation pending (recording marks only one that "
     "is not active; activation and sync clear the mark when they write active)"),
    (_PAYMENTS + "recording.py", "x_facts_from_payment", "container.uow(autocommit=None)", _READ_ONLY),
    (_PAYMENTS + "recording.py", "x_facts_from_payment", "container.uow(autocommit=False)", _READ_ONLY),
    (_PAYMENTS + "recording.py", "x_facts_from_payment", "== item_price_id = None", _CHECKOUT_PLAN),
    (_PAYMENTS + "recording.py", "x_facts_from_payment",
     '== item_price_id = item_price_id and row["item_price_id"]', _CHECKOUT_PLAN),
    (_PAYMENTS + "recording.py", "x_facts_from_payment", 'get("amount") or 1', _ONE_CENT),
    (_PAYMENTS + "recording.py", "x_facts_from_payment", '!= row["subscription_id"]) or True else None',
     "accepted: a guard for a checkout row whose invoice column holds its own subscription id (a checkout's "
     "order id, as a payment's orderId does); no path of this version writes one, so no test builds one"),
    ("billingctl/services/fraud_quota.py", "x_count_authorization", 'get("amount") or 1', _ONE_CENT),
    ("billingctl/services/fraud_quota.py", "x_count_authorization", "uow.fraud.exists(None)",
     "equivalent: the attempt's key is unique in the table, so a second report of one payment adds no row "
     "either way (the read only spares the insert)"),
    ("billingctl/services/fraud_quota.py", "x_reserve", "uow.users.lock(None)",
     "equivalent on SQLite, the mutation run's database, where ensure's write before it already serializes "
     "the writers; on PostgreSQL the row lock is what `test_two_workers_cannot_both_take_the_last_customer_slot` "
     "needs"),
    ("webhooks_app/signatures.py", "x_unix_seconds", "not isinstance(value, bool)) or True else", _NOT_DIGITS),
    ("webhooks_app/signatures.py", "x_unix_seconds", "isinstance(value, int) or not isinstance(value, bool)",
     _NOT_DIGITS),
    ("webhooks_app/signatures.py", "x_unix_seconds", 'not isinstance(value, bool) else "XXXX"', _NOT_DIGITS),
    (_PAYMENTS + "activation.py", "x_activate_subscription", "if not bought.invoice_id or first_invoice",
     "equivalent: a purchase with its invoice takes the path that sends no start, where the first invoice is "
     "None, so the condition is false both ways"),
    ("billingctl/services/orphans.py", "x_refund", 'get("amount") or 1',
     "equivalent: a payment always carries its amount"),
]


def reason_for(path: str, key: str, change: str) -> str:
    function = key.rpartition(".")[2].rpartition("__mutmut_")[0]
    for file, name, piece, why in REASONS:
        matches = change == piece[3:] if piece.startswith("== ") else piece in change
        if path == file and function == name and matches:
            return why
    return "UNEXPLAINED"


def _functions(path: Path) -> dict[str, str]:
    source = path.read_text()
    lines = source.splitlines()
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and "__mutmut_" in node.name:
            found[node.name] = "\n".join(lines[node.lineno - 1:node.end_lineno])
    return found


def survivors(root: Path = Path("mutants")):
    totals = {"killed": 0, "survived": 0, "no_tests": 0, "not_checked": 0}
    rows = []
    for meta in sorted(root.rglob("*.py.meta")):
        results = json.loads(meta.read_text())["exit_code_by_key"]
        functions = _functions(meta.with_suffix(""))
        for key, code in sorted(results.items()):
            if code in SURVIVED:
                totals["survived"] += 1
            elif code in NO_TESTS:
                totals["no_tests"] += 1
            elif code in NOT_CHECKED or code in SKIPPED:
                totals["not_checked"] += 1
                continue
            else:
                totals["killed"] += 1
                continue
            name = key.rpartition(".")[2]
            original = functions.get(name.rpartition("__mutmut_")[0] + "__mutmut_orig", "")
            changed = [line[1:].strip() for line in difflib.unified_diff(
                original.splitlines()[1:], functions.get(name, "").splitlines()[1:], lineterm="", n=0)
                if line.startswith("+") and not line.startswith("+++")]
            rows.append((str(meta.relative_to(root).with_suffix("")), key, "survived" if code in SURVIVED
                         else "no test", " / ".join(changed)[:160]))
    return totals, rows


def main() -> None:
    totals, rows = survivors()
    checked = totals["killed"] + totals["survived"] + totals["no_tests"]
    score = 100 * totals["killed"] / checked if checked else 0
    print(f"mutation score: {score:.1f} % ({totals['killed']} killed, {totals['survived']} survived, "
          f"{totals['no_tests']} reached by no test, of {checked}; {totals['not_checked']} not checked)")
    if "--markdown" in sys.argv:
        explained = sum(1 for path, key, _, change in rows if reason_for(path, key, change) != "UNEXPLAINED")
        print(f"\n{len(rows)} survivors: {explained} with a reason (equivalent or accepted), {len(rows) - explained} "
              "UNEXPLAINED (a test to write, or a mutant not yet re-run against the tests written for it).")
        print("\n| file | mutant | state | the changed line | why it is not killed |\n|---|---|---|---|---|")
        for path, key, state, change in rows:
            cell = change.replace("|", "\\|")
            print(f"| `{path}` | `{key.rpartition('.')[2]}` | {state} | `{cell}` | {reason_for(path, key, change)} |")
    elif "--counts" not in sys.argv:
        for path, key, state, change in rows:
            print(f"{path}\t{key.rpartition('.')[2]}\t{state}\t{reason_for(path, key, change)}\t{change}")


if __name__ == "__main__":
    main()
