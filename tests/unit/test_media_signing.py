"""Media signing (spec section 5 rules 5 and 6) as the edge WAF checks it: every verdict with its reason,
every refusal with its message, computed independently of the code under test. Written against the
survivors of `make mutation`."""

import base64
import hashlib
import hmac
from types import SimpleNamespace

import pytest

from billingctl.domain.errors import ConfigError, InvalidInput
from billingctl.services import media

pytestmark = pytest.mark.unit
SECRET, TTL, T = "media-secret", 3600, 1_800_000_000


def reference(path: str, ts: int) -> str:
    """The edge's own computation: HMAC-SHA256 over path + decimal timestamp, URL-safe base64, no padding."""
    digest = hmac.new(SECRET.encode(), f"{path}{ts}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def test_a_signature_is_the_edges_own():
    ts = T
    assert media.signature(SECRET, "/a.jpg", ts) == reference("/a.jpg", ts)
    assert media.sign(SECRET, "/a.jpg", ts) == f"/a.jpg?verify={ts}-{reference('/a.jpg', ts)}"
    assert media.sign(SECRET, "/a.jpg?w=2", ts) == f"/a.jpg?w=2&verify={ts}-{reference('/a.jpg?w=2', ts)}"


@pytest.mark.parametrize(("url", "now", "verdict"), [
    ("SIGNED", T, (True, "valid")),
    ("https://media.example.com/SIGNED", T + TTL - 1, (True, "valid")),
    ("SIGNED", T + TTL, (False, f"signature expired ({TTL} s old, TTL {TTL} s)")),
    ("SIGNED", T + TTL + 5, (False, f"signature expired ({TTL + 5} s old, TTL {TTL} s)")),
    ("SIGNED", T - 1, (False, "signature is future-dated")),
    ("/a.jpg", T, (False, "missing verify parameter (it must be the last one)")),
    ("/a.jpg?verify=abc", T, (False, "malformed verify parameter")),
    (f"/a.jpg?verify={T}-", T, (False, "malformed verify parameter")),
    (f"/a.jpg?verify={T}-AAAA", T, (False, "signature does not match")),
    (f"/b.jpg?verify={T}-{reference('/a.jpg', T)}", T, (False, "signature does not match")),
])
def test_every_verdict_and_its_reason(url, now, verdict):
    url = url.replace("SIGNED", media.sign(SECRET, "/a.jpg", T).lstrip("/") if url.startswith("https") else
                      media.sign(SECRET, "/a.jpg", T))
    result = media.verify(SECRET, url, now, TTL)
    assert (result.valid, result.reason) == verdict


def test_a_full_url_is_checked_on_its_path_and_query_only():
    signed = media.sign(SECRET, "/a.jpg?w=2", T)
    assert media.verify(SECRET, f"https://media.example.com{signed}", T, TTL).valid
    assert media.verify(SECRET, f"//media.example.com{signed}", T, TTL).valid  # scheme-relative
    assert not media.verify(SECRET, f"https://media.example.com/x{signed}", T, TTL).valid


@pytest.mark.parametrize(("path", "message"), [
    ("", "the path must start with /"),
    ("a.jpg", "the path must start with /"),
    ("/a.jpg?verify=1-x", "the path already carries a verify parameter"),
    ("/a.jpg#top", "a fragment (#) is never sent to the edge: it cannot be signed"),
    ("/a%zz.jpg", "the path has a malformed percent-escape"),
])
def test_sign_refuses_with_exact_messages(path, message):
    with pytest.raises(InvalidInput) as refused:
        media.sign(SECRET, path, T)
    assert refused.value.message == message


def test_a_path_with_VERIFY_in_capitals_is_an_ordinary_path():
    assert media.sign(SECRET, "/VERIFY=x.jpg", T).startswith("/VERIFY=x.jpg?verify=")


def test_options_and_origins_are_refused_with_exact_messages():
    container = SimpleNamespace(settings=SimpleNamespace(media_origin_allowlist=["media.example.com"]))
    assert media.check_options("width=200,fit=cover") == "width=200,fit=cover"
    with pytest.raises(InvalidInput) as refused:
        media.check_options("width=200;fit=cover")
    assert refused.value.message == "transformation options are malformed: name=value pairs joined by commas"
    media.check_origin(container, "/a.jpg")
    media.check_origin(container, "https://media.example.com/a.jpg")
    for origin in ("//evil.example/a.jpg", "///evil.example/a.jpg", "http://media.example.com/a.jpg", "https://evil.example/a.jpg",
                   "a.jpg", "javascript:alert(1)"):
        with pytest.raises(InvalidInput) as refused:
            media.check_origin(container, origin)
        assert refused.value.message == "the transformation origin is not allowed"


def test_cache_control_and_the_edge_ttl_warning_at_their_boundaries():
    assert media.cache_control_until(0) == "public, max-age=0"
    assert media.cache_control_until(-5) == "public, max-age=0"
    assert media.cache_control_until(90) == "public, max-age=90"
    hours72 = media.SIGNED_URL_CACHE_SECONDS
    assert media.edge_ttl_warning(SimpleNamespace(media_edge_ttl_seconds=hours72)) is None
    assert media.edge_ttl_warning(SimpleNamespace(media_edge_ttl_seconds=hours72 - 1)) == (
        f"BILLING_MEDIA_EDGE_TTL_SECONDS={hours72 - 1} is below the 72 h signed-URL cache: "
        "clients will see 403 for cached URLs")


def test_signing_without_a_secret_fails_closed_with_a_clear_message():
    container = SimpleNamespace(settings=SimpleNamespace(secret=lambda name: None))
    with pytest.raises(ConfigError) as missing:
        media._secret(container)
    assert missing.value.message == "BILLING_MEDIA_SIGNING_SECRET is not set"
