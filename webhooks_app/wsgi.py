"""Gunicorn entry points: `gunicorn 'webhooks_app.wsgi:public()'` and `'webhooks_app.wsgi:internal()'`.

A configuration error stops the worker with one line naming the variable, never a stack trace.
"""

from __future__ import annotations

import sys

from billingctl.domain.errors import ConfigError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _build(factory):
    import os

    from billingctl.adapters.logs import configure_logging

    # BILLING_LOG_LEVEL, as the CLI reads it (issue 39 item 3: the web apps logged at INFO whatever it said).
    level = (os.environ.get("BILLING_LOG_LEVEL") or "INFO").upper()
    if level not in LOG_LEVELS:
        sys.stderr.write(f"error: BILLING_LOG_LEVEL: {level!r} is not one of {', '.join(LOG_LEVELS)}\n")
        raise SystemExit(2)
    configure_logging(level)
    try:
        app = factory()
    except ConfigError as exc:
        sys.stderr.write(f"error: {exc.message}\n")
        raise SystemExit(2) from None
    # The app's long-lived objects (modules, tables, compiled statements) leave the collector's view, so a
    # full collection during a request walks only what requests allocate (it cost a webhook tens of ms).
    import gc

    gc.collect()
    gc.freeze()
    return app


def public():
    import webhooks_app

    # Sync workers: a webhook's provider follow-ups on one thread of each worker (it serves the next request
    # meanwhile), and the duplicate read's connection held by the worker between requests.
    return _build(lambda: webhooks_app.create_public_app(sync_worker=True))


def internal():
    import webhooks_app

    return _build(webhooks_app.create_internal_app)
