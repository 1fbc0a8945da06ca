"""Media signed URLs compatible with the edge WAF's timed-HMAC rule (spec section 5 rules 5 and 6).

`verify=<unix_ts>-<signature>` is the last query parameter, appended with "?" or "&" (8 characters
with the name). The signature is HMAC-SHA256 over the path (everything before the separator, an
existing query string included) followed by the decimal timestamp, URL-safe base64 without padding.
The edge rejects missing, invalid, future-dated and expired (age >= TTL) signatures with 403."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

from billingctl.domain.errors import InvalidInput

SIGNED_URL_CACHE_SECONDS = 72 * 3600  # the service's own cache; the edge TTL must be longer


def cache_control_until(expires_in: int) -> str:
    """An answer that points at a signed URL is cached no longer than that URL stays valid."""
    return f"public, max-age={max(0, int(expires_in))}"
_SIGNED = re.compile(r"^(?P<path>.*?)(?P<sep>[?&])verify=(?P<ts>[^&?]*)$", re.DOTALL)


def signature(secret: str, path: str, ts: int) -> str:
    digest = hmac.new(secret.encode(), f"{path}{ts}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


# Characters a client sends as they are; everything else is percent-encoded, which is what the edge
# hashes (http.request.uri as received), so a space or a non-ASCII name signs what will be requested.
_URI_SAFE = "/?&=:@!$'()*+,;%~-._"
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_CANONICAL_TS = re.compile(r"0|[1-9][0-9]{0,11}")  # ASCII digits, no leading zero


def encode_path(path: str) -> str:
    if "#" in path:
        raise InvalidInput("a fragment (#) is never sent to the edge: it cannot be signed")
    if _BAD_ESCAPE.search(path):
        raise InvalidInput("the path has a malformed percent-escape")
    return quote(path, safe=_URI_SAFE)


def sign(secret: str, path: str, at: int) -> str:
    if not path or not path.startswith("/"):
        raise InvalidInput("the path must start with /")
    if "verify=" in path:
        raise InvalidInput("the path already carries a verify parameter")
    path = encode_path(path)
    separator = "&" if "?" in path else "?"
    return f"{path}{separator}verify={int(at)}-{signature(secret, path, int(at))}"


@dataclass(frozen=True)
class Verdict:
    valid: bool
    reason: str


def verify(secret: str, url: str, now: int, ttl: int) -> Verdict:
    parts = urlsplit(url)
    target = parts.path + (f"?{parts.query}" if parts.query else "") if parts.scheme or parts.netloc else url
    match = _SIGNED.match(target)
    if match is None:
        return Verdict(False, "missing verify parameter (it must be the last one)")
    ts_text, _, sig = match.group("ts").partition("-")
    if not _CANONICAL_TS.fullmatch(ts_text) or not sig:
        return Verdict(False, "malformed verify parameter")
    ts = int(ts_text)
    expected = signature(secret, match.group("path"), ts)
    if not hmac.compare_digest(expected.encode(), sig.encode()):
        return Verdict(False, "signature does not match")
    if ts > now:
        return Verdict(False, "signature is future-dated")
    if now - ts >= ttl:
        return Verdict(False, f"signature expired ({now - ts} s old, TTL {ttl} s)")
    return Verdict(True, "valid")


def signed_url(container, path: str, duration=None) -> str:
    """The URL the service hands out: cached for 72 h, always younger than the edge TTL.
    The generator's duration parameter is accepted and ignored (spec section 5 rule 5)."""
    del duration
    key = f"media:{path}"
    cached = container.cache.get(key)
    if cached:
        return cached
    url = sign(_secret(container), path, int(container.clock.now().timestamp()))
    container.cache.set(key, url, SIGNED_URL_CACHE_SECONDS)
    return url


OPTIONS = re.compile(r"[a-z]{1,16}=[a-z0-9._-]{1,32}(,[a-z]{1,16}=[a-z0-9._-]{1,32}){0,9}")


def check_options(options: str) -> str:
    """Transformation options: `name=value` pairs joined by commas (width=200,fit=cover), nothing else."""
    if not isinstance(options, str) or not OPTIONS.fullmatch(options):
        raise InvalidInput("transformation options are malformed: name=value pairs joined by commas")
    return options


def transformation_url(container, origin: str, options: str) -> str:
    """An image transformation URL embedding the signed origin URL; external origins are refused."""
    check_options(options)
    check_origin(container, origin)
    parts = urlsplit(origin)
    if parts.netloc:  # an allowlisted media host keeps its host; its own edge checks the path's signature
        return f"/media/transform/{options}/https://{parts.netloc}{signed_url(container, parts.path)}"
    return f"/media/transform/{options}{signed_url(container, origin)}"


def check_origin(container, origin: str) -> None:
    parts = urlsplit(origin)
    if parts.scheme or parts.netloc:
        if parts.scheme != "https" or parts.hostname not in container.settings.media_origin_allowlist:
            raise InvalidInput("the transformation origin is not allowed")
    elif not origin.startswith("/") or origin.startswith("//"):
        raise InvalidInput("the transformation origin is not allowed")


def edge_ttl_warning(settings) -> str | None:
    if settings.media_edge_ttl_seconds < SIGNED_URL_CACHE_SECONDS:
        return (f"BILLING_MEDIA_EDGE_TTL_SECONDS={settings.media_edge_ttl_seconds} is below the 72 h signed-URL cache: "
                "clients will see 403 for cached URLs")
    return None


def _secret(container) -> str:
    from billingctl.domain.errors import ConfigError

    secret = container.settings.secret("media_signing_secret")
    if not secret:
        raise ConfigError("BILLING_MEDIA_SIGNING_SECRET is not set")
    return secret
