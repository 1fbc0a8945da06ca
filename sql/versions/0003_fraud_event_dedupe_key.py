"""fraud_event.dedupe_key: one authorization attempt per payment (or per reservation)

The NSFW quota counts authorizations the orchestrator reports, once per payment id, and a checkout
or a renewal reserves its slot before it starts (check and reservation in one transaction under the
user's row lock). The key makes every report of one authorization one row.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""
from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('fraud_event', schema=None) as batch_op:
        batch_op.add_column(sa.Column('dedupe_key', sa.String(length=200), nullable=True))
        batch_op.create_unique_constraint(batch_op.f('uq_fraud_event_dedupe_key'), ['dedupe_key'])


def downgrade() -> None:
    with op.batch_alter_table('fraud_event', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('uq_fraud_event_dedupe_key'), type_='unique')
        batch_op.drop_column('dedupe_key')
