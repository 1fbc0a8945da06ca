"""Fixtures of the end-to-end tests."""

import pytest


@pytest.fixture
def env(settings):
    """The environment a CLI subprocess needs to see the test's database and sandbox."""
    return {"BILLING_DATABASE_URL": settings.database_url, "BILLING_SANDBOX_DB": settings.sandbox_db}
