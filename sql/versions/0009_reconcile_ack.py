"""reconcile_ack: violations a person has judged stop paging (issue 36)

A violation acknowledged with a reason (`billingctl reconcile ack CHECK SUBJECT --reason R`) is still
reported by reconcile, apart, and no longer counted; a new violation still is.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26
"""
from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'reconcile_ack',
        sa.Column('check_name', sa.String(length=64), nullable=False),
        sa.Column('subject', sa.String(length=200), nullable=False),
        sa.Column('reason', sa.Text(), nullable=False),
        sa.Column('actor', sa.String(length=128), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('check_name', 'subject'),
    )


def downgrade() -> None:
    op.drop_table('reconcile_ack')
