"""robots.txt, sitemap.xml, /auth-content/ and the media transformation entry point."""

from __future__ import annotations

import os
import re
from urllib.parse import unquote

from flask import Blueprint, Response, current_app, redirect, request, send_from_directory
from werkzeug.exceptions import NotFound as WerkzeugNotFound
from werkzeug.security import safe_join

from billingctl.domain.errors import InvalidInput

bp = Blueprint("site", __name__)
AUTH_PREFIX = "/auth-content/"
# Anything that could climb out of the directory, in any encoding: rejected before routing.
_TRAVERSAL = re.compile(r"(\.\.|%2e|%2f|%5c|\\|%00|\x00|%25|//)", re.IGNORECASE)


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


def guard_auth_content():
    """Runs before routing for every /auth-content path: traversal is 400 whether signed in or not."""
    raw = request.environ.get("RAW_URI") or request.environ.get("REQUEST_URI") or request.full_path
    if not (request.path.startswith(AUTH_PREFIX) or unquote(raw).startswith(AUTH_PREFIX)
            or raw.startswith(AUTH_PREFIX)):
        return None
    raw_path = raw.split("?", 1)[0]
    rest = raw_path[len(AUTH_PREFIX):] if raw_path.startswith(AUTH_PREFIX) else raw_path
    decoded = request.path[len(AUTH_PREFIX):]
    if _TRAVERSAL.search(rest) or _TRAVERSAL.search(decoded) or decoded.startswith("/") or \
            os.path.isabs(decoded) or "\x00" in decoded:
        raise InvalidInput("invalid path")
    return None


@bp.get("/auth-content/<path:subpath>")
def auth_content(subpath):
    from webhooks_app.session import current_session_user

    if current_session_user() is None:
        return Response(b"", status=404)  # a bare 404: no redirect, no hint
    directory = os.path.realpath(container().settings.auth_content_dir)
    target = safe_join(directory, subpath)
    if target is None or not os.path.realpath(target).startswith(directory + os.sep):
        raise InvalidInput("invalid path")
    try:
        return send_from_directory(directory, subpath)
    except WerkzeugNotFound:
        return Response(b"", status=404)


@bp.get("/media/transform/<options>/<path:origin>")
def media_transform(options, origin):
    """Edge stand-in: the embedded origin must be ours and validly signed; answers are cached a year."""
    from billingctl.services.media import IMAGE_CACHE_CONTROL, check_origin, verify

    c = container()
    signed = "/" + origin + (f"?{request.query_string.decode()}" if request.query_string else "")
    check_origin(c, signed.split("?", 1)[0])
    verdict = verify(c.settings.secret("media_signing_secret") or "", signed, int(c.clock.now().timestamp()),
                     c.settings.media_edge_ttl_seconds)
    if not verdict.valid:
        return Response(b"", status=403)
    response = redirect(signed, code=302)
    response.headers["Cache-Control"] = IMAGE_CACHE_CONTROL
    response.headers["X-Transform-Options"] = options
    return response


def register(app) -> None:
    app.before_request(guard_auth_content)
    app.register_blueprint(bp)



