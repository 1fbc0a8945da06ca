"""Logging of lasting conditions: one warning now and then, not one per call."""

import pytest

pytestmark = pytest.mark.unit


def test_a_lasting_condition_warns_now_and_then_not_on_every_call(caplog):
    """Redis down for a day made every call of every job log the same warning."""
    import logging

    from billingctl.adapters.logs import warn_now_and_then

    log = logging.getLogger("test.throttle")
    with caplog.at_level(logging.WARNING, logger="test.throttle"):
        for _ in range(50):
            warn_now_and_then(log, "limiter", "shared rate limiter unavailable: %s", "ConnectionError", every=3600)
        warn_now_and_then(log, "cache", "cache read failed: %s", "ConnectionError", every=3600)
        warn_now_and_then(log, "cache", "cache read failed: %s", "ConnectionError", every=0)
    assert [r.getMessage() for r in caplog.records] == [
        "shared rate limiter unavailable: ConnectionError", "cache read failed: ConnectionError",
        "cache read failed: ConnectionError"]
