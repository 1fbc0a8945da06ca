"""indexes for the hot lookups: credit_ledger(payment_id), purchase(invoice_id), transaction(created_at)

A refund's reversal sums the payment's ledger rows under the user's row lock; renewals and reconcile
find the purchase of an invoice; the velocity watch reads the last minute of transactions. Each was a
scan of its table.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""
from alembic import op


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(op.f('ix_credit_ledger_payment_id'), 'credit_ledger', ['payment_id'], unique=False)
    op.create_index(op.f('ix_purchase_invoice_id'), 'purchase', ['invoice_id'], unique=False)
    op.create_index(op.f('ix_transaction_created_at'), 'transaction', ['created_at'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_transaction_created_at'), table_name='transaction')
    op.drop_index(op.f('ix_purchase_invoice_id'), table_name='purchase')
    op.drop_index(op.f('ix_credit_ledger_payment_id'), table_name='credit_ledger')
