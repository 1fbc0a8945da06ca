"""The one table from errors to exit codes (DESIGN section 5). Subclasses come before bases."""

from __future__ import annotations

from billingctl.domain import errors as e

OK = 0
UNEXPECTED = 1
USAGE = 2
REFUSED = 3
EXTERNAL = 4
PARTIAL = 5
LEASE_HELD = 75

TABLE: tuple[tuple[type[BaseException], int], ...] = (
    (e.ConfigError, USAGE),
    (e.InvalidInput, USAGE),
    (e.NotFound, REFUSED),
    (e.Refused, REFUSED),
    (e.AuthenticationFailed, REFUSED),
    (e.ExternalError, EXTERNAL),
    (e.ProcessorLockUnavailable, EXTERNAL),
    (e.BatchFailed, PARTIAL),
    (e.LeaseHeld, LEASE_HELD),
)


def exit_code_for(exc: BaseException) -> int:
    for cls, code in TABLE:
        if isinstance(exc, cls):
            return code
    return UNEXPECTED
