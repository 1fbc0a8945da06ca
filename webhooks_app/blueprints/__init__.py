"""Blueprints of the public and internal apps."""
