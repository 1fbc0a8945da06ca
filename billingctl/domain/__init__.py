"""Pure domain code: entities, statuses, lanes, plans, money, sentinel errors. No I/O."""
