"""Local simulators of the subscription provider and the payment orchestrator (development and tests)."""
