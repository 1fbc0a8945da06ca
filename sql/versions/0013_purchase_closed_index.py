"""purchase.closed_at indexed where set: reconcile's daily run reads the purchases closed in its window
(a partial index: few purchases are ever closed)

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26
"""
import sqlalchemy as sa
from alembic import op


revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index('ix_purchase_closed_at', 'purchase', ['closed_at'], unique=False,
                    postgresql_where=sa.text('closed_at IS NOT NULL'), sqlite_where=sa.text('closed_at IS NOT NULL'))


def downgrade() -> None:
    op.drop_index('ix_purchase_closed_at', table_name='purchase')
