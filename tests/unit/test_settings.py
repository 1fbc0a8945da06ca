import pytest

from billingctl.domain.errors import ConfigError
from billingctl.settings import REQUIRED_IN_PRODUCTION, load_settings

pytestmark = pytest.mark.unit

PROD_SECRETS = {name: f"value-{name}" for name in REQUIRED_IN_PRODUCTION}
PROD_PLAIN = {
    "provider_auth": "basic",
    "redis_url": "redis://127.0.0.1:6379/0",
    "session_jwt_audience": "billing",
    "session_jwt_issuer": "https://identity.example",
    "provider_url": "https://provider.example",
    "provider_api_key": "k",
    "orchestrator_url": "https://orch.example",
    "orchestrator_api_key": "k",
}


def test_embedded_defaults():
    s = load_settings()
    assert s.env == "development"
    assert s.database_url == "sqlite:///./billing.db"
    assert s.redis_url is None
    assert s.internal_token is None  # internal endpoints fail closed
    assert s.media_edge_ttl_seconds == 300000
    assert s.session_jwt_algorithms == ["HS256"]
    # development values fill the webhook secrets outside production
    assert s.secret("orchestrator_webhook_secret")
    assert "dev-" not in repr(s)  # secrets never print


def test_environment_variables_use_the_prefix(monkeypatch):
    monkeypatch.setenv("BILLING_DATABASE_URL", "postgresql://u@h/db")
    monkeypatch.setenv("BILLING_SESSION_JWT_ALGORITHMS", "RS256, ES256")
    monkeypatch.setenv("BILLING_PROCESSOR_LANES", '{"X_PSP": "nsfw"}')
    s = load_settings()
    assert s.database_url == "postgresql+psycopg://u@h/db"
    assert s.session_jwt_algorithms == ["RS256", "ES256"]
    assert s.processor_lanes == {"X_PSP": "nsfw"}


def test_unknown_environment_is_one_line():
    with pytest.raises(ConfigError) as info:
        load_settings(env="prod")
    assert info.value.message.startswith("configuration error: BILLING_ENV:")
    assert "\n" not in info.value.message


def test_malformed_database_url():
    with pytest.raises(ConfigError, match="BILLING_DATABASE_URL"):
        load_settings(database_url="mysql://somewhere/db")


def test_production_names_each_missing_secret():
    values = {**PROD_SECRETS, **PROD_PLAIN, "session_jwt_algorithms": "RS256"}
    del values["idv_webhook_secret"]
    with pytest.raises(ConfigError) as info:
        load_settings(env="production", **values)
    assert "BILLING_IDV_WEBHOOK_SECRET" in info.value.message
    assert "BILLING_MEDIA_SIGNING_SECRET" not in info.value.message


def test_production_refuses_hs256_and_accepts_a_complete_configuration():
    with pytest.raises(ConfigError, match="HS256"):
        load_settings(env="production", **PROD_SECRETS, **PROD_PLAIN)
    s = load_settings(env="production", session_jwt_algorithms="RS256", **PROD_SECRETS, **PROD_PLAIN)
    assert s.is_production
    assert s.secret("media_signing_secret") == "value-media_signing_secret"


def test_production_names_the_provider_auth_when_it_is_left_to_its_default(monkeypatch):
    """Issue 35 defect 8: the default (bearer) is refused by the real provider on every call."""
    values = {**PROD_SECRETS, **PROD_PLAIN, "session_jwt_algorithms": "RS256"}
    del values["provider_auth"]
    with pytest.raises(ConfigError, match="BILLING_PROVIDER_AUTH"):
        load_settings(env="production", **values)
    monkeypatch.setenv("BILLING_PROVIDER_AUTH", "basic")  # named in the environment, as the unit file does
    assert load_settings(env="production", **values).provider_auth == "basic"


def test_empty_secret_counts_as_missing_in_production():
    values = {**PROD_SECRETS, **PROD_PLAIN, "session_jwt_algorithms": "RS256", "media_signing_secret": ""}
    with pytest.raises(ConfigError, match="BILLING_MEDIA_SIGNING_SECRET"):
        load_settings(env="production", **values)


def test_every_alert_links_an_existing_runbook():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    rules = (root / "prometheus" / "alerts.yml").read_text()
    links = re.findall(r"runbook: (docs/runbooks/\S+\.md)", rules)
    assert len(links) == rules.count("- alert:")
    assert all((root / link).is_file() for link in links)


@pytest.mark.parametrize("value, ok", [("whsec_c2VjcmV0", True), ("c2VjcmV0", True), ("whsec_", False), ("x", False)])
def test_the_standard_webhooks_secret_is_read_as_the_reference_library_reads_it(value, ok):
    """An optional whsec_ prefix, then base64: a secret the library cannot read is refused at start-up."""
    if ok:
        assert load_settings(identity_webhook_secret=value).secret("identity_webhook_secret") == value
    else:
        with pytest.raises(ConfigError, match="BILLING_IDENTITY_WEBHOOK_SECRET"):
            load_settings(identity_webhook_secret=value)


def test_provider_auth_and_idempotency_header_defaults():
    s = load_settings()
    assert (s.provider_auth, s.provider_idempotency_header) == ("bearer", "chargebee-idempotency-key")
    assert load_settings(provider_auth="basic").provider_auth == "basic"
    with pytest.raises(ConfigError, match="BILLING_PROVIDER_AUTH"):
        load_settings(provider_auth="digest")


def test_an_id_is_the_whole_string():
    """Issue "Hardening" 14: `$` matched before a trailing newline, so `sub_1\\n` reached the provider."""
    from billingctl.domain.plans import looks_like_id

    assert looks_like_id("sub_1") and looks_like_id("credits-pro-USD-monthly")
    assert not any(looks_like_id(v) for v in ("sub_1\n", "sub_1\r\n", "\nsub_1", "sub 1", "", "a" * 129, None, 5))



@pytest.mark.parametrize("algorithms", ["HS256", "HS384", "HS512", "RS256,HS512"])
def test_production_accepts_only_asymmetric_session_algorithms(algorithms):
    """Issue "Hardening" 8: HS384 and HS512 passed the production check."""
    with pytest.raises(ConfigError, match="refused in production"):
        load_settings(env="production", session_jwt_algorithms=algorithms, **PROD_SECRETS, **PROD_PLAIN)
    assert load_settings(env="production", session_jwt_algorithms="RS256,ES256", **PROD_SECRETS, **PROD_PLAIN)


@pytest.mark.parametrize("missing", ["session_jwt_audience", "session_jwt_issuer"])
def test_production_requires_the_session_audience_and_issuer(missing):
    plain = {k: v for k, v in PROD_PLAIN.items() if k != missing}
    with pytest.raises(ConfigError, match=f"BILLING_{missing.upper()}"):
        load_settings(env="production", session_jwt_algorithms="RS256", **PROD_SECRETS, **plain)


def test_production_requires_redis_with_one_clear_line():
    """Issue "Hardening" 7: without Redis the budget, breakers and cache invalidation are per process."""
    plain = {k: v for k, v in PROD_PLAIN.items() if k != "redis_url"}
    with pytest.raises(ConfigError) as info:
        load_settings(env="production", session_jwt_algorithms="RS256", **PROD_SECRETS, **plain)
    assert info.value.message == "configuration error: missing required setting for BILLING_ENV=production: " \
                                 "BILLING_REDIS_URL"


def test_the_sandbox_clock_is_for_simulations_only():
    """Issue "A month of traffic": jobs in their own processes share the sandbox's clock; production
    never reads any clock but the system's."""
    assert load_settings(clock="sandbox").clock == "sandbox"
    with pytest.raises(ConfigError, match="BILLING_CLOCK"):
        load_settings(env="production", clock="sandbox", session_jwt_algorithms="RS256", **PROD_SECRETS,
                      **PROD_PLAIN)


def test_a_clock_skew_is_only_for_the_sandbox_clock():
    """Decision 115: simulations run our processes with their clock off the sandbox's; the skew is
    refused with the system clock (nothing in production moves our time)."""
    assert load_settings(clock="sandbox", clock_skew_seconds=7).clock_skew_seconds == 7
    with pytest.raises(ConfigError, match="BILLING_CLOCK_SKEW_SECONDS"):
        load_settings(clock_skew_seconds=7)


def test_every_runbook_says_how_to_know_it_is_fixed_and_uses_only_commands_that_exist():
    """Issue 38 item 7: every runbook ends with how to know its incident is closed, and each `billingctl`
    command it names exists (a runbook that asks for a user or subscription id names the command that
    lists them)."""
    import re
    import shlex
    from pathlib import Path

    import typer

    from billingctl.cli.main import app

    root = typer.main.get_command(app)
    runbooks = sorted((Path(__file__).resolve().parents[2] / "docs" / "runbooks").glob("*.md"))
    assert runbooks
    for runbook in runbooks:
        text = runbook.read_text()
        assert "**How you know it is fixed.**" in text, runbook.name
        for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
            for line in block.splitlines():
                line = line.split("#", 1)[0].strip()
                if not line.startswith("billingctl "):
                    continue
                words = [w for w in shlex.split(line)[1:] if not w.startswith("-")]
                command = root
                while hasattr(command, "commands") and words and words[0] in command.commands:
                    command = command.commands[words.pop(0)]
                assert not hasattr(command, "commands"), f"{runbook.name}: {line}"


def test_only_the_environment_and_the_overrides_are_read(tmp_path, monkeypatch):
    """The units pass an EnvironmentFile; no .env file in the working directory and no secrets directory is
    ever read, even one named to pydantic-settings, so what a process runs with is what its environment says."""
    (tmp_path / ".env").write_text("BILLING_DATABASE_URL=sqlite:///from-dotenv.db\n")
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "billing_internal_token").write_text("from-a-secrets-dir")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BILLING_PROVIDER_RATE_LIMIT", "42")
    s = load_settings(_env_file=".env", _secrets_dir=str(secrets))
    assert s.database_url == "sqlite:///./billing.db" and s.internal_token is None
    assert s.provider_rate_limit == 42  # the environment is read
    assert load_settings(database_url="sqlite:///x.db").database_url == "sqlite:///x.db"  # and the overrides
