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


def _decode(token: str, settings, key, verify_exp: bool = True) -> dict:
    required = ["exp", "sub"] + (["aud"] if settings.session_jwt_audience else []) + (
        ["iss"] if settings.session_jwt_issuer else [])
    return jwt.decode(token, key, algorithms=list(settings.session_jwt_algorithms),
                      audience=settings.session_jwt_audience, issuer=settings.session_jwt_issuer,
                      options={"require": required, "verify_aud": bool(settings.session_jwt_audience),
                               "verify_exp": verify_exp},
                      leeway=0)


def _verify(token: str, settings) -> str:
    key = settings.secret("session_jwt_key")
    if not key:
        raise AuthenticationFailed("session verification is not configured")
    try:
        claims = _decode(token, settings, key)
    except jwt.ExpiredSignatureError:
        # Only a token that is ours in every other way is sent to sign in again (issue 37: an expired
        # token for another audience was redirected as if it were ours).
        try:
            _valid_claims(_decode(token, settings, key, verify_exp=False), settings)
        except jwt.PyJWTError:
            raise AuthenticationFailed("invalid session token") from None
        raise
    except jwt.PyJWTError:
        raise AuthenticationFailed("invalid session token") from None
    return _valid_claims(claims, settings)


def _valid_claims(claims: dict, settings) -> str:
    """The session's user id, once the lifetime and the subject are sound: `exp` a number (PyJWT also
    takes digits in a string, which broke the arithmetic below: a 500) and `sub` one of our ids (no NUL,
    newline, path or space: it becomes a database key and a log field)."""
    from billingctl.domain.plans import looks_like_id

    exp, issued = claims.get("exp"), claims.get("iat")
    if not isinstance(exp, int | float) or isinstance(exp, bool):
        raise AuthenticationFailed("invalid session token")
    now = time.time()
    max_age = settings.session_jwt_max_age_seconds
    if exp - now > max_age or (isinstance(issued, int | float) and exp - issued > max_age):
        raise AuthenticationFailed("invalid session token: lifetime beyond the allowed maximum")
    sub = claims.get("sub")
    if not looks_like_id(sub) or len(sub) > 64:
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
