"""Authentication helpers shared by the blueprints: constant-time comparisons, fail closed."""

from __future__ import annotations

import hmac

from flask import current_app, request

from billingctl.domain.errors import AuthenticationFailed


def constant_time_equal(a: str | bytes | None, b: str | bytes | None) -> bool:
    """False when either side is missing; never short-circuits on content."""
    if a is None or b is None:
        return False
    if isinstance(a, str):
        a = a.encode()
    if isinstance(b, str):
        b = b.encode()
    return hmac.compare_digest(a, b)


def bearer_token() -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def require_internal_token() -> None:
    """Every /internal/* request needs the internal bearer token; unset token refuses everything."""
    if not request.path.startswith("/internal/"):
        return None
    settings = current_app.extensions["billing"].settings
    expected = settings.secret("internal_token")
    if not expected:
        raise AuthenticationFailed("internal endpoints are disabled: BILLING_INTERNAL_TOKEN is not set")
    if not constant_time_equal(bearer_token(), expected):
        raise AuthenticationFailed("invalid or missing internal token")
    return None
