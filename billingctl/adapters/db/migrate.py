"""Alembic migrations in sql/: upgrade, current and head revisions."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine

SCRIPT_LOCATION = Path(__file__).resolve().parents[3] / "sql"


def _config(connection=None):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPT_LOCATION))
    cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> tuple[str | None, str | None]:
    """Apply migrations up to `revision`; returns (before, after)."""
    from alembic import command

    before = current_revision(engine)
    with engine.begin() as conn:
        command.upgrade(_config(conn), revision)
    return before, current_revision(engine)


def ensure_current(engine: Engine) -> None:
    """The embedded SQLite database is created and migrated on first use."""
    if current_revision(engine) != head_revision():
        upgrade(engine)
