"""invoice.provider_resource_version: the provider's invoice copies are applied in resource_version order

The invoice, like the subscription (revision 0006), is one transition table over the statuses the
provider documents (decision 117). A copy is applied only when it is not older than the one applied last.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25
"""
from alembic import op
import sqlalchemy as sa


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('invoice', schema=None) as batch_op:
        batch_op.add_column(sa.Column('provider_resource_version', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('invoice', schema=None) as batch_op:
        batch_op.drop_column('provider_resource_version')
