"""`python -m billingctl` runs the CLI."""

from billingctl.cli import run

run()
