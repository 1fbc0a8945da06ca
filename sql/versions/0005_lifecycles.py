"""lifecycles: dunning_attempt.resolved_at, the dispute table

A renewal charge in flight (a pending dunning row) is ended exactly once by whichever path sees it end:
the conditional update of its resolved_at. Disputes follow Primer's notifications to their decision.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25
"""
from alembic import op
import sqlalchemy as sa



revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('dunning_attempt', schema=None) as batch_op:
        batch_op.add_column(sa.Column('resolved_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index(batch_op.f('ix_dunning_attempt_payment_id'), ['payment_id'], unique=False)
    op.create_table(
        'dispute',
        sa.Column('dispute_id', sa.String(length=128), nullable=False),
        sa.Column('payment_id', sa.String(length=64), nullable=False),
        sa.Column('user_id', sa.String(length=64), nullable=True),
        sa.Column('order_id', sa.String(length=64), nullable=True),
        sa.Column('kind', sa.String(length=16), nullable=True),
        sa.Column('status', sa.String(length=16), nullable=True),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('amount', sa.BigInteger(), nullable=True),
        sa.Column('currency_code', sa.String(length=3), nullable=True),
        sa.Column('processor', sa.String(length=64), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('decided_at', sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint('dispute_id', name=op.f('pk_dispute')),
    )
    op.create_index(op.f('ix_dispute_payment_id'), 'dispute', ['payment_id'], unique=False)
    op.create_index(op.f('ix_dispute_user_id'), 'dispute', ['user_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_dispute_user_id'), table_name='dispute')
    op.drop_index(op.f('ix_dispute_payment_id'), table_name='dispute')
    op.drop_table('dispute')
    with op.batch_alter_table('dunning_attempt', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_dunning_attempt_payment_id'))
        batch_op.drop_column('resolved_at')
