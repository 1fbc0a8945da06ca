"""Schemathesis against both WSGI apps: generated requests from docs/openapi.yaml, valid credentials;
no 5xx, and every response conforms to the document (status code, content type, schema)."""

import time
from pathlib import Path

import jwt
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from billingctl.bootstrap import Container
from webhooks_app import create_internal_app, create_public_app

pytestmark = pytest.mark.reliability
SPEC = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"
FIGURES = {"cases": 0}


def not_a_server_error(ctx, response, case):
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:300]}"


def run_operation(operation, app, token, checks):
    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def run(case):
        FIGURES["cases"] += 1
        case.call_and_validate(headers={"Authorization": f"Bearer {token}"}, checks=checks, app=app)

    run()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_apps_conform_to_the_openapi_document(make_settings, db_url):
    c = Container(make_settings(database_url=db_url, http_max_attempts=1))
    public, internal = create_public_app(container=c), create_internal_app(container=c)
    session = jwt.encode({"sub": "fuzz_user", "exp": int(time.time()) + 3600},
                         c.settings.secret("session_jwt_key"), algorithm="HS256")
    schema = schemathesis.openapi.from_path(str(SPEC))
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 12
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    for operation in operations:
        is_internal = operation.path.startswith("/internal/")
        app = internal if is_internal else public
        token = c.settings.secret("internal_token") if is_internal else session

        run_operation(operation, app, token, checks)
    print(f"schemathesis: {FIGURES['cases']} cases over {len(operations)} operations")
    c.close()
