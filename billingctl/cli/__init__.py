"""The `billingctl` command line: one Typer sub-app per noun."""
