"""Sentinel errors of the billing domain.

Every edge maps these to its own vocabulary in one table: the CLI to exit codes
(`billingctl.cli.exitcodes`), the HTTP apps to status codes (`webhooks_app.errors`).
Messages are written for the operator or the caller; they never carry internals.
"""


class BillingError(Exception):
    """Base of every error the project raises on purpose."""

    code = "error"

    def __init__(self, message: str = "", **details):
        super().__init__(message or self.__class__.__doc__ or self.code)
        self.message = message or (self.__class__.__doc__ or self.code).strip()
        self.details = details


class ConfigError(BillingError):
    """The configuration is invalid."""

    code = "config_error"


class InvalidInput(BillingError):
    """The request is malformed."""

    code = "invalid_input"


class AuthenticationFailed(BillingError):
    """Authentication failed."""

    code = "unauthorized"


class NotFound(BillingError):
    """The object does not exist."""

    code = "not_found"


class Refused(BillingError):
    """The operation is refused in the current state."""

    code = "refused"


class PaymentNotRecorded(Refused):
    """No purchase exists for the subscription: the payment was never recorded."""

    code = "payment_not_recorded"


class QuotaExhausted(Refused):
    """checkout temporarily blocked due to too many payment attempts"""

    code = "quota_exhausted"


class AccountFrozen(Refused):
    """The account is frozen: payments are disabled."""

    code = "account_frozen"


class AlreadySubscribed(Refused):
    """The customer already holds a live subscription of this plan."""

    code = "already_subscribed"


class ExternalError(BillingError):
    """An external system failed."""

    code = "external_error"


class CircuitOpen(ExternalError):
    """Circuit breaker is open"""

    code = "circuit_open"


def outage(exc: BaseException) -> bool:
    """An outside system's outage, not a fault of what was asked: a server error, a system unreachable, a
    rate limit, an open breaker, an answer lost. The same request later may go through (decision 216)."""
    return isinstance(exc, CircuitOpen | OutcomeUnknown) or bool(getattr(exc, "retryable", False))


class LeaseHeld(BillingError):
    """Another instance holds the job's lease."""

    code = "lease_held"


class BatchFailed(BillingError):
    """A batch finished with some items failed."""

    code = "batch_failed"


# ---- external systems (the clients raise these; callers decide what they mean) -----------------


class TooManyRequests(Refused):
    """too many requests; retry later"""

    code = "too_many_requests"


class RateLimited(ExternalError):
    """Please try after some time"""

    code = "rate_limited"
    retryable = True


class ExternalServerError(ExternalError):
    """The external system answered with a server error."""

    code = "external_server_error"
    retryable = True


class ExternalUnavailable(ExternalError):
    """The external system could not be reached (connection error or timeout)."""

    code = "external_unavailable"
    retryable = True


class ExternalAuthError(ExternalError):
    """The external system refused our credentials (invalid or rotated API key)."""

    code = "external_auth_error"


class ExternalInvalidRequest(ExternalError):
    """The external system refused the request as invalid."""

    code = "external_invalid_request"


class ExternalNotFound(NotFound):
    """The external system has no such object."""

    code = "external_not_found"


class ExternalPayloadInvalid(ExternalError):
    """The external system answered in a shape its reference does not document."""

    code = "external_payload_invalid"


class OutcomeUnknown(ExternalError):
    """The call failed but may have taken effect; compare state with the external system."""

    code = "outcome_unknown"


class AlreadyProcessed(OutcomeUnknown):
    """The external system processed this request already (its idempotency key was used): read the outcome
    back; sending it again is refused the same way."""

    code = "already_processed"


class ProcessorLockUnavailable(BillingError):
    """The payment processor lock could not be read; the operation was aborted and nothing was created."""

    code = "lock_unavailable"


def is_database_outage(exc: BaseException) -> bool:
    """SQLAlchemy's OperationalError / InterfaceError: the database went away (checked by name so that
    neither the CLI's start-up nor a service imports SQLAlchemy)."""
    return type(exc).__module__.startswith("sqlalchemy") and type(exc).__name__ in (
        "OperationalError", "InterfaceError", "DisconnectionError")


# A statement named a relation or a column the database does not hold: PostgreSQL's SQLSTATEs, SQLite's words.
_SCHEMA_BEHIND_STATES = ("42P01", "42703")
_SCHEMA_BEHIND_WORDS = ("no such table", "no such column")


def is_schema_behind(exc: BaseException) -> bool:
    """SQLAlchemy's error for a table or column the database does not hold: its schema is older than the
    code (a release that reached the hosts before `billingctl db upgrade` ran). Checked by name and by the
    driver's error, like is_database_outage."""
    if not type(exc).__module__.startswith("sqlalchemy"):
        return False
    orig = getattr(exc, "orig", None)
    return getattr(orig, "sqlstate", None) in _SCHEMA_BEHIND_STATES or str(orig).startswith(_SCHEMA_BEHIND_WORDS)
