"""Webhook authentication schemes. Every comparison is constant-time; a missing secret fails closed."""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import re

from billingctl.domain.errors import AuthenticationFailed
from webhooks_app.auth import constant_time_equal

SKEW_SECONDS = 300


@functools.lru_cache(maxsize=32)
def secrets_of(value: str | None) -> tuple[str, ...]:
    """A secret setting may hold several comma-separated values during a rotation. Read once per value
    (a webhook reads its secret on every request; a changed setting is another value)."""
    return tuple(s.strip() for s in (value or "").split(",") if s.strip())


def verify_orchestrator(raw: bytes, primary: str | None, secondary: str | None, secrets: tuple[str, ...]) -> None:
    """X-Signature-Primary (or -Secondary during a rotation) = base64 HMAC-SHA256 of the raw body."""
    if not secrets:
        raise AuthenticationFailed("webhook secret is not configured")
    provided = [p for p in (primary, secondary) if p]
    if not provided:
        raise AuthenticationFailed("missing signature")
    expected = [base64.b64encode(hmac.new(s.encode(), raw, hashlib.sha256).digest()).decode() for s in secrets]
    matched = False
    for candidate in provided:
        for value in expected:
            matched |= constant_time_equal(candidate.strip(), value)
    if not matched:
        raise AuthenticationFailed("invalid signature")


_UNIX_SECONDS = re.compile(r"[0-9]{1,12}")  # ASCII digits only ("²".isdigit() is True), a sane length


def unix_seconds(value) -> int | None:
    """A unix timestamp written as ASCII digits (at most 12), else None: never an int() that raises."""
    text = value.strip() if isinstance(value, str) else str(value) if isinstance(value, int) and \
        not isinstance(value, bool) else ""
    return int(text) if _UNIX_SECONDS.fullmatch(text) else None


def check_timestamp(value, now: float, skew: int = SKEW_SECONDS) -> None:
    """A numeric unix timestamp within +/- skew seconds of now; anything else is rejected."""
    stamp = unix_seconds(value)
    if stamp is None:
        raise AuthenticationFailed("missing or non-numeric timestamp")
    if abs(int(now) - stamp) > skew:
        raise AuthenticationFailed("timestamp outside the allowed window")


def verify_timestamped(raw: bytes, header: str | None, secrets: tuple[str, ...], now: float) -> None:
    """`Verification-Signature: t=<unix>,v1=<hex>`: HMAC-SHA256 over "<t>.<raw body>"; the timestamp
    within +/- 5 minutes; several sets separated by spaces during a rotation, any may match."""
    if not secrets:
        raise AuthenticationFailed("webhook secret is not configured")
    if not header or not header.strip():
        raise AuthenticationFailed("missing signature")
    matched = False
    for chunk in header.split():
        fields = dict(part.split("=", 1) for part in chunk.split(",") if "=" in part)
        ts, sig = fields.get("t", ""), fields.get("v1", "")
        stamp = unix_seconds(ts)
        if stamp is None or not sig:
            continue
        if abs(int(now) - stamp) > SKEW_SECONDS:
            continue
        signed = ts.encode() + b"." + raw
        for secret in secrets:
            expected = hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
            matched |= constant_time_equal(sig.lower(), expected)
    if not matched:
        raise AuthenticationFailed("invalid signature")


def matches_any(provided: str | None, secrets: tuple[str, ...]) -> bool:
    """A shared secret sent as is (the workflow callback), compared in constant time with every value
    of a rotation (no early exit)."""
    matched = False
    for secret in secrets:
        matched |= constant_time_equal(provided, secret)
    return matched


def verify_standard_webhook(raw: bytes, headers, secret: str | None) -> str:
    """Standard Webhooks, verified by the reference library; returns the message id. Senders built on
    Svix name the same three headers svix-id, svix-timestamp and svix-signature. The secret is read as
    the library reads it: an optional "whsec_" prefix, then base64."""
    from standardwebhooks.webhooks import Webhook, WebhookVerificationError

    if not secret:
        raise AuthenticationFailed("webhook secret is not configured")
    needed = {f"webhook-{name}": headers.get(f"webhook-{name}") or headers.get(f"svix-{name}")
              for name in ("id", "timestamp", "signature")}
    if not all(needed.values()):
        raise AuthenticationFailed("missing webhook signature headers")
    verified = False
    for value in secrets_of(secret):  # any value of a rotation may sign
        try:
            Webhook(value).verify(raw, needed, json_parse=False)
            verified = True
        except (WebhookVerificationError, ValueError):
            continue
    if not verified:
        raise AuthenticationFailed("invalid signature")
    return needed["webhook-id"]
