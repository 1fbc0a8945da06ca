"""Alerts go through the outbox: nothing lost while the sink is down, delivered once when it is back."""

import json
from datetime import timedelta

import pytest
from sqlalchemy import select

from billingctl.adapters.db.tables import alert_outbox
from billingctl.bootstrap import Container
from billingctl.domain.clock import ManualClock
from billingctl.services.alerts import deliver_outbox, raise_alert, send_alert
from tests.helpers import LoopbackServer, RecordingSink

pytestmark = pytest.mark.integration


@pytest.fixture
def sink():
    recorder = RecordingSink()
    with LoopbackServer(recorder) as server:
        recorder.url = server.url + "/hook"
        yield recorder


def test_a_chat_alert_waits_while_the_sink_is_down_and_is_delivered_once(make_settings, db_url, sink):
    c = Container(make_settings(database_url=db_url, alert_webhook_url=sink.url), clock=ManualClock())
    sink.up = False
    result = send_alert(c, "ORPHANED PAYMENT RECOVERY EXHAUSTED - manual review required", dedupe_key="orphan:pay_1")
    assert result["queued"] is True
    assert result["delivery"] == {"delivered": 0, "failed": 1, "unconfigured": 0, "pending": 1}

    sink.up = True
    assert deliver_outbox(c)["delivered"] == 0  # backing off: not due yet
    c.clock.advance(timedelta(minutes=5).total_seconds())
    assert deliver_outbox(c)["delivered"] == 1
    c.clock.advance(3600)
    assert deliver_outbox(c) == {"delivered": 0, "failed": 0, "unconfigured": 0, "pending": 0}
    assert [json.loads(b)["text"] for b in sink.received] == [
        "ORPHANED PAYMENT RECOVERY EXHAUSTED - manual review required"]


def test_the_same_dedupe_key_queues_once(make_settings, db_url, sink):
    c = Container(make_settings(database_url=db_url, alert_webhook_url=sink.url), clock=ManualClock())
    with c.uow() as uow:
        assert raise_alert(uow, c.clock, "same-plan duplicate charge during orphan recovery", "dup:pay_9") is True
        assert raise_alert(uow, c.clock, "same-plan duplicate charge during orphan recovery", "dup:pay_9") is False
        uow.commit()
    deliver_outbox(c)
    deliver_outbox(c)
    assert len(sink.received) == 1


def test_an_unset_sink_keeps_messages_pending(container):
    result = send_alert(container, "hello", user_id="user_1")
    assert result["delivery"]["unconfigured"] == 1
    with container.uow() as uow:
        rows = uow.execute(select(alert_outbox)).mappings().all()
    assert [(r["sink"], r["status"], r["payload"]) for r in rows] == [
        ("notify", "pending", {"user_id": "user_1", "message": "hello"})]


def test_alert_endpoint_validates_and_queues(container):
    from webhooks_app import create_internal_app

    client = create_internal_app(container=container).test_client()
    auth = {"Authorization": "Bearer test-internal-token"}
    assert client.post("/internal/notifications/alert", json={"user_id": "u"}, headers=auth).status_code == 400
    assert client.post("/internal/notifications/alert", data="nope", headers=auth).status_code == 400
    response = client.post("/internal/notifications/alert", json={"message": "disk full"}, headers=auth)
    assert response.status_code == 202 and response.get_json()["sink"] == "chat"
    assert client.post("/internal/notifications/alert", json={"message": "x"}).status_code == 401


def test_undeliverable_messages_never_starve_a_chat_alert(make_settings, db_url, sink):
    """Issue "Money paths" defect 11: delivery took the 100 oldest rows of every sink and skipped those
    with no URL; after 100 analytics messages (no analytics URL is required) no chat alert was sent."""
    c = Container(make_settings(database_url=db_url, alert_webhook_url=sink.url), clock=ManualClock())
    with c.uow() as uow:
        for n in range(120):
            from billingctl.services.alerts import enqueue

            enqueue(uow, c.clock, "analytics", {"event": "payment_recorded", "n": n}, f"analytics:{n}")
        raise_alert(uow, c.clock, "ORPHANED PAYMENT RECOVERY EXHAUSTED - manual review required", "orphan:pay_9")
        uow.commit()
    result = deliver_outbox(c)
    assert (result["delivered"], result["unconfigured"], result["pending"]) == (1, 120, 120)
    assert [json.loads(b)["text"] for b in sink.received] == [
        "ORPHANED PAYMENT RECOVERY EXHAUSTED - manual review required"]
    c.close()


def test_chat_alerts_escape_data_and_carry_a_fallback(make_settings, db_url, sink):
    """Issue "Observability" 7: `<!channel>` inside an alert or an embedded error pinged the channel."""
    c = Container(make_settings(database_url=db_url, alert_webhook_url=sink.url), clock=ManualClock())
    with c.uow() as uow:
        raise_alert(uow, c.clock, "Inbox event parked: <!channel> & <https://evil|click>", "esc:1",
                    error="provider said <!here> <@U123>")
        uow.commit()
    assert deliver_outbox(c)["delivered"] == 1
    body = json.loads(sink.received[0])
    assert body["text"] == "Inbox event parked: &lt;!channel&gt; &amp; &lt;https://evil|click&gt;"
    [attachment] = body["attachments"]
    assert attachment["fields"][0]["value"] == "provider said &lt;!here&gt; &lt;@U123&gt;"
    assert attachment["fallback"].startswith("Inbox event parked: &lt;!channel&gt;")
    assert "<" not in json.dumps(body)
    c.close()
