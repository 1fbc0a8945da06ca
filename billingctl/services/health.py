"""Health: the state an on-call engineer checks first (database, migrations, Redis)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    data: dict = field(default_factory=dict)
    # True when the failure is an unreachable dependency (exit 4), False when it needs attention (3).
    external: bool = False


def check_database(container) -> list[Check]:
    from billingctl.adapters.db.engine import redact
    from billingctl.adapters.db.migrate import probe

    settings = container.settings
    url = redact(settings.database_url)
    try:
        dialect, current, head = probe(settings.database_url)
    except Exception as exc:  # reported, not raised: health shows every failing part at once
        return [Check("database", False, f"unreachable: {type(exc).__name__}", {"url": url}, external=True)]
    db = Check("database", True, "reachable", {"url": url, "dialect": dialect})
    up_to_date = current == head
    migrations = Check(
        "migrations",
        up_to_date,
        "current" if up_to_date else f"behind: at {current or 'empty'}, head is {head}",
        {"current": current, "head": head},
    )
    return [db, migrations]


def check_redis(container) -> Check:
    if not container.settings.redis_url:
        return Check("redis", True, "not configured (in-process fallbacks)", {"configured": False})
    try:
        container.redis.ping()
    except Exception as exc:
        return Check("redis", False, f"unreachable: {type(exc).__name__}", {"configured": True}, external=True)
    return Check("redis", True, "reachable", {"configured": True})


def check_breakers(container) -> list[Check]:
    checks = []
    if not container.settings.redis_url:
        # Each process has its own breaker without Redis: this fresh one cannot know the others' state.
        for name in container.breakers:
            checks.append(Check(f"breaker:{name}", True, "unknown: without Redis each process keeps its own "
                                "breaker (ask the app: GET /internal/health/circuit-breaker)", {"state": "unknown"}))
        return checks
    for name, snap in breaker_status(container).items():
        ok = snap["state"] == "closed"
        checks.append(Check(f"breaker:{name}", ok, f"{snap['state']} (error rate {snap['error_rate']:.0%})", snap,
                            external=not ok))
    return checks


def check_pending_activations(container) -> Check:
    from billingctl.services.payments import pending_activations

    rows = pending_activations(container)
    detail = "none" if not rows else f"{len(rows)} recorded payment(s) waiting for activation: " + "; ".join(
        f"{r['id']} ({r['activation_error'] or 'not yet on its invoice'})" for r in rows[:5]) + (
        f"; and {len(rows) - 5} more (--json)" if len(rows) > 5 else "")
    return Check("pending_activations", not rows, detail, {"subscriptions": [r["id"] for r in rows[:20]]})


def check_poller(container) -> Check:
    from billingctl.services.events import poller_freshness

    fresh = poller_freshness(container)
    if fresh["newest_run_at"] is None:
        detail = "never ran"
    else:
        detail = f"newest run {fresh['age_seconds']} s ago" + (" (stale: over 5 minutes)" if fresh["stale"] else "")
    if fresh["parked_events"]:
        detail += f"; {fresh['parked_events']} parked event(s)"
    return Check("event_poller", not fresh["stale"] and not fresh["parked_events"], detail, fresh)


def check_inbox(container) -> Check:
    """Events accepted but never finished (a request cut by an outage): the poll job re-drives them."""
    from billingctl.services.inbox import REDRIVE_AFTER, count_stale_pending

    stale = count_stale_pending(container)
    minutes = int(REDRIVE_AFTER.total_seconds() // 60)
    detail = "none stuck" if not stale else f"{stale} event(s) pending for over {minutes} minutes"
    return Check("inbox", not stale, detail, {"stale_pending": stale})


def check_orphans(container) -> Check:
    from billingctl.services.orphans import list_orphans

    waiting = [r["payment_id"] for r in list_orphans(container) if r["status"] in ("exhausted", "needs_review")]
    detail = "none awaiting review" if not waiting else f"{len(waiting)} orphaned payment(s) awaiting manual review"
    return Check("orphans", not waiting, detail, {"awaiting_review": waiting[:20]})


def check_outbox(container) -> Check:
    with container.uow() as uow:
        counts = uow.outbox.undelivered_per_sink()
    chat = counts.get("chat", 0)
    detail = "empty" if not counts else ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    if chat and not container.settings.alert_webhook_url and not container.settings.is_production:
        # Not configured is not failing: a development setup has no chat URL (production requires one).
        return Check("alert_outbox", True, detail + " (chat not configured here: alerts wait in the outbox)", counts)
    return Check("alert_outbox", chat == 0, detail + (" (undelivered chat alerts)" if chat else ""), counts)


def check_renewals_in_flight(container) -> Check:
    """Renewal charges the orchestrator has not ended yet; attention when one is past its age limit (the
    renewals tick captures, cancels or escalates it: runbook RenewalChargeStuck)."""
    from billingctl.services.renewals import charges_in_flight

    view = charges_in_flight(container)
    if not view["count"]:
        return Check("renewals_in_flight", True, "none", view)
    detail = f"{view['count']} in flight, oldest {view['oldest_age_seconds'] / 3600:.1f} h"
    if view["overdue"]:
        detail += f"; {len(view['overdue'])} past the age limit: " + ", ".join(
            f"{o['payment_id']} ({o['status']})" for o in view["overdue"][:3])
    return Check("renewals_in_flight", not view["overdue"], detail, view)


def check_media(container) -> Check:
    from billingctl.services.media import edge_ttl_warning

    warning = edge_ttl_warning(container.settings)
    return Check("media_edge_ttl", warning is None, warning or
                 f"{container.settings.media_edge_ttl_seconds} s (above the 72 h signed-URL cache)")


def check_spool(container) -> Check:
    """Webhooks kept on disk while the database was away (decision 208): the poll dispatches them within a
    run or two; attention when one waits longer than five minutes or failed."""
    from billingctl.services.spool import overdue

    view = overdue(container.settings.webhook_spool_dir)
    if not view["waiting"]:
        return Check("webhook_spool", True, "empty", view)
    detail = f"{view['waiting']} webhook(s) waiting for the event poll"
    if view["late"] or view["failed"]:
        detail += f" ({view['late']} for over 5 minutes, {view['failed']} failed: see the log)"
    return Check("webhook_spool", not (view["late"] or view["failed"]), detail, view)


def check_jobs(container) -> Check:
    from billingctl.services.job_status import leases

    rows = leases(container)
    late = [r["job"] for r in rows if r["late"]]
    failing = [r["job"] for r in rows if r["last_error"]]
    never = [r["job"] for r in rows if r["last_success_at"] is None]
    parts = []
    if late:
        parts.append("late: " + ", ".join(late))
    if failing:
        parts.append("last run failed: " + ", ".join(failing))
    if never:
        parts.append(f"{len(never)} never ran")
    return Check("jobs", not late and not failing, "; ".join(parts) or "all on schedule", {"jobs": rows})


def health_report(container, scope: str = "full") -> dict:
    """scope "app": what a web worker itself needs (the /healthz probe); "full": everything on call."""
    checks = [*check_database(container), check_redis(container)]
    if scope == "full":
        checks.extend(check_breakers(container))
        checks.append(check_media(container))
        checks.append(check_spool(container))
    if scope == "full" and checks[0].ok and checks[1].ok:
        checks.append(check_pending_activations(container))
        checks.append(check_poller(container))
        checks.append(check_inbox(container))
        checks.append(check_orphans(container))
        checks.append(check_renewals_in_flight(container))
        checks.append(check_outbox(container))
        checks.append(check_jobs(container))
    return {
        "ok": all(c.ok for c in checks),
        "checks": [asdict(c) for c in checks],
    }


def breaker_status(container) -> dict:
    """GET /internal/health/circuit-breaker: keyed by dependency, each with state and error_rate (0..1)."""
    return {name: breaker.snapshot() for name, breaker in container.breakers.items()}
