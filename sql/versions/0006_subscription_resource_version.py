"""subscription.provider_resource_version: provider copies applied in the provider's order

Two provider events of one second carry the same updated_at; the provider's reference orders changes by
resource_version (milliseconds). The local copy keeps the version it applied and refuses an older one.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25
"""
from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('subscription', schema=None) as batch_op:
        batch_op.add_column(sa.Column('provider_resource_version', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('subscription', schema=None) as batch_op:
        batch_op.drop_column('provider_resource_version')
