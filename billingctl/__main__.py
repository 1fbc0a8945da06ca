"""`python -m billingctl` runs the CLI."""

from billingctl.cli.main import main

main()
