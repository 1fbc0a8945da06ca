"""checkout_session.order_id: the order id the front end holds, apart from the invoice

A future subscription has no invoice at the real provider, so a checkout's order id is its
subscription id and the invoice is known only once activation starts the subscription.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""
from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('checkout_session', schema=None) as batch_op:
        batch_op.add_column(sa.Column('order_id', sa.String(length=64), nullable=True))
        batch_op.create_unique_constraint(batch_op.f('uq_checkout_session_order_id'), ['order_id'])
    # Earlier checkouts gave the orchestrator their invoice id (or subscription id) as the order id.
    op.execute("UPDATE checkout_session SET order_id = invoice_id WHERE order_id IS NULL")


def downgrade() -> None:
    with op.batch_alter_table('checkout_session', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('uq_checkout_session_order_id'), type_='unique')
        batch_op.drop_column('order_id')
