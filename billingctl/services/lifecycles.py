"""What happens to an event outside an aggregate's transition table (domain.lifecycle): it is logged
(`illegal lifecycle transition`), counted (`billing_lifecycle_illegal_transitions_total{lifecycle}`,
alert IllegalLifecycleTransition) and raised once as a chat alert, in the caller's transaction. Never
ignored, never applied silently."""

from __future__ import annotations

import logging

from billingctl.domain.lifecycle import IllegalTransition
from billingctl.services import alerts

log = logging.getLogger("billingctl.lifecycle")


def report_illegal(container, uow, exc: IllegalTransition) -> None:
    container.metrics.lifecycle_illegal.labels(lifecycle=exc.lifecycle).inc()
    log.error("illegal lifecycle transition", extra={"lifecycle": exc.lifecycle, "key": exc.key,
                                                     "from_state": exc.source, "to_state": exc.target})
    alerts.raise_alert(uow, container.clock, f"{exc} - manual review required",
                       f"illegal:{exc.lifecycle}:{exc.key}:{exc.source}:{exc.target}", lifecycle=exc.lifecycle,
                       key=exc.key)


def unknown_notification(container, event_type: str, subject: str | None) -> dict:
    """A notification type we do not know: acknowledged (the orchestrator does not retry a 200, and a
    retry would not teach us the type), but never silently: logged, counted and one chat alert per type
    and subject."""
    with container.uow() as uow:
        report_illegal(container, uow, IllegalTransition("notification", str(subject), None, event_type[:64]))
        uow.commit()
    return {"outcome": "unknown_type", "event_type": event_type}
