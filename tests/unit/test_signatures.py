"""Webhook authentication schemes (spec section 7): each scheme's accept and reject cases with their
exact messages, the +/- 5 minute window at its edges, rotations where any value may sign, computed
independently of the code under test. Written against the survivors of `make mutation`."""

import base64
import hashlib
import hmac
import json

import pytest
from standardwebhooks.webhooks import Webhook

from billingctl.domain.errors import AuthenticationFailed
from webhooks_app import signatures as sig

pytestmark = pytest.mark.unit
BODY, NOW = b'{"eventType":"PAYMENT.STATUS"}', 1_800_000_000


def rejected(call, *args) -> str:
    with pytest.raises(AuthenticationFailed) as refused:
        call(*args)
    return refused.value.message


def b64(secret, body=BODY):
    return base64.b64encode(hmac.new(secret.encode(), body, hashlib.sha256).digest()).decode()


def stamped(secret, t, body=BODY):
    return f"t={t},v1=" + hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()


def test_secrets_of_reads_a_rotation():
    assert sig.secrets_of(" a , b,,") == ("a", "b")
    assert sig.secrets_of(None) == () and sig.secrets_of("") == ()


def test_the_orchestrator_scheme():
    sig.verify_orchestrator(BODY, b64("new"), None, ["old", "new"])
    sig.verify_orchestrator(BODY, None, b64("old"), ["old", "new"])  # the secondary header during a rotation
    sig.verify_orchestrator(BODY, "wrong", f" {b64('new')} ", ["new"])  # any provided header may match
    assert rejected(sig.verify_orchestrator, BODY, b64("x"), None, []) == "webhook secret is not configured"
    assert rejected(sig.verify_orchestrator, BODY, None, "", ["new"]) == "missing signature"
    assert rejected(sig.verify_orchestrator, BODY, b64("other"), b64("x"), ["new"]) == "invalid signature"
    assert rejected(sig.verify_orchestrator, BODY + b" ", b64("new"), None, ["new"]) == "invalid signature"


@pytest.mark.parametrize(("value", "parsed"), [
    ("1800000000", 1_800_000_000), (" 12 ", 12), (12, 12), ("999999999999", 999_999_999_999),
    ("1234567890123", None), ("", None), (None, None), (True, None), ("1.5", None), ("-5", None), ("²", None),
    ("12a", None), (1.0, None),
])
def test_unix_seconds(value, parsed):
    assert sig.unix_seconds(value) == parsed


def test_check_timestamp_at_the_edges_of_the_window():
    for t in (NOW - 300, NOW, NOW + 300):
        sig.check_timestamp(str(t), NOW)
    for t in (NOW - 301, NOW + 301):
        assert rejected(sig.check_timestamp, str(t), NOW) == "timestamp outside the allowed window"
    assert rejected(sig.check_timestamp, "soon", NOW) == "missing or non-numeric timestamp"
    sig.check_timestamp(str(NOW + 10), NOW + 0.9, skew=10)  # seconds of `now` are whole seconds
    assert rejected(sig.check_timestamp, str(NOW + 11), NOW, 10) == "timestamp outside the allowed window"


def test_the_timestamped_scheme():
    sig.verify_timestamped(BODY, stamped("s1", NOW), ["s1"], NOW)
    sig.verify_timestamped(BODY, stamped("s1", NOW).upper().replace("T=", "t=").replace("V1=", "v1="), ["s1"], NOW)
    sig.verify_timestamped(BODY, f"{stamped('old', NOW)} {stamped('new', NOW)}", ["new"], NOW)  # any set
    sig.verify_timestamped(BODY, stamped("s2", NOW), ["s1", "s2"], NOW)  # any secret of a rotation
    for t in (NOW - 300, NOW + 300):
        sig.verify_timestamped(BODY, stamped("s1", t), ["s1"], NOW)
    for t in (NOW - 301, NOW + 301):
        assert rejected(sig.verify_timestamped, BODY, stamped("s1", t), ["s1"], NOW) == "invalid signature"
    assert rejected(sig.verify_timestamped, BODY, stamped("s1", NOW), [], NOW) == "webhook secret is not configured"
    assert rejected(sig.verify_timestamped, BODY, "  ", ["s1"], NOW) == "missing signature"
    assert rejected(sig.verify_timestamped, BODY, None, ["s1"], NOW) == "missing signature"
    for header in (f"t={NOW}", f"v1=abc,t=x{NOW}", f"t={NOW},v1=", stamped("s1", NOW).replace(",", ";")):
        assert rejected(sig.verify_timestamped, BODY, header, ["s1"], NOW) == "invalid signature"
    assert rejected(sig.verify_timestamped, BODY + b"x", stamped("s1", NOW), ["s1"], NOW) == "invalid signature"


def test_a_shared_secret_matches_any_value_of_a_rotation_and_nothing_else():
    assert sig.matches_any("b", ["a", "b"]) and sig.matches_any("a", ["a", "b"])
    assert not sig.matches_any("c", ["a", "b"]) and not sig.matches_any(None, ["a"]) and not sig.matches_any("a", [])


def test_standard_webhooks_with_either_header_names_and_a_rotation():
    secret_new = "whsec_" + base64.b64encode(b"new-secret-bytes-0123456789").decode()
    secret_old = "whsec_" + base64.b64encode(b"old-secret-bytes-0123456789").decode()
    body = json.dumps({"type": "user.created"}).encode()
    from datetime import UTC, datetime

    stamp = datetime.now(UTC)
    signature = Webhook(secret_new).sign("msg_1", stamp, body.decode())
    headers = {"webhook-id": "msg_1", "webhook-timestamp": str(int(stamp.timestamp())),
               "webhook-signature": signature}
    assert sig.verify_standard_webhook(body, headers, f"{secret_old},{secret_new}") == "msg_1"
    svix = {k.replace("webhook-", "svix-"): v for k, v in headers.items()}
    assert sig.verify_standard_webhook(body, svix, secret_new) == "msg_1"
    assert rejected(sig.verify_standard_webhook, body, headers, "") == "webhook secret is not configured"
    assert rejected(sig.verify_standard_webhook, body, {**headers, "webhook-id": ""}, secret_new) == \
        "missing webhook signature headers"
    assert rejected(sig.verify_standard_webhook, body, headers, secret_old) == "invalid signature"
    assert rejected(sig.verify_standard_webhook, body, headers, "not base64!") == "invalid signature"


def test_a_timestamped_rotation_skips_unreadable_or_stale_sets_and_any_secret_may_sign():
    sig.verify_timestamped(BODY, f"t=bad,v1=abc {stamped('s1', NOW)}", ["s1"], NOW)  # an unreadable set first
    sig.verify_timestamped(BODY, f"{stamped('s1', NOW - 301)} {stamped('s1', NOW)}", ["s1"], NOW)  # a stale one
    sig.verify_timestamped(BODY, stamped("s1", NOW), ["s1", "s2"], NOW)  # the first secret of a rotation


def test_a_standard_webhook_body_that_is_not_json_is_still_authenticated():
    """Verifying a signature says nothing about the body's shape: reading it is the endpoint's job (a 400)."""
    from datetime import UTC, datetime

    secret = "whsec_" + base64.b64encode(b"new-secret-bytes-0123456789").decode()
    stamp = datetime.now(UTC)
    body = b"not json"
    headers = {"webhook-id": "msg_2", "webhook-timestamp": str(int(stamp.timestamp())),
               "webhook-signature": Webhook(secret).sign("msg_2", stamp, body.decode())}
    assert sig.verify_standard_webhook(body, headers, secret) == "msg_2"
