"""Named crash points for the reliability tests: `BILLING_FAULT_POINTS=name,name` makes the process
kill itself with SIGKILL when it reaches one (refused in production by the settings)."""

from __future__ import annotations

import os
import signal


def crash_point(settings, name: str) -> None:
    if settings.fault_points and name in {p.strip() for p in settings.fault_points.split(",")}:
        os.kill(os.getpid(), signal.SIGKILL)
