"""orphan_recovery: a partial index of the payments a person marked handled, by subscription. Recording
reads, for each new payment, whether another payment of its order was kept by a person (decision 253).

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-04
"""
import sqlalchemy as sa
from alembic import op


revision = '0020'
down_revision = '0019'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index('ix_orphan_recovery_handled', 'orphan_recovery', ['subscription_id'],
                    postgresql_where=sa.text("resolution = 'handled'"), sqlite_where=sa.text("resolution = 'handled'"))


def downgrade() -> None:
    op.drop_index('ix_orphan_recovery_handled', table_name='orphan_recovery')
