"""Webhook authentication schemes. Every comparison is constant-time; a missing secret fails closed."""

from __future__ import annotations

import base64
import hashlib
import hmac

from billingctl.domain.errors import AuthenticationFailed
from webhooks_app.auth import constant_time_equal

SKEW_SECONDS = 300


def secrets_of(value: str | None) -> list[str]:
    """A secret setting may hold several comma-separated values during a rotation."""
    return [s.strip() for s in (value or "").split(",") if s.strip()]


def verify_orchestrator(raw: bytes, primary: str | None, secondary: str | None, secrets: list[str]) -> None:
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


def check_timestamp(value, now: float, skew: int = SKEW_SECONDS) -> None:
    """A numeric unix timestamp within +/- skew seconds of now; anything else is rejected."""
    text = str(value).strip() if value is not None else ""
    if not text.isdigit():
        raise AuthenticationFailed("missing or non-numeric timestamp")
    if abs(now - int(text)) > skew:
        raise AuthenticationFailed("timestamp outside the allowed window")
