"""robots.txt, sitemap.xml, /auth-content/ and the media transformation entry point."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

from flask import Blueprint, Response, current_app, redirect, request, send_from_directory
from werkzeug.exceptions import NotFound as WerkzeugNotFound
from werkzeug.security import safe_join

from billingctl.domain.errors import InvalidInput

bp = Blueprint("site", __name__)
AUTH_PREFIX = "/auth-content/"
def container():
    return current_app.extensions["billing"]


def _base_url() -> str:
    from xml.sax.saxutils import escape

    return escape(container().settings.public_base_url.rstrip("/"))


@bp.get("/robots.txt")
def robots():
    # The sitemap by an absolute URL (the robots.txt standard); from settings, never from the Host header.
    return Response(f"User-agent: *\nDisallow: /auth-content/\nSitemap: {_base_url()}/sitemap.xml\n",
                    mimetype="text/plain")


@bp.get("/sitemap.xml")
def sitemap():
    body = ('<?xml version="1.0" encoding="UTF-8"?>\n'
            '<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">\n'
            f"  <url><loc>{_base_url()}/</loc></url>\n"
            "</urlset>\n")
    return Response(body, mimetype="application/xml")


def _target_path() -> str:
    """The request target's path as sent (an absolute-form target `http://host/p` gives `/p`)."""
    raw = request.environ.get("RAW_URI") or request.environ.get("REQUEST_URI") or request.full_path
    raw = raw.split("?", 1)[0]
    if "://" in raw.split("/", 1)[0] or raw.lower().startswith(("http://", "https://")):
        raw = urlsplit(raw).path or "/"
    return raw


def _climbs(path: str) -> bool:
    """A traversal in any encoding: a `.` or `..` segment, an empty segment, an absolute path, a
    backslash or a NUL. A name that merely contains `..` (`a..b.txt`) is a file."""
    for _ in range(3):  # %252e%252e -> %2e%2e -> ..
        decoded = unquote(path)
        if decoded == path:
            break
        path = decoded
    if "\\" in path or "\x00" in path or path.startswith("/"):
        return True
    segments = path.split("/")
    return any(seg in (".", "..") for seg in segments) or "" in segments[:-1]


def guard_auth_content():
    """Runs before routing for every /auth-content path, any method: without a session a bare 404
    (nothing else is revealed); with one, a traversal is a 400 and only GET and HEAD are served."""
    sent = request.environ.get("RAW_URI") or request.environ.get("REQUEST_URI")
    if sent and "%" not in sent and "auth-content" not in sent:
        return None  # the target names the prefix in no spelling: every webhook, at the cost of two lookups
    raw = _target_path()
    if not (request.path.startswith(AUTH_PREFIX) or raw.startswith(AUTH_PREFIX)
            or unquote(raw).startswith(AUTH_PREFIX)):
        return None
    from webhooks_app.session import current_session_user

    if current_session_user() is None:
        return Response(b"", status=404)  # a bare 404: no redirect, no hint, for every method
    rest = raw[len(AUTH_PREFIX):] if raw.startswith(AUTH_PREFIX) else unquote(raw)[len(AUTH_PREFIX):]
    if _climbs(rest) or _climbs(request.path[len(AUTH_PREFIX):]):
        raise InvalidInput("invalid path")
    if request.method not in ("GET", "HEAD"):
        return Response(b"", status=404)
    return None


@bp.get("/auth-content/<path:subpath>")
def auth_content(subpath):
    directory = os.path.realpath(container().settings.auth_content_dir)
    target = safe_join(directory, subpath)
    if target is None or not os.path.realpath(target).startswith(directory + os.sep):
        raise InvalidInput("invalid path")
    try:
        return send_from_directory(directory, subpath)
    except WerkzeugNotFound:
        return Response(b"", status=404)


@bp.get("/media/transform/<options>/<path:origin>", merge_slashes=False)  # keeps https:// of an origin
def media_transform(options, origin):
    """Edge stand-in: the embedded origin must be ours and validly signed; answers are cached a year."""
    from billingctl.services.media import cache_control_until, check_options, check_origin, encode_path, verify

    c = container()
    check_options(options)  # before anything is echoed: a CRLF or <script> is a 400
    query = request.query_string.decode("latin-1")
    host = ""
    if origin.startswith("https://"):  # an allowlisted media host, kept as it is
        parts = urlsplit(origin)
        host, origin = f"https://{parts.netloc}", parts.path.lstrip("/")
    signed = encode_path("/" + origin) + (f"?{query}" if query else "")
    check_origin(c, host + signed.split("?", 1)[0])
    now, ttl = int(c.clock.now().timestamp()), c.settings.media_edge_ttl_seconds
    verdict = verify(c.settings.secret("media_signing_secret") or "", signed, now, ttl)
    if not verdict.valid:
        return Response(b"", status=403)
    issued = int(signed.rsplit("verify=", 1)[1].split("-", 1)[0])
    response = redirect(host + signed, code=302)
    response.headers["Cache-Control"] = cache_control_until(issued + ttl - now)
    response.headers["X-Transform-Options"] = options
    return response


def register(app) -> None:
    app.before_request(guard_auth_content)
    app.register_blueprint(bp)



