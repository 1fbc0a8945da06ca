"""invoice.deleted_at: when our copy learned that the provider deleted the invoice (its `deleted` flag, sent
as `invoice_deleted`). A deleted invoice keeps the status it had and is owed by nobody: a charge in flight
for it is cancelled, one that settles on it is refunded once (decision 201).

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-28
"""
import sqlalchemy as sa
from alembic import op


revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('invoice', sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('invoice') as batch:
        batch.drop_column('deleted_at')
