"""Payments (spec section 1's functional area): unified payment recording, idempotency checks and
subscription activation. Every path that learns of a settled payment (the orchestrator webhook, the event
poller, the settled-payments poller, the workflow-completion callback, the CLI) calls `record_payment`.

- `recording`: the purchase, transaction, ledger and lock in one transaction, exactly once;
- `followups`: its follow-ups at the provider, now or after a webhook's answer, and the activations job;
- `activation`: a checkout's subscription started at the provider;
- `invoice_record`: the payment's record on its provider invoice, and what finance did to it meanwhile;
- `refunds`: refunds asked for once, credits reversed once;
- `transactions`: the payment's lifecycle on its transaction row, and its invoice's renewal attempts.

The names below are the area's interface; the modules are its parts."""

from billingctl.services.payments.activation import activate_subscription
from billingctl.services.payments.followups import (
    complete_followups,
    followups_after_response,
    pending_activations,
    retry_pending,
)
from billingctl.services.payments.recording import (
    WORKFLOW_CONFIRMATION,
    apply_refund_report,
    captured_in_part_reason,
    facts_from_payment,
    record_payment,
    record_payment_by_id,
)
from billingctl.services.payments.refunds import (
    REFUND_FAILED_TEXT,
    refund,
    refund_by_operator,
    refund_failed,
    returned_in_review,
    reverse_refund,
)
from billingctl.services.payments.transactions import (
    CAPTURED_STATUSES,
    NO_ANSWER,
    dunning_step,
    end_renewal_attempt,
    save_transaction,
    update_transaction_status,
)

__all__ = [
    "CAPTURED_STATUSES", "NO_ANSWER", "REFUND_FAILED_TEXT", "WORKFLOW_CONFIRMATION", "activate_subscription",
    "apply_refund_report", "captured_in_part_reason", "complete_followups", "dunning_step", "end_renewal_attempt",
    "facts_from_payment", "followups_after_response", "pending_activations", "record_payment", "record_payment_by_id",
    "refund", "refund_by_operator", "refund_failed", "retry_pending", "returned_in_review", "reverse_refund",
    "save_transaction", "update_transaction_status",
]
