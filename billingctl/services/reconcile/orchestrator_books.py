"""Reconcile's checks from the orchestrator's books.

The orchestrator lists payments by creation date and status (summaries: no refunded amount) and lists no
refunds or disputes. So each run reads the captured payments created in its window, page by page, and
judges each page against our books in two statements; it reads one payment's refunded amount only where a
refund can have happened unseen: in a full pass every recorded payment of the refund window, and in an
incremental run the payments a refund notification named in the window (a lost refund notification is
found by the weekly full pass). Payments still in flight are listed by status (a short list)."""

from __future__ import annotations

from functools import partial
from itertools import islice

from billingctl.domain.refunds import credits_to_reverse
from billingctl.services.fraud_signals import money_returned
from billingctl.services.payments import CAPTURED_STATUSES, returned_in_review
from billingctl.services.reconcile.local_books import limits
from billingctl.services.reconcile.rules import REFUND_WINDOW, TOO_RECENT

IN_FLIGHT_LISTED = ("AUTHORIZED", "SETTLING")  # money held or moving (PENDING holds nothing yet)
PAGE = 100


def _pages(items, size: int = PAGE):
    items = iter(items)
    while page := list(islice(items, size)):
        yield page


def check(container, now, span, add, progress=None) -> int:
    checked = 0
    orders: dict[str, str] = {}  # order id -> first payment id (the window's, or one before it: _charged_before)
    refund_reads: list[tuple[str, int, int, object]] = []
    listed = container.orchestrator.list_payments(",".join(CAPTURED_STATUSES), from_date=span.since)
    for page in _pages(listed):
        with container.uow() as uow:
            books = uow.books.purchases_of([p.id for p in page])
            expected = uow.books.expected_charges({p.id: p.order_id for p in page})
            # A checkout begun before the window may have a charge before it, unlisted here (decision 252).
            begun = uow.books.checkouts_begun_before([p.order_id for p in page if p.order_id], span.since) \
                if span.since is not None else set()
        for payment in page:
            checked += 1
            if progress:
                progress(1)
            settled = payment.settled_at
            if settled is not None and now - settled < TOO_RECENT:
                continue
            recorded, review = books[payment.id]["purchase"], books[payment.id]["review"]
            at = settled or now
            _check_recorded(payment, recorded, review and review["status"], expected.get(payment.id),
                            partial(add, at=at))
            if recorded is None and returned_in_review(review):
                _check_kept_after_refund(container, payment.id, partial(add, at=at))
            if payment.order_id in begun and payment.order_id not in orders:
                orders[payment.order_id] = _charged_before(container, payment, span.since)
            _check_order(container, payment, orders, partial(add, at=at))
            if span.full and recorded is not None and settled is not None and now - settled < REFUND_WINDOW:
                refund_reads.append((payment.id, recorded["credits"], recorded["returned_excess"], None))
    if not span.full:
        refund_reads = _refunds_notified(container, span.since)
    for payment_id, credits, returned_excess, notified in refund_reads:
        _check_refund(container, payment_id, credits, returned_excess, partial(add, at=notified))
    _check_in_flight(container, now, add)
    return checked


def _check_recorded(payment, recorded, owner, expected, add) -> None:
    """Recorded once (or owned by review), and for what its order asked."""
    pid = payment.id
    if recorded is None and owner is None:  # any review row owns it (domain.lifecycle.ORPHAN)
        add("payment_unrecorded", {"payment_id": pid, "order_id": payment.order_id,
                                   "detail": "settled at the orchestrator, no purchase and no orphan record"})
        return
    if recorded is None:
        return
    if owner == "duplicate_refunded" and recorded["closed_at"] is None:  # closed: its credits are back (173)
        add("payment_recorded_and_refunded", {"payment_id": pid, "user_id": recorded["user_id"],
                                              "detail": "recorded although recovery refunded it as a duplicate"})
    if payment.status != "SETTLED":
        add("payment_amount_differs", {"payment_id": pid, "user_id": recorded["user_id"],
                                       "detail": f"{payment.status} at the orchestrator, credited as paid in full"})
        return
    amount, currency = expected or (None, None)
    if (amount is not None and payment.charged != amount) or (currency and payment.currency_code != currency):
        add("payment_amount_differs", {"payment_id": pid, "user_id": recorded["user_id"],
                                       "order_id": payment.order_id,
                                       "detail": f"charged {payment.charged} {payment.currency_code}, its order "
                                                 f"asked {amount} {currency or payment.currency_code}"})


def _check_kept_after_refund(container, payment_id: str, add) -> None:
    """A payment whose review ended with its money returned still takes more than went back: captured
    again since, and that capture's notification lost (decision 238). The list holds no refunded amount:
    the payment is read (such rows are few)."""
    payment = container.orchestrator.get_payment(payment_id)
    if not payment.refunding_in_full:
        add("payment_kept_after_refund", {
            "payment_id": payment_id, "user_id": payment.user_id,
            "detail": f"refunded {payment.refunded} of {payment.taken} {payment.currency_code} taken, its review "
                      f"ended refunded: billingctl payments refund {payment_id} --reason R --yes"})


def _charged_before(container, payment, since) -> str:
    """The order's first captured charge made before the window (the orchestrator's payments of the
    order: one call), else this payment."""
    earlier = [p.id for p in container.orchestrator.payments_of_order(payment.order_id)
               if p.id != payment.id and p.status in CAPTURED_STATUSES and p.made_at is not None and p.made_at < since]
    return earlier[0] if earlier else payment.id


def _check_order(container, payment, orders: dict, add) -> None:
    order = payment.order_id
    if not order:
        return
    first = orders.setdefault(order, payment.id)
    if first != payment.id and not (money_returned(container, payment.id) or money_returned(container, first)):
        add("order_charged_twice", {"payment_id": payment.id, "order_id": order, "payment_ids": [first, payment.id],
                                    "detail": "a second settled payment for one order"})


def _refunds_notified(container, since) -> list[tuple[str, int, int, object]]:
    """(payment id, credits, excess returned, when notified first) of the recorded payments a refund
    notification named since `since`."""
    from billingctl.services.webhook_events import payment_of_event

    named: dict[str, object] = {}
    with container.uow() as uow:
        for key, received in uow.books.notified_since("orchestrator", "PAYMENT.REFUND", since):
            payment_id = payment_of_event(key)
            if payment_id and (payment_id not in named or received < named[payment_id]):
                named[payment_id] = received
        return [(pid, credits, excess, named[pid])
                for pid, credits, excess in uow.books.credits_of(sorted(named))] if named else []


def _check_refund(container, payment_id: str, credits: int, returned_excess: int, add) -> None:
    """Refunded at the orchestrator (the list holds no refunded amount: the payment is read) but not
    reversed in the ledger."""
    payment = container.orchestrator.get_payment(payment_id)
    refunded, amount = payment.refunded, payment.charged
    if not refunded or not amount:
        return
    expected = credits_to_reverse(credits, amount, returned_excess, refunded)
    with container.uow() as uow:
        done = uow.ledger.reversed_for(payment_id)
    if done < expected:
        add("refund_not_reversed", {"payment_id": payment_id, "detail": f"refunded {refunded} of {amount}: "
                                                                        f"{done} of {expected} credits reversed"})


def _check_in_flight(container, now, add) -> None:
    """No payment authorized and never captured, or settling, past its age limit (the renewal tick and the
    checkout cleanup capture or cancel them at the limit; past it and the grace, nothing did). Every one,
    however old: they are few (a finished payment leaves these statuses), and one older than the refund
    window is still money held (decision 213)."""
    limit = limits(container.settings)
    for payment in container.orchestrator.list_payments(",".join(IN_FLIGHT_LISTED)):
        started = payment.settled_at  # the payment's date: when it was created
        allowed = (limit.authorized if payment.status == "AUTHORIZED" else limit.in_flight) + limit.grace
        if started is not None and now - started > allowed:
            add("charge_in_flight_too_long", {"payment_id": payment.id, "order_id": payment.order_id,
                                              "detail": f"{payment.status} since {started:%Y-%m-%d %H:%M}"})
