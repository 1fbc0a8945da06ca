"""The demo script behind `billingctl demo`: every step goes through the real services."""

from __future__ import annotations


def run_demo(container, say=print) -> dict:
    from billingctl.adapters.db.engine import redact
    from billingctl.services.health import health_report

    say(f"database: {redact(container.settings.database_url)} (created and migrated on first use)")
    container.engine  # noqa: B018 - builds and migrates the embedded database
    report = health_report(container)
    for check in report["checks"]:
        say(f"  {check['name']}: {check['detail']}")
    return {"healthy": report["ok"]}
