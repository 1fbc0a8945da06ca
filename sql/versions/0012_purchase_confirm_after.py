"""purchase.confirm_after: a renewal's payment waits this long for the provider's own confirmation (the
orchestrator's workflow records it on the invoice, the provider's payment_succeeded event says so) before
the activations job records it there itself (issue 39 item 1)

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-26
"""
import sqlalchemy as sa
from alembic import op


revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('purchase', schema=None) as batch_op:
        batch_op.add_column(sa.Column('confirm_after', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('purchase', schema=None) as batch_op:
        batch_op.drop_column('confirm_after')
