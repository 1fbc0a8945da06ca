"""Scheduled jobs: the schedule table and the lease-holding runner."""
