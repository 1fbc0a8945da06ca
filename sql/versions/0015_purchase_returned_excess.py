"""purchase.returned_excess: of a payment, what was given back because its invoice was part-paid at the
provider meanwhile (a cheque finance entered while our record waited): the rest of the invoice is what
the payment pays there, and the refund of the excess takes back no credits (decision 180).

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27
"""
import sqlalchemy as sa
from alembic import op


revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('purchase', sa.Column('returned_excess', sa.BigInteger(), nullable=False,
                                        server_default=sa.text('0')))


def downgrade() -> None:
    with op.batch_alter_table('purchase') as batch:
        batch.drop_column('returned_excess')
