"""The `billingctl` command line: one Typer sub-app per noun."""


def run() -> None:
    """The console script (and `python -m billingctl`): the start-up's collector policy before any import
    (decision 262; Typer and Click are the first), then the command line."""
    from billingctl import startup

    startup.begin()  # until the first engine: the start-up's imports, collected rarely
    from billingctl.cli.main import main

    main()
