"""The provider follow-ups of a recorded payment (issue 39 item 3): activation, then the record on its
invoice, made under the subscription's lock, inside the request for a job or the CLI and after the answer
for a webhook. The database is their durable queue: the activations job (`retry_pending`) finishes what
a failed call or a dead process left, with the same idempotency keys."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from contextvars import ContextVar

from billingctl.domain import errors as e
from billingctl.domain.batch import BatchResult
from billingctl.services.payments.activation import activate_subscription
from billingctl.services.payments.invoice_record import UNPAID_PERIOD, report_to_provider

log = logging.getLogger("billingctl.payments")


class AfterResponse:
    """The provider follow-ups a web request recorded (issue 39 item 3): the request answers from our
    database alone, and these run once its answer is sent (the WSGI server closes the response), never
    waiting for the budget. The database is their durable queue: a purchase not yet on its invoice, a
    subscription still to activate; if this process dies first, or a call fails, the activations job
    finishes them with the same idempotency keys."""

    def __init__(self, container):
        self.container = container
        self.subscriptions: list[str] = []

    def add(self, subscription_id: str) -> None:
        if subscription_id not in self.subscriptions:
            self.subscriptions.append(subscription_id)

    def run(self) -> None:
        from billingctl.adapters.ratelimit import MONEY, budget

        for subscription_id in self.subscriptions:
            try:
                # As inside the request: one attempt a call, no wait for the budget (the job does the rest).
                with self.container.locks.hold(f"subscription:{subscription_id}"), budget(MONEY, no_wait=True), \
                        self.container.provider.http.attempts(1):
                    complete_followups(self.container, subscription_id)
            except Exception as exc:  # noqa: BLE001 - the answer is sent; the activations job retries
                log.warning("follow-up after the webhook's answer failed; the activations job retries: %s",
                            getattr(exc, "message", type(exc).__name__), extra={"subscription_id": subscription_id})


_AFTER_RESPONSE: ContextVar[AfterResponse | None] = ContextVar("followups_after_response", default=None)


@contextmanager
def followups_after_response(container):
    """Inside: recording hands its provider follow-ups to the returned AfterResponse instead of making them."""
    deferred = AfterResponse(container)
    token = _AFTER_RESPONSE.set(deferred)
    try:
        yield deferred
    finally:
        _AFTER_RESPONSE.reset(token)


def complete_followups(container, subscription_id: str) -> dict:
    """Activate the subscription (which, for a pending checkout, starts it and names the invoice its
    payment belongs to), then record every unreported purchase on its invoice. Failures leave the work
    pending (listed by `health`, retried by the activations job)."""
    from billingctl.adapters.ratelimit import MONEY, budget

    with budget(MONEY):  # recording and activation take the budget's reserved share
        return _complete_followups(container, subscription_id)


def _complete_followups(container, subscription_id: str) -> dict:
    result = {"provider_recorded": True, "activation": None}
    try:
        result["activation"] = activate_subscription(container, subscription_id, _locked=True)["outcome"]
    except e.PaymentNotRecorded:
        raise
    except e.BillingError as exc:
        result["activation"] = "pending"
        result["activation_error"] = exc.message
    with container.uow(autocommit=True) as uow:
        pending = uow.purchases.unreported(subscription_id, container.clock.now())
    for row in pending:
        reported = report_to_provider(container, row) if row["invoice_id"] else False
        if reported in UNPAID_PERIOD:  # refunded: its period is not this payment's
            result["refunded_unpaid_period"] = row["transaction_id"]
        elif not reported:
            result["provider_recorded"] = False
    return result


def pending_activations(container) -> list[dict]:
    """Subscriptions with follow-up work: an activation still to do, or a purchase not yet recorded on
    the provider's invoice."""
    with container.uow() as uow:
        return uow.subscriptions.with_followups(container.clock.now())


def retry_pending(container) -> dict:
    """The activations job: finish every pending follow-up, each isolated from the others."""
    done, failed = 0, 0
    for row in pending_activations(container):
        with container.locks.hold(f"subscription:{row['id']}"):
            try:
                outcome = complete_followups(container, row["id"])
            except e.BillingError as exc:
                log.warning("pending activation still failing: %s", exc.message, extra={"subscription_id": row["id"]})
                failed += 1
                continue
            except Exception:  # one row's crash never stops the others' (issue 37): counted, logged, next
                log.exception("pending activation crashed", extra={"subscription_id": row["id"]})
                failed += 1
                continue
        if outcome["activation"] in ("activated", "already_active") and outcome["provider_recorded"]:
            done += 1
        else:
            failed += 1
    return BatchResult({"completed": done, "failed": failed}, done=done, failed=failed)
