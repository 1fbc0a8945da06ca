"""purchase.closed_reason, closed_at: a purchase whose follow-up at the provider has ended without it

A payment for a provider invoice that was voided while the charge was in flight is refunded (decision
113); a same-plan duplicate or an orphan refunded by recovery or by an operator is too. Its purchase stays
(the money history), closed: no follow-up records it on an invoice, and reconcile expects its credits
reversed. Purchases already refunded by orphan recovery are closed by this revision.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25
"""
from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('purchase', schema=None) as batch_op:
        batch_op.add_column(sa.Column('closed_reason', sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column('closed_at', sa.DateTime(timezone=True), nullable=True))
    op.execute(
        "UPDATE purchase SET closed_reason = 'refunded', closed_at = created_at "
        "WHERE provider_recorded_at IS NULL AND transaction_id IN (SELECT payment_id FROM orphan_recovery "
        "WHERE status = 'duplicate_refunded' OR resolution IN ('refunded', 'refunded_elsewhere'))")


def downgrade() -> None:
    with op.batch_alter_table('purchase', schema=None) as batch_op:
        batch_op.drop_column('closed_at')
        batch_op.drop_column('closed_reason')
