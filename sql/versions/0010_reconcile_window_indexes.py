"""Indexes for reconcile's window: ledger rows and purchases made since a time, open follow-ups

An incremental reconcile checks what changed since its watermark (decision 133); these keep its own
books' checks proportional to the window instead of to history.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26
"""
from alembic import op
import sqlalchemy as sa


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None

OPEN = "provider_recorded_at IS NULL AND closed_at IS NULL"


def upgrade() -> None:
    op.create_index(op.f('ix_credit_ledger_created_at'), 'credit_ledger', ['created_at'], unique=False)
    op.create_index('ix_purchase_created_at', 'purchase', ['created_at'], unique=False)
    op.create_index('ix_purchase_open_followup', 'purchase', ['created_at'], unique=False,
                    postgresql_where=sa.text(OPEN), sqlite_where=sa.text(OPEN))


def downgrade() -> None:
    op.drop_index('ix_purchase_open_followup', table_name='purchase')
    op.drop_index('ix_purchase_created_at', table_name='purchase')
    op.drop_index(op.f('ix_credit_ledger_created_at'), table_name='credit_ledger')
