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


def head_revision_from_files() -> str | None:
    """The head revision read straight from sql/versions (no Alembic import on the CLI's hot path)."""
    import re

    revisions, parents = set(), set()
    for path in (SCRIPT_LOCATION / "versions").glob("*.py"):
        text = path.read_text()
        revision = re.search(r"^revision\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        down = re.search(r"^down_revision\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        if revision:
            revisions.add(revision.group(1))
        if down:
            parents.add(down.group(1))
    heads = revisions - parents
    return heads.pop() if len(heads) == 1 else None


def _stamped_revision(engine: Engine) -> str | None:
    from sqlalchemy import text

    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    except Exception:
        return None


def ensure_current(engine: Engine) -> None:
    """The embedded SQLite database is created and migrated on first use."""
    head = head_revision_from_files()
    if head is not None and _stamped_revision(engine) == head:
        return
    if current_revision(engine) != head_revision():
        upgrade(engine)


def probe(url: str) -> tuple[str, str | None, str | None]:
    """(dialect, current revision, head revision) of the database at `url`, through an engine of its own
    that migrates nothing: health must report a database that is behind, not migrate it. Raises when the
    database cannot be reached."""
    from sqlalchemy import text

    from billingctl.adapters.db.engine import make_engine

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return engine.dialect.name, current_revision(engine), head_revision()
    finally:
        engine.dispose()


def behind_message(url: str) -> str | None:
    """What an operator reads when a statement met a table or column the database does not hold and its
    schema is not the code's: both revisions (read without Alembic, which would log at a job's INFO level)
    and the command that brings the schema to the code's. None when the database is at the code's revision:
    a table missing there is no migration's to fix (decision 256)."""
    from billingctl.adapters.db.engine import make_engine

    engine = make_engine(url)
    try:
        current = _stamped_revision(engine)
    finally:
        engine.dispose()
    head = head_revision_from_files()
    if current == head:
        return None
    return (f"the database schema is behind this code (database at {current or 'no revision'}, code at "
            f"{head}): run `billingctl db upgrade`")
