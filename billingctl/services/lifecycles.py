"""What happens to an event outside an aggregate's transition table (domain.lifecycle): it is logged
(`illegal lifecycle transition`), counted (`billing_lifecycle_illegal_transitions_total{lifecycle}`,
alert IllegalLifecycleTransition) and raised once as a chat alert, in the caller's transaction. Never
ignored, never applied silently."""

from __future__ import annotations

import logging

from billingctl.domain.lifecycle import IllegalTransition, Lifecycle, Step
from billingctl.services import alerts

log = logging.getLogger("billingctl.lifecycle")


def report_illegal(container, uow, exc: IllegalTransition) -> None:
    container.metrics.lifecycle_illegal.labels(lifecycle=exc.lifecycle).inc()
    log.error("illegal lifecycle transition", extra={"lifecycle": exc.lifecycle, "key": exc.key,
                                                     "from_state": exc.source, "to_state": exc.target})
    alerts.raise_alert(uow, container.clock, f"{exc} - manual review required",
                       f"illegal:{exc.lifecycle}:{exc.key}:{exc.source}:{exc.target}", lifecycle=exc.lifecycle,
                       key=exc.key)


def provider_status(container, uow, machine: Lifecycle, key: str, current: str | None, target) -> Step | None:
    """The step from our copy's status to the one the provider's copy names (domain.lifecycle.SUBSCRIPTION,
    INVOICE). None when the provider's status is one it does not document: refused (nothing written),
    reported. Otherwise the step; the caller writes the copy (the provider is authoritative) and, once it
    is written, reports an ILLEGAL step with `provider_step_written`."""
    if not isinstance(target, str) or target not in machine.states:
        report_illegal(container, uow, IllegalTransition(machine.name, key, current, str(target)[:32]))
        return None
    return machine.step(current, target)


def provider_step_written(container, uow, machine: Lifecycle, key: str, current: str | None, target: str,
                          step: Step) -> None:
    """A provider copy outside our table was written: our copy missed a step, or the provider did something
    we did not model. Counted and alerted, in the writer's transaction."""
    if step == Step.ILLEGAL:
        report_illegal(container, uow, IllegalTransition(machine.name, key, current, target))


def unknown_notification(container, event_type: str, subject: str | None) -> dict:
    """A notification type we do not know: acknowledged (the orchestrator does not retry a 200, and a
    retry would not teach us the type), but never silently: logged, counted and one chat alert per type
    and subject."""
    with container.uow() as uow:
        report_illegal(container, uow, IllegalTransition("notification", str(subject), None, event_type[:64]))
        uow.commit()
    return {"outcome": "unknown_type", "event_type": event_type}
