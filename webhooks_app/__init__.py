"""The two WSGI apps, built by one factory: public (webhooks, user API, robots, /auth-content/) and
internal (/internal/*, /metrics, /healthz). They never share a listener."""

from __future__ import annotations

from datetime import date, datetime

from flask import Flask
from flask.json.provider import DefaultJSONProvider
from flask.testing import FlaskClient

from billingctl.bootstrap import Container, bootstrap
from billingctl.sandbox.delivery import provide_receiver
from billingctl.settings import Settings
from webhooks_app.errors import register_error_handlers


class IsoJSONProvider(DefaultJSONProvider):
    """Dates as ISO 8601, like the CLI's --json (Flask's default is RFC 1123: `Tue, 14 Nov 2023 …`)."""

    @staticmethod
    def default(o):
        if isinstance(o, date | datetime):
            return o.isoformat()
        return DefaultJSONProvider.default(o)


class ClosingTestClient(FlaskClient):
    """Flask's test client, closing each response once read as every WSGI server does once it has sent it
    (gunicorn, httpx's WSGI transport): the work a view left for after its answer (`call_on_close`) runs."""

    def open(self, *args, **kwargs):
        kwargs.setdefault("buffered", True)
        return super().open(*args, **kwargs)


class BillingFlask(Flask):
    """Flask, with each view's and hook's `ensure_sync` decided once per function instead of by `inspect`
    on every request (issue 39 item 4: two of a duplicate webhook's calls, a dozen Python frames)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._synced: dict = {}

    def ensure_sync(self, func):
        synced = self._synced.get(func)
        if synced is None:
            synced = self._synced[func] = super().ensure_sync(func)
        return synced


def _base_app(name: str, settings: Settings | None, container: Container | None) -> Flask:
    container = container or bootstrap(settings)
    app = BillingFlask(name, static_folder=None)  # no /static route: the route table is exactly the documented one
    app.test_client_class = ClosingTestClient
    app.json = IsoJSONProvider(app)
    app.config.update(JSON_SORT_KEYS=False, MAX_CONTENT_LENGTH=1 << 20)
    app.extensions["billing"] = container
    register_error_handlers(app)
    return app


def _built(app: Flask) -> Flask:
    """The vendor models' validators built before the first request (each is built on its first use)."""
    from billingctl.adapters.payloads import build_all

    build_all()
    return app


def create_public_app(settings: Settings | None = None, container: Container | None = None,
                      sync_worker: bool = False) -> Flask:
    """`sync_worker`: the app is served by a sync worker, one request thread a process (the gunicorn entry
    point). A webhook's provider follow-ups then run on one thread of the process once its answer is sent,
    not in the thread that served it (webhooks_app.followups), and the duplicate read keeps its
    connection between requests (billingctl.adapters.db.sql.HeldConnection)."""
    from billingctl.adapters.ratelimit import INTERACTIVE, MONEY
    from webhooks_app.blueprints import public
    from webhooks_app.followups import FollowupThread, run_inline

    app = _base_app("billing-public", settings, container)
    app.extensions["billing_followups"] = FollowupThread() if sync_worker else run_inline
    if sync_worker:
        app.extensions["billing"].hold_read_connection()
    # Provider calls of a web request never wait for the limiter; webhooks record money, the user API is
    # interactive (its share is capped so it can never starve recording).
    app.wsgi_app = RequestBudget(app.wsgi_app, "/webhooks/", MONEY, INTERACTIVE)
    public.register(app)
    return _built(app)


class RequestBudget:
    """The budget class of a web request's provider calls, set around the whole request (its answer built)
    and reset after it: `matched` for a path under `prefix` (or equal to it, `exact`), else `other`. A WSGI
    wrapper, not a pair of Flask hooks: it costs a duplicate webhook one context variable and nothing else
    (issue 39 item 4)."""

    def __init__(self, wsgi_app, prefix: str, matched: str, other: str, exact: bool = False):
        from billingctl.adapters.ratelimit import reset_request_budget, set_request_budget

        self.wsgi_app, self.prefix, self.matched, self.other, self.exact = wsgi_app, prefix, matched, other, exact
        self._set, self._reset = set_request_budget, reset_request_budget

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO") or "/"
        hit = path == self.prefix if self.exact else path.startswith(self.prefix)
        token = self._set(self.matched if hit else self.other)
        try:
            return self.wsgi_app(environ, start_response)
        finally:
            self._reset(token)


def create_internal_app(settings: Settings | None = None, container: Container | None = None) -> Flask:
    from billingctl.adapters.ratelimit import BATCH, MONEY
    from webhooks_app.auth import require_internal_token
    from webhooks_app.blueprints import internal

    app = _base_app("billing-internal", settings, container)
    # One gate for every /internal/* path, matched or not, before any view runs.
    app.before_request(require_internal_token)
    app.wsgi_app = RequestBudget(app.wsgi_app, "/internal/billing/activate", MONEY, BATCH, exact=True)
    internal.register(app)
    return _built(app)


# Without BILLING_SANDBOX_WEBHOOK_URL the in-process sandbox delivers its webhooks to this app.
provide_receiver(lambda: create_public_app)
