"""Billing operations toolkit: the core services, adapters and the `billingctl` CLI."""

__version__ = "0.1.0"
