"""transaction.invoice_id held a subscription id where an in-flight report (PENDING, AUTHORIZED, SETTLING)
of a checkout's payment opened the row: a checkout's order id is its subscription id, not an invoice's
(decision 209). Such a row gets no invoice and names its subscription (its purchase's, when the payment
was recorded and moved to another subscription by orphan recovery, which skipped a row that named an
invoice). A data fix only; nothing to undo.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-28
"""
from alembic import op


revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        'UPDATE "transaction" SET subscription_id = COALESCE('
        '(SELECT p.subscription_id FROM purchase p WHERE p.transaction_id = "transaction".transaction_id '
        'AND p.invoice_id IS NULL), subscription_id, invoice_id), invoice_id = NULL '
        'WHERE invoice_id IN (SELECT s.id FROM subscription s)')


def downgrade() -> None:
    pass
