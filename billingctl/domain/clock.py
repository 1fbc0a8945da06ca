"""Time: timezone-aware UTC, from an injected clock so services and tests agree on 'now'."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)


class ManualClock:
    """A clock that moves only when told to (tests, the sandbox)."""

    def __init__(self, start: datetime | None = None):
        self._now = start or datetime.now(UTC)

    def now(self) -> datetime:
        return self._now

    def advance(self, seconds: float = 0, **kw) -> datetime:
        self._now += timedelta(seconds=seconds, **kw)
        return self._now

    def set(self, when: datetime) -> None:
        self._now = when


class OffsetClock:
    """The system's time moved by an offset read on every call (the sandbox's controllable clock, shared by
    every process that reads the same sandbox)."""

    def __init__(self, offset_seconds):
        self._offset = offset_seconds

    def now(self) -> datetime:
        return datetime.now(UTC) + timedelta(seconds=self._offset())


def parse_time(value) -> datetime | None:
    """A time as the outside systems send it: unix seconds (number or digits) or ISO 8601; UTC when no
    offset is given; None for nothing."""
    if value in (None, ""):
        return None
    if isinstance(value, int | float) or (isinstance(value, str) and value.replace(".", "", 1).isdigit()):
        return datetime.fromtimestamp(float(value), UTC)
    parsed = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
