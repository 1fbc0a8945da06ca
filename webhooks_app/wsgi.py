"""Gunicorn entry points: `gunicorn 'webhooks_app.wsgi:public()'` and `'webhooks_app.wsgi:internal()'`.

A configuration error stops the worker with one line naming the variable, never a stack trace.
"""

from __future__ import annotations

import sys

from billingctl.domain.errors import ConfigError


def _build(factory):
    from billingctl.adapters.logs import configure_logging

    configure_logging()
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

    return _build(webhooks_app.create_public_app)


def internal():
    import webhooks_app

    return _build(webhooks_app.create_internal_app)
