"""subscription.deleted_at: when we learnt the provider no longer holds the subscription (support deleted it
there: its `subscription_deleted` event, or a read answered not found). A deleted subscription has no newer
copy, so a copy read after it (an event older than the deletion, polled late) changes nothing (decision 223).
NULL for every row before this revision: those deleted already are cancelled, and their older copies were
read long ago.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-28
"""
import sqlalchemy as sa
from alembic import op


revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('subscription', sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('subscription') as batch:
        batch.drop_column('deleted_at')
