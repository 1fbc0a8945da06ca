"""Alembic environment: runs on the connection handed over by billingctl.adapters.db.migrate."""

from alembic import context

from billingctl.adapters.db.tables import metadata

config = context.config
connection = config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through `billingctl db upgrade`")

context.configure(
    connection=connection,
    target_metadata=metadata,
    render_as_batch=connection.dialect.name == "sqlite",
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
