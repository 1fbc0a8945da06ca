"""Reconcile's window: which part of the external books a run reads. A watermark per run (the last run's
start) moves each run's window forward; a full pass reads the whole refund window (and every
subscription) when asked, when there is no watermark yet, and at least once a week."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

FULL_EVERY = timedelta(days=7)
# Read again behind the watermark: payments appear in the orchestrator's list up to a minute after they
# are made, a run skips payments settled in its last seconds, and checks wait out their grace.
OVERLAP = timedelta(hours=2)
WATERMARK = "reconcile_watermark"
FULL_AT = "reconcile_full_at"


@dataclass(frozen=True)
class Span:
    full: bool
    since: datetime | None  # the external lists are read from here (None: from the beginning)
    why: str

    def describe(self) -> dict:
        return {"full": self.full, "since": self.since.isoformat() if self.since else None, "why": self.why}


def choose(container, now, since: datetime | None = None, full: bool = False) -> Span:
    from billingctl.domain.clock import parse_time
    from billingctl.services.cursors import read_value

    if full:
        return Span(True, None, "asked (--full)")
    if since is not None:
        return Span(False, since, "asked (--since)")
    watermark, full_at = (parse_time(read_value(container, name)) for name in (WATERMARK, FULL_AT))
    if watermark is None:
        return Span(True, None, "first run")
    if full_at is None or now - full_at >= FULL_EVERY:
        return Span(True, None, "weekly full pass")
    return Span(False, min(watermark, now) - OVERLAP, "since the last run")


def advance(container, now, span: Span, hold: datetime | None = None) -> None:
    """After a run that read its whole window: the next starts where this one started, or earlier where
    an open violation sits (`hold`: the next run reads it again, so it stays reported until it is fixed or
    acknowledged). A run over a window an operator chose (--since) moves nothing."""
    from billingctl.services.cursors import write_value

    if span.why == "asked (--since)":
        return
    write_value(container, WATERMARK, min(now, hold or now).isoformat())
    if span.full:
        write_value(container, FULL_AT, now.isoformat())
