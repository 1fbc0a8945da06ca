import pytest

from billingctl.cli.exitcodes import exit_code_for
from billingctl.domain import errors as e
from webhooks_app.errors import status_for

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("exc", "code", "status"),
    [
        (e.ConfigError("x"), 2, 500),
        (e.InvalidInput("x"), 2, 400),
        (e.NotFound("x"), 3, 404),
        (e.PaymentNotRecorded(), 3, 409),
        (e.QuotaExhausted(), 3, 429),
        (e.AuthenticationFailed(), 3, 401),
        (e.CircuitOpen(), 4, 503),
        (e.ExternalError("x"), 4, 502),
        (e.BatchFailed("x"), 5, 500),
        (e.LeaseHeld("x"), 75, 409),
        (RuntimeError("boom"), 1, 500),
    ],
)
def test_one_table_per_edge(exc, code, status):
    assert exit_code_for(exc) == code
    assert status_for(exc) == status


def test_sentinel_messages_are_the_spec_texts():
    assert e.QuotaExhausted().message == "checkout temporarily blocked due to too many payment attempts"
    assert e.CircuitOpen().message == "Circuit breaker is open"
