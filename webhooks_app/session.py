"""Session authentication for the user API: the short-lived session JWT as a Bearer token.

Identity comes only from the token's `sub`; an expired token is a 307 to sign-in; anything else
wrong is a 401. A user id in client input is never read."""

from __future__ import annotations

import functools
import time

import jwt
from flask import current_app, g, redirect

from billingctl.domain.errors import AuthenticationFailed
from webhooks_app.auth import bearer_token


def _verify(token: str, settings) -> str:
    key = settings.secret("session_jwt_key")
    if not key:
        raise AuthenticationFailed("session verification is not configured")
    try:
        required = ["exp", "sub"] + (["aud"] if settings.session_jwt_audience else []) + (
            ["iss"] if settings.session_jwt_issuer else [])
        claims = jwt.decode(token, key, algorithms=list(settings.session_jwt_algorithms),
                            audience=settings.session_jwt_audience, issuer=settings.session_jwt_issuer,
                            options={"require": required, "verify_aud": bool(settings.session_jwt_audience)},
                            leeway=0)
    except jwt.ExpiredSignatureError:
        raise
    except jwt.PyJWTError:
        raise AuthenticationFailed("invalid session token") from None
    now = time.time()
    max_age = settings.session_jwt_max_age_seconds
    issued = claims.get("iat")
    if claims["exp"] - now > max_age or (isinstance(issued, int | float) and claims["exp"] - issued > max_age):
        raise AuthenticationFailed("invalid session token: lifetime beyond the allowed maximum")
    sub = claims.get("sub")
    if not isinstance(sub, str) or not sub or len(sub) > 64:
        raise AuthenticationFailed("invalid session token")
    return sub


def current_session_user() -> str | None:
    """The session's user, or None when there is no valid session (for routes that answer 404)."""
    token = bearer_token()
    if token is None:
        return None
    try:
        return _verify(token, current_app.extensions["billing"].settings)
    except (jwt.PyJWTError, AuthenticationFailed):
        return None


def session_required(view):
    @functools.wraps(view)
    def wrapper(*args, **kwargs):
        container = current_app.extensions["billing"]
        token = bearer_token()
        if token is None:
            raise AuthenticationFailed("a session token is required")
        try:
            g.user_id = _verify(token, container.settings)
        except jwt.ExpiredSignatureError:
            return redirect(container.settings.sign_in_url, code=307)
        container.user_limiter.admit(g.user_id)  # before any work: a flood costs one counter each
        _ensure_user(container, g.user_id)
        return view(*args, **kwargs)

    return wrapper


def _ensure_user(container, user_id: str) -> None:
    """A user seen for the first time in a valid session is created (the identity webhook may lag)."""
    with container.uow() as uow:
        uow.users.ensure(user_id, container.clock.now())
        uow.commit()
