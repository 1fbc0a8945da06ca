"""Entry point of `billingctl`. Keep imports light: heavy libraries load inside commands."""

from __future__ import annotations

import typer

from billingctl import __version__
from billingctl.cli.context import CliContext, command, set_ctx
from billingctl.cli.output import Output

root = typer.Typer(
    name="billingctl",
    help="Billing operations toolkit: every operation of the billing service, for people and jobs.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion: one command for bash, zsh or fish
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: Typer's Rich help renderer doubles the start-up time
    context_settings={"help_option_names": ["-h", "--help"]},
)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Global flags: accepted before or after the sub-command (moved to the front before parsing).
GLOBAL_FLAGS = ("--json", "--dry-run")
GLOBAL_OPTIONS = ("--log-level", "--output")


def split_global_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """The global flags and options, wherever they are, and the rest in order; a `--` ends the scan."""
    front, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest.extend(argv[i:])
            break
        name = arg.split("=", 1)[0]
        if arg in GLOBAL_FLAGS:
            front.append(arg)
        elif name in GLOBAL_OPTIONS and "=" in arg:
            front.append(arg)
        elif arg in GLOBAL_OPTIONS and i + 1 < len(argv):
            front.extend(argv[i:i + 2])
            i += 1
        else:
            rest.append(arg)
        i += 1
    return front, rest


def hoist_global_flags(argv: list[str]) -> list[str]:
    """`billingctl health --json` works like `billingctl --json health`."""
    front, rest = split_global_flags(argv)
    return front + rest


def command_word(rest: list[str]) -> str | None:
    """The command a command line names (the first of what is not global), or None when an option comes
    first (`-h`, `--version`, `--install-completion`, `--`): the root's own options answer about every
    command."""
    return rest[0] if rest and not rest[0].startswith("-") else None


def _version(value: bool) -> None:
    if value:
        typer.echo(f"billingctl {__version__}")
        raise typer.Exit(0)


@root.callback()
def _root(
    ctx: typer.Context,
    json_output: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; change nothing."),
    log_level: str = typer.Option(None, "--log-level", envvar="BILLING_LOG_LEVEL", metavar="LEVEL",
                                  help=f"Log level: {', '.join(LOG_LEVELS)} (default WARNING; INFO for "
                                       "`jobs run`)."),
    output: str = typer.Option(None, "--output", metavar="FORMAT",
                               help="table (on a terminal), tsv (through a pipe) or json."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
):
    from billingctl.adapters.logs import configure_logging
    from billingctl.cli.output import OUTPUTS

    if log_level is not None and log_level.upper() not in LOG_LEVELS:
        raise typer.BadParameter(f"{log_level!r} is not one of {', '.join(LOG_LEVELS)}", param_hint="--log-level")
    if output is not None and output not in OUTPUTS:
        raise typer.BadParameter(f"{output!r} is not one of {', '.join(OUTPUTS)}", param_hint="--output")
    configure_logging((log_level or "WARNING").upper())
    json_mode = json_output or output == "json"
    ctx.obj = set_ctx(CliContext(json=json_mode, dry_run=dry_run, output=Output(json_mode, output),
                                 log_level_given=log_level is not None))
    ctx.call_on_close(ctx.obj.close)  # the command's connections end with it, whatever it raised


@command(root, "version")
def version():
    """Print the version."""
    from billingctl.cli.context import get_ctx

    get_ctx().output.result({"version": __version__}, human=f"billingctl {__version__}")


# Commands on the root (module, its function registering them), then one module per noun
# (`billingctl/cli/<noun>.py`), in the order `billingctl -h` lists them.
ROOT_COMMANDS = (("health", "register"), ("demo", "register"), ("subscriptions", "register_root_commands"),
                 ("events", "register_root_commands"), ("reconcile", "register"), ("trace", "register"))
NOUNS = ("db", "alerts", "sandbox", "orphans", "media", "jobs", "payments", "lock", "users", "renewals", "fraud",
         "checkout", "quota", "products", "subscriptions", "events")
ROOT = "(root)"  # in `_registered`: the root's own commands
_registered: set[str] = set()


def _register(only: str | None = None) -> typer.Typer:
    """The root app with every command, or with `only` (a noun) the root and that noun's commands alone: a
    command loads its own module and no other command's (issue 39 item 5: `jobs run` loaded all twenty)."""
    import importlib

    if only not in NOUNS and ROOT not in _registered:
        _registered.add(ROOT)
        for module_name, function in ROOT_COMMANDS:
            getattr(importlib.import_module(f"billingctl.cli.{module_name}"), function)(root)
        _add_examples(root, groups=False)
    for noun in (only,) if only in NOUNS else NOUNS:
        if noun not in _registered:
            _registered.add(noun)
            sub = importlib.import_module(f"billingctl.cli.{noun}").app
            _add_examples(sub, f"{noun} ")
            root.add_typer(sub, name=noun)
    return root


def __getattr__(name: str):
    """`app`: the root with every command (tests and `billingctl -h` see them all)."""
    if name == "app":
        return _register()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# One example per command, shown at the end of its help (`billingctl COMMAND -h`).
EXAMPLES = {
    "version": "billingctl version --json",
    "health": "billingctl health --watch 10",
    "demo": "billingctl demo",
    "activate": "billingctl activate sub_123 --dry-run",
    "poll": "billingctl poll --since 2h --all-invoices",
    "sync": "billingctl sync sub_123 --dry-run",
    "sync-all": "billingctl sync-all --since 1d",
    "invalidate": "billingctl invalidate user_123",
    "reconcile": "billingctl reconcile --since 2d --output tsv",
    "trace": "billingctl trace user_123 --json",
    "db upgrade": "billingctl db upgrade --dry-run",
    "db current": "billingctl db current --json",
    "db prune": "billingctl --dry-run db prune",
    "alerts send": "billingctl alerts send 'checkout latency high' --dry-run",
    "alerts list": "billingctl alerts list --state pending",
    "alerts deliver": "billingctl alerts deliver",
    "sandbox serve": "billingctl sandbox serve --port 8900",
    "sandbox catalog": "billingctl sandbox catalog --output tsv",
    "sandbox pay": "billingctl sandbox pay sub_123 --drop-webhook",
    "sandbox refund": "billingctl sandbox refund pay_123",
    "sandbox instrument": "billingctl sandbox instrument user_123 --type PAYPAL --default",
    "sandbox fault": "billingctl sandbox fault provider 503 --count 3",
    "sandbox webhooks": "billingctl sandbox webhooks hold",
    "sandbox clear-faults": "billingctl sandbox clear-faults",
    "sandbox clock": "billingctl sandbox clock 3600",
    "sandbox backdating": "billingctl sandbox backdating on",
    "sandbox async-charges": "billingctl sandbox async-charges PENDING",
    "sandbox async-refunds": "billingctl sandbox async-refunds FAILED",
    "sandbox finish": "billingctl sandbox finish pay_123",
    "sandbox dispute": "billingctl sandbox dispute pay_123",
    "sandbox dispute-status": "billingctl sandbox dispute-status pay_123 LOST --dispute-id dp_1",
    "sandbox capture": "billingctl sandbox capture pay_123 --amount 500",
    "sandbox cancel-payment": "billingctl sandbox cancel-payment pay_123",
    "orphans run": "billingctl orphans run",
    "orphans list": "billingctl orphans list --state needs_review",
    "orphans show": "billingctl orphans show pay_123",
    "orphans retry": "billingctl orphans retry pay_123",
    "orphans resolve": "billingctl orphans resolve pay_123 --refund --reason 'customer asked' --yes",
    "media sign": "billingctl media sign /media/a.png",
    "media verify": "billingctl media verify '/media/a.png?verify=1700000000-abc'",
    "jobs list": "billingctl jobs list",
    "jobs run": "billingctl jobs run poll --loop",
    "jobs render": "billingctl jobs render --out .",
    "payments record": "billingctl payments record pay_123",
    "payments refund": "billingctl payments refund pay_123 --reason 'charged twice for one period' --yes",
    "lock show": "billingctl lock show user_123",
    "lock list": "billingctl lock list --problem drift --since 1d",
    "lock clear": "billingctl lock clear user_123 --lane nsfw --reason 'wrong lock' --yes",
    "lock repair": "billingctl lock repair user_123 --lane sfw",
    "lock backfill-mid": "billingctl --dry-run lock backfill-mid",
    "users show": "billingctl users show user_123",
    "users freeze": "billingctl users freeze user_123 --reason chargeback --notify --yes",
    "users unfreeze": "billingctl users unfreeze user_123 --reason 'chargeback won' --yes",
    "renewals run": "billingctl renewals run --dry-run",
    "renewals list": "billingctl renewals list --user user_123",
    "fraud velocity": "billingctl fraud velocity",
    "checkout cleanup": "billingctl checkout cleanup --dry-run",
    "quota show": "billingctl quota show user_123",
    "products list": "billingctl products list --json",
    "subscriptions show": "billingctl subscriptions show sub_123 --customer user_123",
    "subscriptions cancel": "billingctl subscriptions cancel sub_123 --reason 'customer asked' --yes",
    "events list": "billingctl events list --state parked --since 1d",
    "events show": "billingctl events show 42",
    "events replay": "billingctl events replay 42 --reason 'fixed the bug' --yes",
}


def _add_examples(typer_app: typer.Typer, prefix: str = "", groups: bool = True) -> None:
    for info in typer_app.registered_commands:
        name = info.name or (info.callback.__name__ if info.callback else "")
        example = EXAMPLES.get(f"{prefix}{name}")
        if example:
            doc = info.help or (info.callback.__doc__ or "").strip()
            info.help = f"{doc}\n\nExample: {example}"
    for group in typer_app.registered_groups if groups else ():
        _add_examples(group.typer_instance, f"{prefix}{group.name} ")


def _choices(param) -> tuple[str, ...]:
    import typing

    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if typing.get_origin(annotation) is typing.Literal:
        return tuple(str(v) for v in typing.get_args(annotation))
    return ()


def uniform_metavars(command) -> None:
    """One placeholder style in every help: the parameter's name in capitals (`USER_ID`, `SINCE`,
    `LIMIT`); the values of a choice are listed once, in the option's help."""
    for param in command.params:
        if getattr(param, "is_flag", False) or param.name in ("help", "install_completion",
                                                              "show_completion"):
            continue
        choices = _choices(param)
        if param.metavar is None or choices:
            param.metavar = (param.name or "").upper()
        if param.param_type_name == "argument":  # `USER_ID`, not `{user_id}` and `user_id <str>`
            shown = param.metavar if param.required else f"[{param.metavar}]"
            param.get_usage_pieces = lambda ctx, shown=shown: [shown]
            param.display_type_rich = lambda ctx: None
        if choices and hasattr(param, "help"):
            values = ", ".join(choices)
            if values not in (param.help or ""):
                param.help = f"{(param.help or '').rstrip('.')}. One of: {values}.".lstrip(". ")
    for sub in getattr(command, "commands", {}).values():
        if not sub.short_help and sub.help:
            # The whole first sentence in the command list, wrapped, never cut with "...".
            first = " ".join(sub.help.strip().split("\n\n", 1)[0].split())
            sub.short_help = first.split(". ", 1)[0].rstrip(".")
        uniform_metavars(sub)


def build_command(word: str | None = None):
    """The Click command `billingctl` runs (Typer's app with one placeholder style): every command, or for a
    command line whose command word is a noun (`jobs run poll`) the root and that noun's."""
    import typer.main

    command = typer.main.get_command(_register(word))
    uniform_metavars(command)
    return command


def main() -> None:
    import sys

    front, rest = split_global_flags(sys.argv[1:])
    build_command(command_word(rest))(args=front + rest, prog_name="billingctl")
