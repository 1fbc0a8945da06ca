"""The public host: webhooks, the session-authenticated user API, robots/sitemap, /auth-content/.

Nothing under /internal/, no /metrics, no profiling route.
"""

from __future__ import annotations

from flask import Flask


def register(app: Flask) -> None:
    from webhooks_app.blueprints import site, user_api, webhooks

    webhooks.register(app)
    user_api.register(app)
    site.register(app)
