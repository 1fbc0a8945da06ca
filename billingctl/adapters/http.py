"""The one resilient HTTP client both external systems use: typed errors, retries with exponential
backoff and jitter that honour Retry-After, an idempotency key minted once per logical POST, a
shared rate limiter and a circuit breaker per dependency."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime

import httpx
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from billingctl.domain import errors as e

log = logging.getLogger("billingctl.http")

# Longer than this and we give up rather than hold a job or a request hostage.
MAX_RETRY_AFTER_SECONDS = 60.0


@dataclass
class HttpPolicy:
    timeout: float = 10.0
    max_attempts: int = 5
    backoff_max: float = 8.0
    backoff_multiplier: float = 0.25
    # How long the dependency blocks a key after a 429 that names no Retry-After (the provider's documented
    # block, about a minute): the retry waits it out instead of spending its attempts inside the block.
    rate_block_seconds: float | None = None


def error_body(response: httpx.Response) -> tuple[str | None, str]:
    """(message, error code) from either system's error shape: the provider's flat
    {message, api_error_code} or the orchestrator's nested {"error": {"errorId", "description"}}."""
    try:
        body = response.json()
    except ValueError:
        return None, ""
    if not isinstance(body, dict):
        return None, ""
    nested = body.get("error")
    if isinstance(nested, dict):
        return _text(nested.get("description")), _text(nested.get("errorId")) or ""
    return _text(body.get("message")), _text(body.get("api_error_code")) or _text(body.get("errorId")) or ""


def _param(response: httpx.Response) -> str | None:
    """The parameter the provider's error names (its `param` field), if any."""
    try:
        body = response.json()
    except ValueError:
        return None
    return _text(body.get("param")) if isinstance(body, dict) else None


def server_time(response: httpx.Response) -> datetime | None:
    """The answering server's clock, from its `Date` header (RFC 9110: whole seconds, GMT)."""
    value = response.headers.get("Date")
    if not value:
        return None
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _text(value) -> str | None:
    return value[:300] if isinstance(value, str) and value else None


def error_from_response(response: httpx.Response, dependency: str) -> e.ExternalError | e.ExternalNotFound:
    """Key on the status and the provider's api_error_code, never on the message text."""
    given, api_code = error_body(response)
    message = given or f"{dependency} answered HTTP {response.status_code}"
    status = response.status_code
    details = {"status": status, "api_error_code": api_code, "dependency": dependency,
               "request_id": response.headers.get("x-request-id"), "param": _param(response)}
    if status == 429 or api_code == "api_request_limit_exceeded":
        exc = e.RateLimited(message, **details)
        exc.retry_after = _retry_after(response)
        return exc
    if status in (401, 403) or api_code in ("api_authentication_failed", "api_authorization_failed"):
        return e.ExternalAuthError(f"{dependency}: {message}", **details)
    if status == 404:
        return e.ExternalNotFound(f"{dependency}: {message}", **details)
    if status == 409 and api_code == "IdempotencyKeyAlreadyExists":
        # Primer's answer to a key it has processed (successfully, declined or failed alike): it never
        # replays the first answer, and the same request again gets the same 409 (decision 123).
        return e.AlreadyProcessed(f"{dependency}: {message}", **details)
    if status in (408, 409) or status >= 500:
        return e.ExternalServerError(f"{dependency}: {message}", **details)
    return e.ExternalInvalidRequest(f"{dependency}: {message}", **details)


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, e.RateLimited):
        from billingctl.adapters.ratelimit import waiting_allowed

        if exc.details.get("client_side") or not waiting_allowed():
            return False  # our own budget is spent, or a web request must not wait out a Retry-After
        after = getattr(exc, "retry_after", None)
        return after is None or after <= MAX_RETRY_AFTER_SECONDS
    return bool(getattr(exc, "retryable", False))


class _Wait:
    """Exponential backoff with full jitter, or the server's Retry-After when it gave one."""

    def __init__(self, policy: HttpPolicy):
        self._exp = wait_random_exponential(multiplier=policy.backoff_multiplier, max=policy.backoff_max)

    def __call__(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        after = getattr(exc, "retry_after", None)
        if after is not None:
            # On top of the server's Retry-After, the same jittered backoff: workers that were refused
            # together do not come back together.
            return float(after) + self._exp(state)
        return self._exp(state)


class ResilientClient:
    """Wraps one httpx.Client for one dependency."""

    def __init__(
        self,
        dependency: str,
        client: httpx.Client,
        *,
        policy: HttpPolicy,
        breaker=None,
        limiter=None,
        on_error: Callable[[e.ExternalError], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        idempotency_header: str = "Idempotency-Key",
        clock: Callable[[], datetime] | None = None,
    ):
        self.dependency = dependency
        self.client = client
        self.policy = policy
        self.breaker = breaker
        self.limiter = limiter
        self.on_error = on_error
        self.sleep = sleep
        self.idempotency_header = idempotency_header
        self.requests_sent = 0  # counted for the provider-call budget benchmark
        self._local = threading.local()
        self.clock = clock
        # How far the dependency's clock runs ahead of ours (seconds; None until an answer named its time).
        self.server_offset: float | None = None

    def server_now(self, local_now: datetime) -> datetime:
        """The dependency's time now, as its last answer's `Date` header showed it (our time when no answer
        named one yet), in whole seconds, never ahead of it: a date sent as "now" is never in its future."""
        if self.server_offset is None:
            return local_now
        return (local_now + timedelta(seconds=self.server_offset)).replace(microsecond=0)

    def _note_server_time(self, response: httpx.Response) -> None:
        if self.clock is None:
            return
        when = server_time(response)
        if when is not None:
            # The header is truncated to its second: the offset is the one that never runs ahead of it.
            self.server_offset = (when - self.clock()).total_seconds()

    @contextmanager
    def attempts(self, max_attempts: int):
        """Bound the retries of calls made in this block (a webhook must answer quickly; a job
        picks up what did not finish)."""
        previous = getattr(self._local, "max_attempts", None)
        self._local.max_attempts = max_attempts
        try:
            yield
        finally:
            self._local.max_attempts = previous

    def request(self, method: str, path: str, *, params=None, data=None, json=None,
                idempotency_key: str | None = None, headers: dict | None = None, timeout: float | None = None,
                once: bool = False):
        """`timeout`: this call's own (a charge waits as long as the orchestrator may take); `once`: a
        single attempt, for a call that moves money and may still be running when its answer is lost
        (the caller reads it back before sending it again)."""
        headers = dict(headers or {})
        if method.upper() == "POST":
            # Minted once, before the retry loop: every attempt of this logical POST carries it.
            headers[self.idempotency_header] = idempotency_key or uuid.uuid4().hex
        attempts = 1 if once else getattr(self._local, "max_attempts", None) or self.policy.max_attempts
        retrying = Retrying(
            stop=stop_after_attempt(attempts),
            wait=_Wait(self.policy),
            retry=retry_if_exception(is_retryable),
            sleep=self.sleep,
            reraise=True,
        )
        try:
            return retrying(self._attempt, method, path, params, data, json, headers, timeout)
        except (e.ExternalServerError, e.ExternalUnavailable) as exc:
            if method.upper() == "POST":
                raise e.OutcomeUnknown(
                    f"{self.dependency}: {method} {path} failed but may have taken effect ({exc.message})",
                    dependency=self.dependency, cause=exc.code,
                ) from exc
            raise

    def _attempt(self, method, path, params, data, json, headers, timeout=None):
        ticket = self.breaker.before_call() if self.breaker is not None else None
        if self.limiter is not None:
            self.limiter.acquire()
        self.requests_sent += 1
        try:
            response = self.client.request(method, path, params=params, data=data, json=json, headers=headers,
                                           timeout=timeout or self.policy.timeout)
        except httpx.TransportError as exc:
            failure = e.ExternalUnavailable(f"{self.dependency}: {type(exc).__name__}", dependency=self.dependency)
            self._failed(failure, ticket)
            raise failure from exc
        self._note_server_time(response)
        if response.status_code >= 400:
            failure = error_from_response(response, self.dependency)
            if isinstance(failure, e.RateLimited) and getattr(failure, "retry_after", None) is None \
                    and self.policy.rate_block_seconds:
                failure.retry_after = self.policy.rate_block_seconds
                if self.limiter is not None:
                    self.limiter.block()  # every process of this key waits out the block, not only this one
            self._failed(failure, ticket)
            raise failure
        try:
            body = response.json() if response.content else {}
        except ValueError:
            failure = e.ExternalServerError(f"{self.dependency}: malformed JSON in the response",
                                            dependency=self.dependency)
            self._failed(failure, ticket)
            raise failure from None
        if self.breaker is not None:
            self.breaker.record(True, ticket)
        return body

    def _failed(self, failure: Exception, ticket=None) -> None:
        # The dependency answered sensibly to a bad request (400, 404): that is not its failure.
        counts = not isinstance(failure, e.ExternalInvalidRequest | e.ExternalNotFound | e.AlreadyProcessed)
        if self.breaker is not None:
            self.breaker.record(not counts, ticket)
        if self.on_error is not None:
            self.on_error(failure)
        # INFO: the caller decides what the failure means and says so once (one warning per item of a
        # batch, an error for a request); the job's log at INFO still shows each failed call.
        log.info("%s call failed: %s", self.dependency, getattr(failure, "message", failure),
                    extra={"dependency": self.dependency, "error_code": getattr(failure, "code", "")})

    # ---- typed answers (decision 122): parsed once here, never a half-read dict handed on ----------------
    def typed(self, model, answer):
        """`answer` as its typed copy (`model`, an adapters.payloads model): one the dependency cannot have
        meant (a field missing or of the wrong type) is ExternalPayloadInvalid, counted like any failure."""
        from billingctl.adapters.payloads import PayloadInvalid

        try:
            return model.read(answer)
        except PayloadInvalid as exc:
            raise self._unreadable(model, exc) from None

    def typed_entries(self, model, entries):
        """Each entry of a list answer as its typed copy; one that cannot be read is skipped, named in an
        ERROR log and counted, and the others are read: one bad entry never hides the rest."""
        from billingctl.adapters.payloads import PayloadInvalid

        for entry in entries or []:
            try:
                yield model.read(entry)
            except PayloadInvalid as exc:
                failure = self._unreadable(model, exc)
                ident = entry.get("id") if isinstance(entry, dict) else None
                log.error("%s listed an entry we cannot read; skipped: %s", self.dependency, failure.message,
                          extra={"dependency": self.dependency, "entry_id": str(ident)[:64] if ident else None})

    def _unreadable(self, model, exc) -> e.ExternalPayloadInvalid:
        failure = e.ExternalPayloadInvalid(f"the {self.dependency} answered a {model.noun or model.__name__} we "
                                           f"cannot read ({exc})", dependency=self.dependency)
        if self.on_error is not None:
            self.on_error(failure)
        return failure

    def close(self) -> None:
        self.client.close()
