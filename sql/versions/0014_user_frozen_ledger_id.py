"""users.frozen_ledger_id: where a freeze falls in the user's credit ledger, so that "credited after the
freeze" is read by the ledger's order, not by two hosts' clocks (decision 177). Users frozen before this
revision get the last row written at or before their frozen_at.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27
"""
import sqlalchemy as sa
from alembic import op


revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('users', sa.Column('frozen_ledger_id', sa.BigInteger(), nullable=True))
    op.execute("UPDATE users SET frozen_ledger_id = (SELECT COALESCE(MAX(l.id), 0) FROM credit_ledger l "
               "WHERE l.user_id = users.id AND l.created_at <= users.frozen_at) WHERE frozen_at IS NOT NULL")


def downgrade() -> None:
    with op.batch_alter_table('users') as batch:
        batch.drop_column('frozen_ledger_id')
