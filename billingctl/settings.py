"""Settings: the one place that reads the environment (prefix BILLING_)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from billingctl.domain.errors import ConfigError

Environment = Literal["development", "sandbox", "production"]

# Secrets that have a development value outside production and are required in production.
REQUIRED_IN_PRODUCTION = (
    "orchestrator_webhook_secret",
    "orchestrator_disputes_secret",
    "provider_webhook_username",
    "provider_webhook_password",
    "workflow_callback_secret",
    "idv_webhook_secret",
    "identity_webhook_secret",
    "media_signing_secret",
    "session_jwt_key",
)
# Production talks to the real systems: no in-process sandbox.
ASYMMETRIC_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
REQUIRED_IN_PRODUCTION_PLAIN = (
    # Several processes share the provider budget, the breakers, the caches and their invalidation only
    # through Redis: without it each process would believe it alone spends the 60-a-minute budget.
    "redis_url",
    "session_jwt_audience",
    "session_jwt_issuer",
    "provider_url",
    "provider_api_key",
    "orchestrator_url",
    "orchestrator_api_key",
)

DEFAULT_PROCESSOR_LANES = {
    "SFW_STRIPE": "sfw",
    "SFW_ADYEN": "sfw",
    "NSFW_NMI": "nsfw",
    "NSFW_SEGPAY": "nsfw",
    "NSFW_CCBILL": "nsfw",
}

_DB_URL = re.compile(r"^(sqlite|postgresql)(\+[a-z0-9_]+)?://", re.IGNORECASE)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BILLING_", extra="ignore", frozen=True)

    env: Environment = "development"
    database_url: str = "sqlite:///./billing.db"
    redis_url: str | None = None

    provider_url: str | None = None
    provider_api_key: SecretStr | None = None
    # How the API key is sent: `bearer` (spec 5.11) or `basic` (the real provider: the key as user name,
    # empty password). The header the provider reads for idempotent POSTs.
    provider_auth: Literal["bearer", "basic"] = "bearer"
    provider_idempotency_header: str = Field(default="chargebee-idempotency-key", pattern=r"^[A-Za-z0-9-]{1,64}$")
    orchestrator_url: str | None = None
    orchestrator_api_key: SecretStr | None = None
    sandbox_db: str = "./billing-sandbox.db"
    # Where the sandbox delivers its signed webhooks; unset: straight into the in-process public app.
    sandbox_webhook_url: str | None = None
    # Authenticated webhooks the database could not take wait here for the event poll (decision 208); the
    # web app and the poll job share it (the units' working directory). Empty: off (answered 503).
    webhook_spool_dir: str = "./billing-webhook-spool"

    internal_token: SecretStr | None = None
    session_jwt_key: SecretStr | None = None
    session_jwt_algorithms: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["HS256"])
    session_jwt_audience: str | None = None  # when set, the token's aud must match
    session_jwt_issuer: str | None = None  # when set, the token's iss must match
    # Spec 5.1: a session token lives about 60 s. A token valid for longer than this from now (or minted
    # with a longer lifetime) is refused, whatever its signature.
    session_jwt_max_age_seconds: int = Field(300, ge=1, le=86400)
    sign_in_url: str = "/sign-in"

    orchestrator_webhook_secret: SecretStr | None = None
    orchestrator_disputes_secret: SecretStr | None = None
    provider_webhook_username: SecretStr | None = None
    provider_webhook_password: SecretStr | None = None
    workflow_callback_secret: SecretStr | None = None
    idv_webhook_secret: SecretStr | None = None
    identity_webhook_secret: SecretStr | None = None
    media_signing_secret: SecretStr | None = None
    media_edge_ttl_seconds: int = Field(default=300000, gt=0)

    # Hosts an image transformation may fetch its origin from (relative paths are always ours).
    media_origin_allowlist: Annotated[list[str], NoDecode] = Field(default_factory=list)

    alert_webhook_url: str | None = None
    notify_url: str | None = None
    analytics_url: str | None = None
    auth_content_dir: str = "./auth-content"

    # Subscription provider budget: requests per rolling window per API key, shared by all processes.
    provider_rate_limit: int = Field(default=60, gt=0)
    provider_rate_window_seconds: int = Field(default=60, gt=0)
    provider_rate_max_wait_seconds: float = Field(default=30.0, ge=0)
    # Each signed-in user's requests to the user API, per minute (shared through Redis when configured).
    user_api_rate_limit: int = Field(default=60, gt=0)
    # A new checkout costs provider calls from the interactive share every user shares (issue 37): each user
    # may start this many a minute (a second tab's pending checkout is answered again for free) and hold
    # this many open at once.
    checkout_starts_per_user_per_minute: int = Field(default=2, gt=0)
    checkout_open_per_user: int = Field(default=3, gt=0)
    # A renewals tick stops after this long (half the job's 30-minute lease); the next tick continues.
    renewals_tick_max_seconds: float = Field(default=900, ge=0)
    # Age limits of a renewal charge in flight (decision 103): an AUTHORIZED one the workflow left
    # uncaptured is captured after this many minutes; a PENDING one is cancelled (voided) after this many
    # hours, and one still SETTLING then is escalated (chat alert, RenewalChargeStuck).
    renewal_authorized_max_minutes: float = Field(default=60, gt=0)
    renewal_in_flight_max_hours: float = Field(default=24, gt=0)
    # The public host's absolute base URL, for robots.txt and sitemap.xml (never the request's Host).
    public_base_url: str = "http://localhost:8080"
    # Retention (the daily `prune` job): poller runs, payloads of processed inbox events (their rows and keys
    # stay), delivered outbox messages, audit rows.
    retention_poller_runs_days: int = Field(default=7, ge=1)
    retention_inbox_payload_days: int = Field(default=30, ge=1)
    retention_outbox_days: int = Field(default=90, ge=1)
    retention_audit_days: int = Field(default=400, ge=30)
    http_timeout_seconds: float = Field(default=10.0, gt=0)
    # A call that moves money at the orchestrator (a charge, a capture, a cancel) waits this long: Primer
    # enforces 90 s on every request and answers 504 after it. It is sent once; a lost answer is read back.
    orchestrator_charge_timeout_seconds: float = Field(default=95.0, gt=0)
    # The provider blocks a key for about a minute after a 429 (its API-limits article); with no Retry-After
    # the client waits this long (and closes the shared budget) before trying again.
    provider_rate_block_seconds: float = Field(default=60.0, gt=0, le=60)
    http_max_attempts: int = Field(default=5, ge=1)
    http_backoff_max_seconds: float = Field(default=8.0, ge=0)
    breaker_error_threshold: float = Field(default=0.5, gt=0, le=1)
    breaker_min_calls: int = Field(default=10, ge=1)
    breaker_window_seconds: int = Field(default=60, gt=0)
    breaker_cooldown_seconds: int = Field(default=30, gt=0)

    # Dunning: hours after a failed renewal attempt before the next one; after the last, the schedule is
    # exhausted (see docs/decisions.md). Comma separated in the environment.
    renewal_retry_hours: Annotated[list[int], NoDecode] = Field(default_factory=lambda: [1, 24, 72, 120])
    # Velocity watch (spec section 8): charges and amount (minor units) per minute.
    velocity_max_charges_per_minute: int = Field(default=10, ge=1)
    velocity_max_amount_per_minute: int = Field(default=100_000, ge=1)

    # Processor name -> lane. JSON object in the environment.
    processor_lanes: dict[str, Literal["sfw", "nsfw"]] = Field(
        default_factory=lambda: dict(DEFAULT_PROCESSOR_LANES)
    )
    legacy_nmi_processor: str = "NSFW_NMI"

    # Test-only: named crash points (comma separated); never set in production.
    fault_points: str = ""
    # Whose time the service reads: the system's, or the sandbox's controllable clock (`billingctl sandbox
    # clock`), so that every process of a simulation (jobs, the web app) lives on the same simulated day.
    # Never in production.
    clock: Literal["system", "sandbox"] = "system"
    # With the sandbox's clock: how far ours is off the sandbox's (seconds, + ahead), as a host whose time
    # drifted (simulations, decision 115). Only with BILLING_CLOCK=sandbox.
    clock_skew_seconds: float = Field(default=0, ge=-3600, le=3600)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        """The process's environment and the caller's overrides, nothing else: no .env file and no secrets
        directory is read (none was ever configured; the units pass an EnvironmentFile). Two sources
        fewer to walk: a millisecond of every command's start (issue 39 item 5)."""
        return (init_settings, env_settings)

    @field_validator("session_jwt_algorithms", mode="before")
    @classmethod
    def _split_algorithms(cls, value):
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("media_origin_allowlist", mode="before")
    @classmethod
    def _split_hosts(cls, value):
        if isinstance(value, str):
            return [part.strip().lower() for part in value.split(",") if part.strip()]
        return value

    @field_validator("renewal_retry_hours", mode="before")
    @classmethod
    def _split_hours(cls, value):
        if isinstance(value, str):
            return [int(part) for part in value.split(",") if part.strip()]
        return value

    @field_validator("session_jwt_algorithms")
    @classmethod
    def _no_unsigned_tokens(cls, value: list[str]) -> list[str]:
        if not value or any(a.lower() == "none" for a in value):
            raise ValueError("must name signing algorithms; 'none' is never accepted")
        return value

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str) -> str:
        if not _DB_URL.match(value):
            raise ValueError("must be a sqlite:/// or postgresql+psycopg:// URL")
        if value.lower().startswith("postgresql://"):
            value = "postgresql+psycopg://" + value[len("postgresql://") :]
        return value

    @field_validator("identity_webhook_secret")
    @classmethod
    def _standard_webhooks_secret(cls, value: SecretStr | None) -> SecretStr | None:
        """Read as the Standard Webhooks reference library reads it (optional "whsec_", then base64), so
        a secret it cannot read is refused at start-up rather than failing every delivery."""
        if value is None or not value.get_secret_value():
            return value
        import base64
        import binascii

        for part in (p.strip() for p in value.get_secret_value().split(",")):  # several during a rotation
            try:
                decoded = base64.b64decode(part.removeprefix("whsec_") + "==")
            except (binascii.Error, ValueError):
                decoded = b""
            if not decoded:
                raise ValueError("must be the Standard Webhooks signing secret: whsec_ followed by base64 "
                                 "(comma-separated during a rotation)")
        return value

    @model_validator(mode="after")
    def _secrets_by_environment(self) -> Settings:
        if self.clock_skew_seconds and self.clock != "sandbox":
            raise ValueError("BILLING_CLOCK_SKEW_SECONDS needs BILLING_CLOCK=sandbox (it moves our clock off the "
                             "sandbox's)")
        if self.env == "production":
            missing = [
                name
                for name in REQUIRED_IN_PRODUCTION + REQUIRED_IN_PRODUCTION_PLAIN
                if not _present(getattr(self, name))
            ]
            if "provider_auth" not in self.model_fields_set:
                # The default (bearer, spec 5.11) is refused by the real provider on every call, which takes
                # the API key as a Basic user name: production names its choice (the README says which).
                missing.append("provider_auth")
            if missing:
                names = ", ".join(f"BILLING_{name.upper()}" for name in missing)
                raise ValueError(f"missing required setting for BILLING_ENV=production: {names}")
            symmetric = [a for a in self.session_jwt_algorithms if a not in ASYMMETRIC_ALGORITHMS]
            if symmetric:
                raise ValueError(f"BILLING_SESSION_JWT_ALGORITHMS: {', '.join(symmetric)} refused in production "
                                 "(only asymmetric algorithms: a shared key would let its holders mint sessions)")
            if self.fault_points:
                raise ValueError("BILLING_FAULT_POINTS must not be set in production")
            if self.clock != "system":
                raise ValueError("BILLING_CLOCK must be system in production")
        else:
            for name in REQUIRED_IN_PRODUCTION:
                if not _present(getattr(self, name)):
                    object.__setattr__(self, name, SecretStr(f"dev-{name.replace('_', '-')}-not-for-production"))
        return self

    @property
    def is_production(self) -> bool:
        return self.env == "production"

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.lower().startswith("sqlite")

    def secret(self, name: str) -> str | None:
        value = getattr(self, name)
        return value.get_secret_value() if value is not None else None


def _present(value) -> bool:
    if value is None:
        return False
    if isinstance(value, SecretStr):
        return bool(value.get_secret_value())
    return bool(value)


def load_settings(**overrides) -> Settings:
    """Build Settings from the environment (and overrides), turning validation errors into one line."""
    from pydantic_settings import SettingsError

    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(_one_line(exc)) from None
    except SettingsError as exc:  # a complex value (JSON) that does not parse: a configuration error too
        field = str(exc).split('field "', 1)[-1].split('"', 1)[0] if 'field "' in str(exc) else ""
        named = f"BILLING_{field.upper()}: " if field else ""
        raise ConfigError(f"configuration error: {named}not valid JSON (quote the whole value in single quotes "
                          "in the env file)") from None


def _one_line(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        loc = [str(p) for p in error.get("loc", ()) if p != "__root__"]
        message = error.get("msg", "invalid").removeprefix("Value error, ")
        if loc:
            parts.append(f"BILLING_{loc[0].upper()}: {message}")
        else:
            parts.append(message)
    return "configuration error: " + "; ".join(parts)
