"""The provider and orchestrator clients against the sandbox over HTTP (WSGI transport and a real
loopback server): pagination, retries, Retry-After, idempotency keys, typed errors, the breaker."""

import threading

import pytest

from billingctl.bootstrap import Container
from billingctl.domain import errors as e
from billingctl.domain.clock import ManualClock
from billingctl.sandbox.apps import create_combined_app
from billingctl.sandbox.model import Sandbox
from billingctl.sandbox.store import SandboxStore
from tests.helpers import LoopbackServer

pytestmark = pytest.mark.integration


@pytest.fixture
def ext(make_settings, tmp_path):
    """A container whose clients reach the in-process sandbox; no sleeping between retries."""

    def build(**overrides):
        settings = make_settings(database_url=f"sqlite:///{tmp_path / 'ext.db'}", **overrides)
        container = Container(settings, clock=ManualClock())
        sleeps = []
        container.provider.http.sleep = sleeps.append
        container.orchestrator.http.sleep = sleeps.append
        container.sleeps = sleeps
        return container

    return build


def subscribe(sandbox, customer_id, item_price_id="credits-pro-USD-monthly", start_date=None) -> dict:
    """A subscription straight in the sandbox, creating its customer first as the real provider requires."""
    if sandbox.store.get("customer", customer_id) is None:
        sandbox.create_customer(customer_id, auto_collection="off")  # as our client creates them
    return sandbox.create_subscription_for_items(customer_id, item_price_id, start_date)


def test_pagination_walks_every_page(ext):
    c = ext()
    for i in range(150):
        subscribe(c.sandbox, f"user_{i}")
    sent = c.provider.http.requests_sent
    ids = [sub.id for sub in c.provider.list_subscriptions()]
    assert len(ids) == len(set(ids)) == 150
    assert c.provider.http.requests_sent - sent == 2  # limit 100: two pages


def test_429_with_retry_after_is_waited_out_and_counted(ext):
    c = ext()
    c.sandbox.store.add_fault("provider", "429", count=2, retry_after=1.5)
    price = c.provider.get_item_price("credits-pro-USD-monthly")
    assert price["metadata"] == {"credits": 2000, "lane": "sfw"}
    assert len(c.sleeps) == 2 and all(1.5 <= w <= 1.5 + c.settings.http_backoff_max_seconds for w in c.sleeps)
    assert c.metrics.sample("billing_provider_rate_limit_errors_total") == 2


def test_429_past_the_attempt_budget_raises_the_rate_limit_error(ext):
    c = ext(http_max_attempts=3)
    c.sandbox.store.add_fault("provider", "429", count=-1, retry_after=0)
    with pytest.raises(e.RateLimited) as info:
        c.provider.get_item_price("credits-pro-USD-monthly")
    assert info.value.message == "Please try after some time"
    assert c.metrics.sample("billing_provider_rate_limit_errors_total") == 3


@pytest.mark.parametrize("kind", ["500", "503", "timeout", "reset", "malformed"])
def test_server_errors_and_timeouts_are_retried(ext, kind):
    c = ext()
    c.sandbox.store.add_fault("provider", kind, count=2)
    sent = c.provider.http.requests_sent
    assert c.provider.get_item_price("credits-basic-USD-monthly")["price"] == 999
    assert c.provider.http.requests_sent - sent == 3
    assert len(c.sleeps) == 2 and all(0 <= s <= c.settings.http_backoff_max_seconds for s in c.sleeps)


def test_other_4xx_are_not_retried(ext):
    c = ext()
    sub = subscribe(c.sandbox, "u")["subscription"]
    c.provider.cancel_subscription(sub["id"])
    sent = c.provider.http.requests_sent
    with pytest.raises(e.ExternalNotFound):
        c.provider.get_subscription("sub_missing")
    with pytest.raises(e.ExternalInvalidRequest):
        c.provider.cancel_subscription(sub["id"])  # already cancelled: 400
    assert c.provider.http.requests_sent - sent == 2
    assert c.sleeps == []


def test_one_idempotency_key_for_every_retry_of_one_post(ext):
    c = ext()
    seen = []
    c.provider.http.client.event_hooks["request"].append(
        lambda req: seen.append(req.headers.get("chargebee-idempotency-key")))  # the header the provider reads
    sub = subscribe(c.sandbox, "u")["subscription"]
    c.sandbox.store.add_fault("provider", "503", path="change_term_end", count=2)
    c.provider.change_term_end(sub["id"], 4_100_000_000)
    c.provider.change_term_end(sub["id"], 4_200_000_000)
    assert len(seen) == 4 and None not in seen
    assert seen[0] == seen[1] == seen[2] and seen[3] != seen[0]


def test_orchestrator_uses_its_own_headers_and_keeps_the_key(ext):
    c = ext()
    seen = []
    c.orchestrator.http.client.event_hooks["request"].append(lambda req: seen.append(dict(req.headers)))
    c.sandbox.store.add_fault("orchestrator", "500", path="/client-session", count=1)
    session = c.orchestrator.create_client_session(order_id="inv_x", customer_id="u", amount=999,
                                                   currency_code="USD", metadata={"lane": "sfw"})
    assert session.order_id == "inv_x" and session.client_token
    assert seen[0]["x-idempotency-key"] == seen[1]["x-idempotency-key"]
    assert seen[0]["x-api-key"] and seen[0]["x-api-version"]


def test_a_cancel_that_errors_after_taking_effect_is_its_own_error(ext):
    c = ext()
    sub = subscribe(c.sandbox, "u")["subscription"]
    c.sandbox.store.add_fault("provider", "error_after_effect", path="cancel_for_items", count=-1)
    with pytest.raises(e.OutcomeUnknown):
        c.provider.cancel_subscription(sub["id"])
    # It did take effect: the caller compares with the provider.
    assert c.provider.get_subscription(sub["id"]).status == "cancelled"


def test_an_idempotent_retry_recovers_from_one_error_after_effect(ext):
    c = ext()
    sub = subscribe(c.sandbox, "u")["subscription"]
    c.sandbox.store.add_fault("provider", "error_after_effect", path="cancel_for_items", count=1)
    assert c.provider.cancel_subscription(sub["id"]).subscription.status == "cancelled"


def test_breaker_opens_fails_fast_and_recovers_through_half_open(ext):
    c = ext(breaker_min_calls=4, breaker_cooldown_seconds=30, http_max_attempts=1)
    c.sandbox.store.add_fault("provider", "500", count=-1)
    for _ in range(4):
        with pytest.raises(e.ExternalServerError):
            c.provider.get_item_price("credits-pro-USD-monthly")
    sent = c.provider.http.requests_sent
    with pytest.raises(e.CircuitOpen) as info:
        c.provider.get_item_price("credits-pro-USD-monthly")
    assert info.value.message == "Circuit breaker is open"
    assert c.provider.http.requests_sent == sent  # failed fast: nothing sent
    snap = c.breakers["subscription_provider"].snapshot()
    assert snap["state"] == "open" and snap["error_rate"] == 1.0
    assert c.metrics.sample("billing_circuit_breaker_state", {"dependency": "subscription_provider"}) == 2

    c.clock.advance(31)
    assert c.breakers["subscription_provider"].state() == "half_open"
    c.sandbox.store.clear_faults()
    assert c.provider.get_item_price("credits-pro-USD-monthly")["id"] == "credits-pro-USD-monthly"
    assert c.breakers["subscription_provider"].snapshot()["state"] == "closed"


def test_a_failed_half_open_probe_reopens(ext):
    c = ext(breaker_min_calls=2, breaker_cooldown_seconds=10, http_max_attempts=1)
    c.sandbox.store.add_fault("provider", "503", count=-1)
    for _ in range(2):
        with pytest.raises(e.ExternalServerError):
            c.provider.get_item_price("x")
    c.clock.advance(11)
    with pytest.raises(e.ExternalServerError):
        c.provider.get_item_price("x")  # the probe fails
    with pytest.raises(e.CircuitOpen):
        c.provider.get_item_price("x")


def test_a_success_that_started_before_the_breaker_opened_does_not_close_it(ext):
    """Issue "Hardening" 6: a slow call that began while the breaker was closed and succeeded after it
    opened closed it at once, with no cool-down and no probe. Only the half-open probe may close it."""
    import threading

    c = ext(breaker_min_calls=2, breaker_cooldown_seconds=30, http_max_attempts=1)
    breaker = c.breakers["subscription_provider"]
    c.sandbox.store.add_fault("provider", "slow", path="/item_prices/credits-pro-USD-monthly", delay=1.0)
    slow = threading.Thread(target=lambda: c.provider.get_item_price("credits-pro-USD-monthly"))
    slow.start()  # in flight while the breaker is closed
    c.sandbox.store.add_fault("provider", "503", path="/item_prices/x", count=-1)
    for _ in range(2):
        with pytest.raises(e.ExternalServerError):
            c.provider.get_item_price("x")
    assert breaker.state() == "open"
    slow.join(30)  # its success arrives now
    assert breaker.state() == "open"
    with pytest.raises(e.CircuitOpen):
        c.provider.get_item_price("credits-pro-USD-monthly")
    c.clock.advance(31)
    c.sandbox.store.clear_faults()
    assert c.provider.get_item_price("credits-pro-USD-monthly")["id"] == "credits-pro-USD-monthly"  # the probe
    assert breaker.state() == "closed"


def test_429_waits_retry_after_plus_jitter(ext):
    """Issue "Hardening" 6: every worker waited exactly Retry-After and came back in lockstep."""
    waits = []
    for _ in range(5):
        c = ext(http_max_attempts=2)
        c.sandbox.store.add_fault("provider", "429", count=1, retry_after=2)
        c.provider.get_item_price("credits-pro-USD-monthly")
        waits += c.sleeps
    assert all(2 <= w <= 2 + c.settings.http_backoff_max_seconds for w in waits)
    assert len(set(waits)) > 1  # not in lockstep


def test_an_invalid_key_opens_the_breaker(ext):
    c = ext(breaker_min_calls=3, provider_api_key="rotated-away")
    c.sandbox.store.set_meta("revoked_provider_keys", ["rotated-away"])
    for _ in range(3):
        with pytest.raises(e.ExternalAuthError):
            c.provider.get_item_price("credits-pro-USD-monthly")
    with pytest.raises(e.CircuitOpen):
        c.provider.get_item_price("credits-pro-USD-monthly")


def test_breaker_state_is_shared_through_redis(ext, redis_url):
    a = ext(redis_url=redis_url, breaker_min_calls=2, http_max_attempts=1)
    b = ext(redis_url=redis_url, breaker_min_calls=2, http_max_attempts=1)
    a.sandbox.store.add_fault("provider", "500", count=-1)
    for _ in range(2):
        with pytest.raises(e.ExternalServerError):
            a.provider.get_item_price("x")
    with pytest.raises(e.CircuitOpen):
        b.provider.get_item_price("x")


def test_circuit_breaker_endpoint_reports_each_dependency(ext):
    from webhooks_app import create_internal_app

    c = ext(breaker_min_calls=2, http_max_attempts=1)
    c.sandbox.store.add_fault("orchestrator", "500", count=-1)
    for _ in range(2):
        with pytest.raises(e.ExternalServerError):
            c.orchestrator.get_payment("pay_x")
    client = create_internal_app(container=c).test_client()
    body = client.get("/internal/health/circuit-breaker",
                      headers={"Authorization": "Bearer test-internal-token"}).get_json()
    assert set(body) == {"subscription_provider", "orchestrator"}
    assert body["orchestrator"]["state"] == "open" and body["orchestrator"]["error_rate"] == 1.0
    assert body["subscription_provider"] == {"state": "closed", "error_rate": 0.0, "calls": 0, "failures": 0}


def test_clients_over_a_real_loopback_server(make_settings, tmp_path):
    sandbox = Sandbox(SandboxStore(tmp_path / "served.db"))
    with LoopbackServer(create_combined_app(sandbox)) as server:
        c = Container(make_settings(database_url=f"sqlite:///{tmp_path / 'x.db'}",
                                    provider_url=f"{server.url}/provider", provider_api_key="k",
                                    orchestrator_url=f"{server.url}/orchestrator", orchestrator_api_key="k",
                                    http_timeout_seconds=0.5))
        c.provider.http.sleep = lambda s: None
        for i in range(120):
            subscribe(sandbox, f"user_{i}", "credits-basic-USD-monthly")
        assert len(list(c.provider.list_subscriptions())) == 120
        sandbox.store.add_fault("provider", "timeout", count=1, delay=1.5)
        assert c.provider.get_item_price("credits-basic-USD-monthly")["price"] == 999
        assert c.metrics.sample("billing_external_errors_total",
                                {"dependency": "subscription_provider", "error": "external_unavailable"}) == 1
        session = c.orchestrator.create_client_session(order_id="inv_1", customer_id="user_1", amount=999,
                                                       currency_code="USD", metadata={"lane": "sfw"})
        payment = sandbox.pay(session.order_id)
        assert c.orchestrator.get_payment(payment["id"]).status == "SETTLED"
        assert [p.id for p in c.orchestrator.list_payments("SETTLED")] == [payment["id"]]
        c.close()


def test_rate_limit_message_matches_the_contract(ext):
    c = ext(http_max_attempts=1)
    c.sandbox.store.add_fault("provider", "429", count=1, retry_after=0)
    with pytest.raises(e.RateLimited) as info:
        c.provider.get_customer("nobody")
    assert info.value.details["api_error_code"] == "api_request_limit_exceeded"
    assert info.value.message == "Please try after some time"


def test_a_provider_429_without_retry_after_waits_out_the_documented_block_and_closes_the_shared_budget(ext):
    """Issue 35 defect 9: the provider blocks a key for about a minute after a 429; the backoff (at most
    8 s, five tries) was spent inside the block."""
    c = ext()
    sub_id = subscribe(c.sandbox, "cust_429")["subscription"]["id"]
    c.sandbox.store.add_fault("provider", "429", count=1, retry_after=-1)  # no Retry-After in the answer
    c.provider_limiter.max_wait = 0.05  # no time passes here: the closed budget refuses the retry at once
    with pytest.raises(e.RateLimited) as refused:
        c.provider.get_subscription(sub_id)
    assert refused.value.details.get("client_side") is True  # the retry never reached the blocked provider
    assert c.sleeps[0] >= c.settings.provider_rate_block_seconds == 60
    stats = c.provider_limiter._call("get_window_stats", c.provider_limiter.item, c.provider_limiter.key)
    assert stats.remaining == 0  # the window was filled: every process of this key waits with this one
    assert c.sandbox.store.count_requests("provider", "GET", "subscriptions") == 1
    c.close()


# ---- Primer's idempotency: a processed key is 409 IdempotencyKeyAlreadyExists, never a replay (decision 123) --

def test_the_orchestrator_refuses_a_processed_key_with_409_and_processes_nothing_again(ext):
    c = ext()
    body = {"orderId": "inv_k", "currencyCode": "USD", "amount": 999, "customerId": "u", "metadata": {}}
    c.orchestrator.http.request("POST", "/client-session", json=body, idempotency_key="k1")
    for again in (body, body | {"amount": 1}):  # the same request, or another one under the same key
        with pytest.raises(e.AlreadyProcessed) as info:
            c.orchestrator.http.request("POST", "/client-session", json=again, idempotency_key="k1")
        assert (info.value.details["status"], info.value.details["api_error_code"]) == (
            409, "IdempotencyKeyAlreadyExists")
    assert c.sandbox.store.get("client_session", "inv_k")["amount"] == 999
    assert c.sandbox.store.count_requests("orchestrator", "POST", "/client-session") == 3  # never retried
    assert c.breakers["orchestrator"].snapshot()["state"] == "closed"


def test_a_refund_whose_answer_was_lost_is_read_back_and_refunds_once(ext):
    c = ext()
    session = c.orchestrator.create_client_session(order_id="inv_r", customer_id="u", amount=999,
                                                   currency_code="USD", metadata={"lane": "sfw"})
    paid = c.sandbox.pay(session.order_id)
    c.sandbox.store.add_fault("orchestrator", "error_after_effect", method="POST", path="/refund", count=1)
    refunded = c.orchestrator.refund_payment(paid["id"], 999, reason="duplicate charge")
    assert (refunded.id, refunded.refunded) == (paid["id"], 999)
    assert len(c.sandbox.store.get("payment", paid["id"])["refunds"]) == 1
    assert c.sandbox.store.count_requests("orchestrator", "POST", "/refund") == 2  # the lost one, then the 409


def test_a_client_session_whose_answer_was_lost_is_asked_for_again_under_a_key_of_its_own(ext):
    c = ext()
    seen = []
    c.orchestrator.http.client.event_hooks["request"].append(lambda req: seen.append(req.headers["x-idempotency-key"]))
    c.sandbox.store.add_fault("orchestrator", "error_after_effect", method="POST", path="/client-session", count=1)
    session = c.orchestrator.create_client_session(order_id="inv_s", customer_id="u", amount=999,
                                                   currency_code="USD", metadata={}, idempotency_key="session:k")
    assert session.client_token and session.order_id == "inv_s"
    assert seen == ["session:k", "session:k", "session:k:again"]


# ---- the provider's answers typed at the edge (issue 35, decision 122) ------------------------------------

def test_the_providers_answers_are_typed_copies_and_an_unreadable_entry_is_skipped_named_and_counted(ext, caplog):
    from billingctl.adapters.payloads import Invoice, Subscription, SubscriptionAnswer

    c = ext()
    made = [subscribe(c.sandbox, f"user_t{i}")["subscription"] for i in range(3)]
    assert all(isinstance(i, Invoice) for i in c.provider.list_invoices())
    broken = {**c.sandbox.subscription(made[1]["id"]), "current_term_end": "soon"}
    c.sandbox.store.put("subscription", made[1]["id"], broken)
    with caplog.at_level("ERROR", logger="billingctl.http"):
        listed = list(c.provider.list_subscriptions())
    assert all(isinstance(s, Subscription) for s in listed)
    assert [s.id for s in listed] == [made[0]["id"], made[2]["id"]]
    # this thread's records: a sandbox served by an earlier test of the worker may log from its own threads
    assert [r.entry_id for r in caplog.records if r.thread == threading.get_ident()] == [made[1]["id"]]
    assert c.metrics.sample("billing_external_errors_total", {"dependency": "subscription_provider",
                                                             "error": "external_payload_invalid"}) == 1
    with pytest.raises(e.ExternalPayloadInvalid, match="invalid subscription current_term_end"):
        c.provider.get_subscription(made[1]["id"])
    answer = c.provider.cancel_subscription(made[0]["id"])
    assert isinstance(answer, SubscriptionAnswer) and answer.subscription.status == "cancelled"
    assert answer.subscription.item_price_id == "credits-pro-USD-monthly"


def test_an_event_whose_content_cannot_be_read_is_held_and_parked_never_dropped(ext):
    """The poller reads an event as far as the inbox needs it; its content is read when it is processed, so
    a content the provider cannot have meant is retried and parked with an alert like any failure."""
    from billingctl.services import events
    from billingctl.services.provider_events import MAX_EVENT_ATTEMPTS

    c = ext()
    now = int(c.sandbox.store.now())
    c.sandbox.store.put_many("event", [{"id": "ev_odd", "occurred_at": now - 5, "event_type": "subscription_changed",
                                        "content": {"subscription": {"id": "sub_odd", "start_date": "tomorrow"}}}])
    for _ in range(MAX_EVENT_ATTEMPTS):
        events.poll(c)
    with c.uow() as uow:
        [row] = uow.inbox.listing("provider", None, None, 10)
    assert (row["event_id"], row["status"]) == ("ev_odd", "parked")
    assert "invalid event content.subscription.start_date" in row["last_error"]


def test_the_sandboxs_429_names_no_retry_after_unless_asked_as_the_provider_does(ext):
    """The provider documents a block of about a minute after a 429 and sends no Retry-After (decision 116)."""
    c = ext()
    c.sandbox.store.add_fault("provider", "429", count=1)
    plain = c.provider.http.client.get("/api/v2/item_prices/credits-pro-USD-monthly")
    assert plain.status_code == 429 and "Retry-After" not in plain.headers
    c.sandbox.store.add_fault("provider", "429", count=1, retry_after=2)
    asked = c.provider.http.client.get("/api/v2/item_prices/credits-pro-USD-monthly")
    assert (asked.status_code, asked.headers["Retry-After"]) == (429, "2")


def test_payments_of_several_statuses_are_listed_each_once_oldest_first_across_pages(ext):
    """The sandbox reads a list of statuses one status at a time and merges them (decision 234's
    neighbour: one statement walked a million payments in date order, 1.5 s): every page in the date
    order, then the order they were made, none twice, none left out."""
    c = ext()
    statuses = ["SETTLED", "PENDING", "AUTHORIZED", "SETTLING", "DECLINED"]
    docs = [{"id": f"pay_{i}", "status": statuses[i % 5], "orderId": f"order_{i}", "customerId": "u1",
             "amount": 999, "currencyCode": "USD", "date": 1_700_000_000 + (i * 7919) % 13,
             "processor": {"name": "SFW_STRIPE", "processorMerchantId": "acct_1"}, "metadata": {}}
            for i in range(40)]
    c.sandbox.store.put_many("payment", docs)
    in_flight = [d for d in docs if d["status"] in ("PENDING", "AUTHORIZED", "SETTLING")]
    expected = [d["id"] for d in sorted(in_flight, key=lambda d: (d["date"], int(d["id"][4:])))]
    assert [p.id for p in c.orchestrator.list_payments("PENDING,AUTHORIZED,SETTLING", limit=5)] == expected
    assert [p.id for p in c.orchestrator.list_payments("AUTHORIZED", limit=3)] == [
        i for i in expected if docs[int(i[4:])]["status"] == "AUTHORIZED"]
