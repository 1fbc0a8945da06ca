"""The session token's checks (spec section 7: identity only from a verified `sub`) and the quota's window
edges (spec section 3), each with its exact outcome. Written against the survivors of `make mutation`."""

import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import jwt
import pytest

from billingctl.domain.errors import AuthenticationFailed
from billingctl.domain.quota import CUSTOMER, MERCHANT, authorization_quota
from webhooks_app.session import _verify

pytestmark = pytest.mark.unit
KEY = "a-session-key-of-at-least-thirty-two-bytes!"


def settings(audience=None, issuer=None, max_age=300, key=KEY, algorithms=("HS256",)):
    return SimpleNamespace(secret=lambda name: key if name == "session_jwt_key" else None,
                           session_jwt_algorithms=list(algorithms), session_jwt_audience=audience,
                           session_jwt_issuer=issuer, session_jwt_max_age_seconds=max_age)


def token(**claims):
    now = int(time.time())
    body = {"sub": "user_a", "exp": now + 120, **claims}
    return jwt.encode({k: v for k, v in body.items() if v is not None}, KEY, algorithm="HS256")


def refused(tok, conf) -> str:
    with pytest.raises(AuthenticationFailed) as error:
        _verify(tok, conf)
    return error.value.message


def test_a_valid_token_gives_its_sub_and_nothing_else_does():
    assert _verify(token(), settings()) == "user_a"
    assert _verify(token(sub="u" * 64), settings()) == "u" * 64
    assert refused(token(sub="u" * 65), settings()) == "invalid session token"
    assert refused(token(sub=""), settings()) == "invalid session token"
    assert refused(token(sub=None), settings()) == "invalid session token"
    assert refused(token(exp=None), settings()) == "invalid session token"
    assert refused(token(), settings(key=None)) == "session verification is not configured"
    assert refused(token() + "x", settings()) == "invalid session token"
    assert refused(token(), settings(algorithms=("HS512",))) == "invalid session token"
    for expired in (int(time.time()) - 1, int(time.time())):  # no leeway: expired from its exp second on
        with pytest.raises(jwt.ExpiredSignatureError):
            _verify(token(exp=expired), settings())


def test_audience_and_issuer_are_required_when_configured_and_ignored_when_not():
    conf = settings(audience="billing", issuer="https://idp.example")
    assert _verify(token(aud="billing", iss="https://idp.example"), conf) == "user_a"
    for claims in ({"iss": "https://idp.example"}, {"aud": "billing"}, {"aud": "other", "iss": "https://idp.example"},
                   {"aud": "billing", "iss": "https://evil.example"}):
        assert refused(token(**claims), conf) == "invalid session token"
    assert _verify(token(aud="anything", iss="anyone"), settings()) == "user_a"


def test_a_lifetime_beyond_the_maximum_is_refused_at_its_edge():
    now = int(time.time())
    lifetime = "invalid session token: lifetime beyond the allowed maximum"
    assert refused(token(exp=now + 400), settings()) == lifetime
    assert _verify(token(exp=now + 250), settings()) == "user_a"
    assert _verify(token(exp=now + 120, iat=now - 180), settings()) == "user_a"  # exp - iat = 300: allowed
    assert refused(token(exp=now + 120, iat=now - 181), settings()) == lifetime
    assert refused(token(exp=now + 120, iat="yesterday"), settings()) == "invalid session token"


T0 = datetime(2026, 11, 1, tzinfo=UTC)


def test_a_window_holds_attempts_younger_than_its_length_and_those_stamped_after_now():
    """Issue 34 defect 7: an attempt stamped after `now` (another worker's clock ahead, or committed after
    this request read its time) is counted, never left out."""
    day = timedelta(days=1)
    attempts = [T0 - day, T0 - day + timedelta(seconds=1), T0, T0 + timedelta(seconds=1)]
    daily = authorization_quota(attempts, T0).windows[0]
    assert (daily.window, daily.used, daily.limit, daily.customer_limit) == ("daily", 3, 5, 4)
    assert daily.next_slot_frees_at == T0 + timedelta(seconds=1)
    monthly = authorization_quota(attempts, T0).windows[2]
    assert (monthly.window, monthly.used, monthly.limit, monthly.next_slot_frees_at) == (
        "monthly", 4, 30, T0 - day + timedelta(days=30))
    assert authorization_quota([], T0).windows[1].next_slot_frees_at is None


def test_the_first_window_that_refuses_is_named_and_the_initiator_is_kept():
    week = [T0 - timedelta(days=2, hours=h) for h in range(19)]  # 19 in the week, none today
    decision = authorization_quota(week, T0)
    assert (decision.allowed, decision.initiator, decision.blocking) == (False, CUSTOMER, "weekly")
    merchant = authorization_quota(week, T0, MERCHANT)
    assert (merchant.allowed, merchant.initiator, merchant.blocking) == (True, MERCHANT, None)
    both = authorization_quota(week + [T0] * 5, T0, MERCHANT)
    assert both.blocking == "daily"
    with pytest.raises(ValueError, match="initiator must be customer or merchant"):
        authorization_quota([], T0, "admin")
