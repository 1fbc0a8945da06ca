"""Adapters: the database, Redis, the external systems' clients and the outbound sinks."""
