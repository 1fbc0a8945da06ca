"""purchase.provider_recorded_at indexed: reconcile reads the purchases recorded at the provider in its window

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26
"""
from alembic import op


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index('ix_purchase_provider_recorded_at', 'purchase', ['provider_recorded_at'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_purchase_provider_recorded_at', table_name='purchase')
