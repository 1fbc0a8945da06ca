"""The base of every repository: a small class per aggregate, reached through the unit of work
(`uow.purchases.by_payment_id(...)`), that owns the SQL of its tables. Services say what they want;
each query is written once, here."""

from __future__ import annotations


class Repository:
    def __init__(self, uow):
        self.uow = uow

    def execute(self, statement, params=None):
        return self.uow.execute(statement, params)
