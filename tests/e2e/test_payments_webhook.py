"""POST /webhooks/orchestrator/payments: authentication before anything is used; nothing written on failure."""

import base64
import hashlib
import hmac
import json
import time

import pytest
from sqlalchemy import func, select

from billingctl.adapters.db.tables import event_inbox, purchase, transaction
from webhooks_app import create_public_app

pytestmark = pytest.mark.e2e
PATH = "/webhooks/orchestrator/payments"


def sign(secret, body):
    return base64.b64encode(hmac.new(secret.encode(), body, hashlib.sha256).digest()).decode()


@pytest.fixture
def client(container):
    return create_public_app(container=container).test_client()


def body_at(signed_at, status="SETTLED"):
    return json.dumps({"eventType": "PAYMENT.STATUS", "signedAt": signed_at,
                       "payment": {"id": "pay_w1", "status": status, "amount": 999, "customerId": "u",
                                   "orderId": "inv_1"}}).encode()


def nothing_written(container):
    with container.uow() as uow:
        return all(uow.execute(select(func.count()).select_from(t)).scalar_one() == 0
                   for t in (event_inbox, purchase, transaction))


@pytest.mark.parametrize(
    ("case", "expected"),
    [("missing signature", 401), ("bad signature", 401), ("other secret", 401), ("stale", 401), ("future", 401),
     ("non-numeric", 401), ("missing signedAt", 401), ("malformed json", 400), ("not an object", 400),
     ("no payment", 400)],
)
def test_bad_requests_are_refused_and_change_nothing(client, container, case, expected):
    secret = container.settings.secret("orchestrator_webhook_secret")
    now = int(time.time())
    body = body_at(str(now))
    headers = {"X-Signature-Primary": sign(secret, body)}
    if case == "missing signature":
        headers = {}
    elif case == "bad signature":
        headers = {"X-Signature-Primary": "AAAA" + headers["X-Signature-Primary"][4:]}
    elif case == "other secret":
        headers = {"X-Signature-Primary": sign("not-the-secret", body)}
    elif case in ("stale", "future", "non-numeric", "missing signedAt"):
        signed = {"stale": str(now - 301), "future": str(now + 301), "non-numeric": "12abc",
                  "missing signedAt": None}[case]
        body = body_at(signed)
        headers = {"X-Signature-Primary": sign(secret, body)}
    elif case in ("malformed json", "not an object", "no payment"):
        body = {"malformed json": b"{not json", "not an object": b"[1, 2]",
                "no payment": json.dumps({"eventType": "PAYMENT.STATUS", "signedAt": str(now)}).encode()}[case]
        headers = {"X-Signature-Primary": sign(secret, body)}
    response = client.post(PATH, data=body, headers=headers)
    assert response.status_code == expected
    assert set(response.get_json()) == {"error", "message"}
    assert nothing_written(container)


def test_the_secondary_signature_is_accepted_during_a_rotation(client, container):
    secret = container.settings.secret("orchestrator_webhook_secret")
    body = body_at(str(int(time.time())), status="AUTHORIZED")
    response = client.post(PATH, data=body, headers={"X-Signature-Primary": sign("old-secret", body),
                                                     "X-Signature-Secondary": sign(secret, body)})
    assert response.status_code == 200


def test_a_missing_secret_fails_closed(make_settings, db_url):
    from billingctl.bootstrap import Container

    c = Container(make_settings(database_url=db_url))
    object.__setattr__(c.settings, "orchestrator_webhook_secret", None)
    body = body_at(str(int(time.time())))
    response = create_public_app(container=c).test_client().post(PATH, data=body,
                                                                 headers={"X-Signature-Primary": sign("", body)})
    assert response.status_code == 401


def test_a_redelivered_event_is_a_no_op(client, container):
    secret = container.settings.secret("orchestrator_webhook_secret")
    body = body_at(str(int(time.time())), status="DECLINED")
    first = client.post(PATH, data=body, headers={"X-Signature-Primary": sign(secret, body)})
    second = client.post(PATH, data=body, headers={"X-Signature-Primary": sign(secret, body)})
    assert first.get_json()["outcome"] == "status_updated"
    assert second.get_json()["outcome"] == "duplicate"


def test_a_finished_duplicate_is_answered_from_the_inbox_before_its_body_is_typed(client, container):
    """Issue 39 item 4 (decision 162): a finished notification delivered again is answered from the
    inbox's one read, before its body is typed (its key was stored from a body that typed, and nothing
    else of it is used); a new one is typed first and refused when a field is wrongly typed."""
    secret = container.settings.secret("orchestrator_webhook_secret")
    raw = body_at(str(int(time.time())), status="DECLINED")
    first = client.post(PATH, data=raw, headers={"X-Signature-Primary": sign(secret, raw)})
    assert first.get_json()["outcome"] == "status_updated"
    body = json.loads(raw)
    body["payment"]["amount"] = "lots"  # a field only the handler reads, wrongly typed
    for status, expected in (("DECLINED", 200), ("SETTLED", 400)):
        body["payment"]["status"] = status
        raw = json.dumps(body).encode()
        answer = client.post(PATH, data=raw, headers={"X-Signature-Primary": sign(secret, raw)})
        assert answer.status_code == expected
        if expected == 200:
            assert answer.get_json() == {"event_id": "PAYMENT.STATUS:pay_w1:DECLINED", "outcome": "duplicate"}
    with container.uow() as uow:
        rows = uow.execute(select(event_inbox.c.event_id, event_inbox.c.deliveries)).all()
    assert [tuple(r) for r in rows] == [("PAYMENT.STATUS:pay_w1:DECLINED", 1)]  # nothing written by either


def test_a_new_payments_webhook_answers_from_our_database_alone(container):
    """Issue 39 item 3: a new payment's webhook made its two provider calls (activation, the record on the
    invoice) inside the request, so its latency followed the provider's and a catch-up's budget. It now
    records the payment, answers, and makes them once its answer is sent; the database holds them until
    then (a worker that dies first leaves them to the activations job)."""
    from billingctl.sandbox.model import sign_body
    from billingctl.services.checkout import create_checkout

    co = create_checkout(container, "user_quick", "credits-pro-USD-monthly")
    payment = container.sandbox.pay(co["order_id"], drop_webhook=True)
    body = json.dumps({"eventType": "PAYMENT.STATUS", "signedAt": str(int(time.time())), "payment": payment})
    headers = {"X-Signature-Primary": sign_body(container.settings.secret("orchestrator_webhook_secret"),
                                                body.encode())}
    before = container.sandbox.store.count_requests("provider")
    answer = create_public_app(container=container).test_client().post(
        "/webhooks/orchestrator/payments", data=body, content_type="application/json", headers=headers,
        buffered=False)  # read, not yet closed: what the sender has when its answer arrives
    assert answer.status_code == 200 and answer.get_json()["followups"] == "after_response"
    assert container.sandbox.store.count_requests("provider") == before  # the answer waited on no provider call
    with container.uow() as uow:
        assert uow.purchases.by_payment_id(payment["id"])["provider_recorded_at"] is None
        assert uow.execute(select(func.sum(purchase.c.credits))).scalar_one() == 2000  # credited at once
    answer.close()  # the server has sent it: the follow-ups run
    assert container.sandbox.store.count_requests("provider") == before + 2
    assert container.sandbox.subscription(co["subscription_id"])["status"] == "active"
    with container.uow() as uow:
        assert uow.purchases.by_payment_id(payment["id"])["provider_recorded_at"] is not None


def _new_payment_webhook(container, user_id):
    from billingctl.sandbox.model import sign_body
    from billingctl.services.checkout import create_checkout

    co = create_checkout(container, user_id, "credits-pro-USD-monthly")
    payment = container.sandbox.pay(co["order_id"], drop_webhook=True)
    body = json.dumps({"eventType": "PAYMENT.STATUS", "signedAt": str(int(time.time())), "payment": payment})
    headers = {"X-Signature-Primary": sign_body(container.settings.secret("orchestrator_webhook_secret"),
                                                body.encode())}
    return co, payment, {"data": body, "content_type": "application/json", "headers": headers}


def _recorded_at_provider(container, payment_id):
    with container.uow() as uow:
        return uow.purchases.by_payment_id(payment_id)["provider_recorded_at"] is not None


def test_under_gunicorn_a_new_payments_followups_run_on_the_workers_own_thread(container):
    """Issue 39 item 4: the gunicorn entry point's sync worker made a new payment's follow-ups itself once
    its answer was sent, so it served nothing else until the provider answered and the requests queued
    behind it waited (a new payment's p99 rose to 3.6-5× its p50 in the round the budget's window freed).
    They now run on one thread of the worker: the worker is free as soon as the answer is sent, and the
    follow-ups still finish without the activations job."""
    import threading

    app = create_public_app(container=container, sync_worker=True)
    followups = app.extensions["billing_followups"]
    busy, release = threading.Event(), threading.Event()
    followups(lambda: (busy.set(), release.wait(10)))  # the thread is making another request's follow-ups
    assert busy.wait(10)
    co, payment, request = _new_payment_webhook(container, "user_thread")
    before = container.sandbox.store.count_requests("provider")
    answer = app.test_client().post(PATH, **request)  # read and closed, as the server has sent it
    assert answer.status_code == 200 and answer.get_json()["followups"] == "after_response"
    # Closing the answer returned at once: the worker thread made no provider call and waited for none.
    assert container.sandbox.store.count_requests("provider") == before
    assert not _recorded_at_provider(container, payment["id"])
    release.set()
    followups.join()
    assert container.sandbox.store.count_requests("provider") == before + 2
    assert container.sandbox.subscription(co["subscription_id"])["status"] == "active"
    assert _recorded_at_provider(container, payment["id"])


def test_a_full_followup_queue_leaves_the_work_to_the_activations_job(container, caplog):
    """Past the follow-up thread's queue, a new payment's follow-ups stay where they already are, in the
    database: the answer is the same, nothing is called, and the activations job finishes them."""
    import threading

    from billingctl.services.payments import retry_pending
    from webhooks_app.followups import FollowupThread

    app = create_public_app(container=container, sync_worker=True)
    followups = app.extensions["billing_followups"] = FollowupThread(capacity=1)
    busy, release = threading.Event(), threading.Event()
    followups(lambda: (busy.set(), release.wait(10)))
    assert busy.wait(10)
    assert followups(lambda: None)  # the one place in the queue
    co, payment, request = _new_payment_webhook(container, "user_full")
    before = container.sandbox.store.count_requests("provider")
    with caplog.at_level("INFO", logger="webhooks_app.followups"):
        answer = app.test_client().post(PATH, **request)
    assert answer.status_code == 200 and answer.get_json()["outcome"] == "recorded"
    assert "follow-up left to the activations job" in caplog.text
    release.set()
    followups.join()
    assert container.sandbox.store.count_requests("provider") == before  # dropped, not run
    assert container.sandbox.subscription(co["subscription_id"])["status"] != "active"
    assert not _recorded_at_provider(container, payment["id"])
    assert retry_pending(container)["completed"] == 1
    assert container.sandbox.subscription(co["subscription_id"])["status"] == "active"
    assert _recorded_at_provider(container, payment["id"])


def test_a_worker_that_exits_finishes_the_followup_in_flight_and_leaves_the_queued_to_the_job(tmp_path):
    """A sync worker finished the follow-ups it was making before a graceful exit; on a thread that dies
    with the process one could be cut between the provider's answer and our record of it. At exit the
    follow-up thread lets the one in flight finish (within its grace) and runs none of those queued: the
    database still holds them for the activations job."""
    import subprocess
    import sys

    script = (
        "import pathlib, sys, threading, time\n"
        "from webhooks_app.followups import FollowupThread\n"
        "out = pathlib.Path(sys.argv[1]); started = threading.Event()\n"
        "def in_flight():\n"
        "    started.set(); time.sleep(0.5); (out / 'in_flight').write_text('done')\n"
        "followups = FollowupThread()\n"
        "followups(in_flight)\n"
        "followups(lambda: (out / 'queued').write_text('ran'))\n"
        "started.wait(5)\n"  # the process exits while the first is in flight and the second queued
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "in_flight").read_text() == "done"
    assert not (tmp_path / "queued").exists()


def test_a_forked_worker_gets_a_followup_thread_of_its_own(tmp_path):
    """gunicorn forks its workers; with `--preload` a worker would inherit an app whose follow-up thread
    lives only in the parent, and the work it queued would never run. The child starts its own thread."""
    import os
    import subprocess
    import sys

    script = (
        "import os, pathlib, signal, sys\n"
        "from webhooks_app.followups import FollowupThread\n"
        "out = pathlib.Path(sys.argv[1]); followups = FollowupThread()\n"
        "followups(lambda: (out / 'parent').write_text(str(os.getpid()))); followups.join()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    signal.alarm(10)\n"  # a child left waiting for a thread it never got dies instead of lingering
        "    followups(lambda: (out / 'child').write_text(str(os.getpid()))); followups.join(); os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    parent, child = (tmp_path / "parent").read_text(), (tmp_path / "child").read_text()
    assert parent != child and int(child) != os.getpid()


def _duplicates(container, app, times, user_id):
    """A settled payment's webhook, then `times` redeliveries; the pool check-outs the redeliveries made."""
    from sqlalchemy import event

    _co, _payment, request = _new_payment_webhook(container, user_id)
    client = app.test_client()
    assert client.post(PATH, **request).get_json()["outcome"] == "recorded"
    getattr(app.extensions["billing_followups"], "join", lambda: None)()  # its follow-ups use the pool too
    checkouts = []
    listener = lambda *_: checkouts.append(1)  # noqa: E731
    event.listen(container.autocommit_engine.pool, "checkout", listener)
    try:
        answers = [client.post(PATH, **request).get_json()["outcome"] for _ in range(times)]
    finally:
        event.remove(container.autocommit_engine.pool, "checkout", listener)
    assert answers == ["duplicate"] * times
    return len(checkouts)


def test_a_sync_worker_keeps_the_duplicate_reads_connection_between_requests(container):
    """Issue 39 item 4: the pool's check-out and return were 62,000 of a duplicate webhook's 879,000
    instructions. The gunicorn entry point's app keeps the read's connection for its one request thread;
    the others check one out per read as before."""
    assert _duplicates(container, create_public_app(container=container), 5, "user_pooled") == 5
    held_app = create_public_app(container=container, sync_worker=True)
    assert _duplicates(container, held_app, 5, "user_held") == 0
    pool = container.autocommit_engine.pool
    assert container.held_read.connection() is not None and pool.checkedout() >= 1
    before = pool.checkedout()
    container.held_read.close()  # Container.close does it before disposing the engine
    assert pool.checkedout() == before - 1


def test_a_duplicate_runs_no_import_statement(container):
    """Issue 39 item 4: an import statement inside a function runs on every call, and each cost a duplicate
    webhook about 7,000 of its instructions (three of them were a third of its gap to the minimal
    receiver). A duplicate, served as gunicorn's worker serves it, imports nothing."""
    import builtins

    from werkzeug.test import EnvironBuilder

    app = create_public_app(container=container, sync_worker=True)
    assert _duplicates(container, app, 1, "user_no_import") == 0
    _co, _payment, request = _new_payment_webhook(container, "user_no_import_2")
    assert app.test_client().post(PATH, **request).get_json()["outcome"] == "recorded"
    app.extensions["billing_followups"].join()
    environ = EnvironBuilder(path=PATH, method="POST", **request).get_environ()
    imported, real_import = [], builtins.__import__

    def counting(name, *args, **kwargs):
        imported.append(name)
        return real_import(name, *args, **kwargs)

    statuses = []
    builtins.__import__ = counting  # the interpreter calls a replaced __import__ for every import statement
    try:
        answer = b"".join(app(environ, lambda status, headers, exc_info=None: statuses.append(status)))
    finally:
        builtins.__import__ = real_import
    assert statuses == ["200 OK"] and json.loads(answer)["outcome"] == "duplicate"
    assert imported == []


def test_a_held_connection_serves_only_its_own_thread(container):
    import threading

    from billingctl.adapters.db.sql import HeldConnection

    held = HeldConnection(container.autocommit_engine)
    mine = held.connection()
    assert mine is not None and held.connection() is mine
    other = []
    thread = threading.Thread(target=lambda: other.append(held.connection()))
    thread.start()
    thread.join()
    assert other == [None]  # another thread uses the pool
    held.close()


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_held_connection_the_server_dropped_is_replaced_without_a_failed_answer(container):
    """The held connection outlives requests, so the server may drop it between two (a restart, an idle
    timeout, an operator's pg_terminate_backend). The next duplicate is still answered: the read is
    retried on a fresh connection, which the worker then holds."""
    from sqlalchemy import text

    app = create_public_app(container=container, sync_worker=True)
    _co, _payment, request = _new_payment_webhook(container, "user_dropped")
    client = app.test_client()
    assert client.post(PATH, **request).get_json()["outcome"] == "recorded"
    held = container.held_read.connection()
    pid = held.dbapi_connection.info.backend_pid
    with container.engine.connect() as conn:
        assert conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar_one()
    answer = client.post(PATH, **request)
    assert answer.status_code == 200 and answer.get_json()["outcome"] == "duplicate"
    assert container.held_read.connection().dbapi_connection.info.backend_pid != pid
    assert client.post(PATH, **request).get_json()["outcome"] == "duplicate"
