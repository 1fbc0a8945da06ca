"""The database: tables, engine, unit of work and migrations."""
