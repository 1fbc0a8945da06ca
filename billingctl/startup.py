"""The cyclic collector through a command's start-up (issue 39 item 5, decision 262).

A command's start-up imports its libraries: hundreds of thousands of objects that live as long as the
process. At the collector's default thresholds each import pays for passes over what the imports before
it made (about 180 million instructions, 6 %, of an idle one-shot `jobs run poll`), and the collection at
exit walks it all once more. `begin` (the CLI's entry point) raises the youngest generation's threshold
above what a command's start-up makes, so that the start-up is not collected before its freeze, yet the
collector is never switched off: a command that never reaches `end` still collects, less often (a server
started from the CLI ends its start-up before it serves). `end` (the first engine a process builds: by
then the command has loaded what it runs on) freezes what the start-up made, so no later pass walks it,
and puts the default thresholds back for the command's own work. Only a process that began so is
touched: the web apps freeze after their own start (webhooks_app), tests never.

Pydantic's plugins (an experimental feature; none is ours) are not looked for (decision 266): finding
them reads the entry points of every installed distribution, about 5 ms of every command.

At exit (decision 264) everything is frozen once more, after every other exit handler has run (`begin`
registers it first, and exit handlers run last-registered first): the interpreter's teardown then collects
several times over what is not frozen, and for a command that is about to end those passes free nothing
the exit itself does not. Objects left in reference cycles are not finalized at exit (CPython never
promised it); what a command holds open is closed before, by its own `with` blocks, the CLI's close of
its container, and the exit handlers of logging and of the metrics."""

from __future__ import annotations

import atexit
import gc
import os

# Above what any command's start-up makes before its first engine (105,000 to 141,000 objects measured,
# decision 266): at 100,000 the collector walked the whole start-up once, just before it was frozen.
START_THRESHOLDS = (500_000, 50, 50)
_defaults: tuple[int, ...] | None = None
_frozen_at_exit = False


def begin() -> None:
    global _defaults, _frozen_at_exit
    # Decision 266: no pydantic plugin is ours, and finding one reads every installed distribution's entry
    # points before the first model is built; an operator who wants one sets the variable (empty: all).
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    if not _frozen_at_exit:  # the first exit handler registered: the last to run
        _frozen_at_exit = True
        atexit.register(gc.freeze)
    if _defaults is None:
        _defaults = gc.get_threshold()
        gc.set_threshold(*START_THRESHOLDS)


def end() -> bool:
    """Freeze the start-up's objects and collect at the default thresholds again; False when the process
    did not begin so, or has already ended its start-up."""
    global _defaults
    if _defaults is None:
        return False
    defaults, _defaults = _defaults, None
    gc.freeze()
    gc.set_threshold(*defaults)
    return True
