"""invoice.term_start, invoice.term_end: the term the invoice's plan line bills (the provider's
`line_items[].date_from`, `date_to`), from its copies. The renewal job does not charge an invoice whose term
overlaps a term a kept payment of the subscription already paid (decision 204). NULL for a copy that does
not say (and for copies saved before this revision).

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-28
"""
import sqlalchemy as sa
from alembic import op


revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('invoice', sa.Column('term_start', sa.DateTime(timezone=True), nullable=True))
    op.add_column('invoice', sa.Column('term_end', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('invoice') as batch:
        batch.drop_column('term_end')
        batch.drop_column('term_start')
