"""The output sink chosen by --json: data to stdout, errors, warnings and hints to stderr."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from datetime import date, datetime
from decimal import Decimal


def _default(value):
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if hasattr(value, "get_secret_value"):
        return "**********"
    return str(value)


def dumps(value) -> str:
    return json.dumps(value, default=_default, sort_keys=False)


NONE = "—"
OUTPUTS = ("table", "tsv", "json")


def human(value) -> str:
    """A value as a person reads it: ISO 8601 UTC times, `—` for none, lists joined, no Python repr."""
    if value is None or value == "":
        return NONE
    if isinstance(value, datetime):
        from datetime import UTC

        moment = value if value.tzinfo else value.replace(tzinfo=UTC)
        return moment.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple | set):
        return ", ".join(human(v) for v in value) or NONE
    if isinstance(value, dict):
        return ", ".join(f"{k}={human(v)}" for k, v in value.items()) or NONE
    if hasattr(value, "get_secret_value"):
        return "**********"
    return str(value)


# Columns of free text: the only ones a narrow terminal cuts (ids, statuses and times stay whole).
FREE_TEXT = frozenset({"detail", "reason", "last_error", "error", "message", "summary", "description", "title",
                       "activation_error", "resolution", "help", "text", "note", "command", "what"})
FREE_MIN, FREE_COMFORT = 12, 40


def _tsv_cell(value) -> str:
    return human(value).replace("\t", " ").replace("\n", " ")


class Output:
    def __init__(self, json_mode: bool = False, output: str | None = None):
        self.json_mode = json_mode or output == "json"
        # table on a terminal, TSV through a pipe (cron, ssh, `> file`): never cut to a width
        self.output = output or ("json" if json_mode else None)

    def _format(self) -> str:
        if self.json_mode:
            return "json"
        return self.output or ("table" if sys.stdout.isatty() else "tsv")

    def _console(self, stderr: bool = False):
        from rich.console import Console

        return Console(stderr=stderr, highlight=False, soft_wrap=True)

    def result(self, data, human_line: str | None = None, **kw) -> None:
        """One result: the JSON document, or a human line (or one `key: value` line per field). Stored
        text is never read as markup, and nothing is printed as Python repr."""
        human_line = kw.pop("human", human_line)
        fmt = self._format()
        if fmt == "json":
            sys.stdout.write(dumps(data) + "\n")
            return
        if human_line is not None:
            sys.stdout.write(f"{human_line}\n")
            return
        if isinstance(data, dict):
            if fmt == "tsv":
                sys.stdout.write("".join(f"{k}\t{_tsv_cell(v)}\n" for k, v in data.items()))
                return
            self._block(data, 0)
            return
        sys.stdout.write(f"{human(data)}\n")

    def table(self, rows: list[dict], columns: list[str] | None = None, title: str | None = None,
              data=None) -> None:
        fmt = self._format()
        if fmt == "json":
            sys.stdout.write(dumps(data if data is not None else rows) + "\n")
            return
        columns = columns or (list(rows[0].keys()) if rows else [])
        if fmt == "tsv":
            sys.stdout.write("\t".join(columns) + "\n")
            sys.stdout.write("".join("\t".join(_tsv_cell(row.get(c)) for c in columns) + "\n" for row in rows))
            return
        from rich.table import Table
        from rich.text import Text

        cells = [[human(row.get(c)) for c in columns] for row in rows]
        console = self._console()
        natural = [max([len(column), *(len(line[i]) for line in cells)]) for i, column in enumerate(columns)]
        free = [i for i, column in enumerate(columns) if column in FREE_TEXT]
        whole = [max([len(column), *(len(word) for line in cells for word in line[i].split())])
                 for i, column in enumerate(columns)]
        narrowest = sum((min(FREE_MIN, natural[i]) if i in free else whole[i]) + 3 for i in range(len(columns))) + 1
        if narrowest > console.width:  # no table fits without splitting an id: one block per row
            self._records(cells, columns, title, console.width)
            return
        table = Table(title=title)
        # Free text gets what the other columns leave (at least FREE_MIN each), cut with an ellipsis;
        # `--output tsv` and `--json` give all of it.
        room = 0
        if free:  # what the others leave at their full width; if that is little, at their ids' width
            room = (console.width - sum(w + 3 for i, w in enumerate(natural) if i not in free) - 1) // len(free) - 3
            if room < FREE_COMFORT:
                room = min(FREE_COMFORT, (console.width - sum(w + 3 for i, w in enumerate(whole) if i not in free)
                                          - 1) // len(free) - 3)
            room = max(FREE_MIN, room)
        for i, column in enumerate(columns):
            if i in free:
                table.add_column(column, overflow="ellipsis", no_wrap=True, max_width=room)
            else:  # ids, statuses, times: never split; a cell of several ids breaks between them only
                table.add_column(column, min_width=whole[i], overflow="fold")
        for line in cells:
            table.add_row(*(Text(cell) for cell in line))
        console.print(table, soft_wrap=False)

    def _block(self, data: dict, indent: int) -> None:
        """`key: value` lines; a nested document is an indented block under its key, a list of documents a
        table under its key (issue 38 item 10: they were one long `k=v` line)."""
        from rich.text import Text

        console = self._console()
        for key, value in data.items():
            if isinstance(value, dict) and value:
                console.print(Text(f"{' ' * indent}{key}:", style="bold"))
                self._block(value, indent + 2)
            elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                console.print(Text(f"{' ' * indent}{key}:", style="bold"))
                self.table(value)
            else:
                line = Text(f"{' ' * indent}{key}: ", style="bold")
                line.append(human(value))  # plain text: `[/]` or `[red]` in stored data is shown as is
                console.print(line)

    @staticmethod
    def _records(cells: list[list[str]], columns: list[str], title: str | None, width: int) -> None:
        """Rows as blocks of `column  value` lines (a terminal too narrow for the table): values wrap
        between words only, so an id is never split."""
        import textwrap

        pad = max(len(c) for c in columns) + 2
        out = [title] if title else []
        for n, line in enumerate(cells, 1):
            out.append(f"── {n} " + "─" * max(0, min(width, 40) - len(str(n)) - 4))
            for column, cell in zip(columns, line, strict=True):
                wrapped = textwrap.wrap(cell, max(20, width - pad), break_long_words=False,
                                        break_on_hyphens=False) or [cell]
                out.append(f"{column:<{pad}}{wrapped[0]}")
                out.extend(" " * pad + more for more in wrapped[1:])
        sys.stdout.write("\n".join(out) + "\n")

    def error(self, message: str) -> None:
        sys.stderr.write(f"error: {message}\n")

    def warn(self, message: str) -> None:
        sys.stderr.write(f"warning: {message}\n")

    def progress(self, label: str, total: int | None = None):
        """The progress bar of a long batch (see `progress`); none for --json."""
        return progress(label, total, enabled=not self.json_mode)

    def info(self, message: str) -> None:
        if not self.json_mode:
            sys.stderr.write(message + "\n")


@contextmanager
def _logs_above(console):
    """While a bar is drawn, log lines are printed above it through its console, never onto its line."""
    import logging

    from rich.text import Text

    handlers = [h for h in logging.getLogger().handlers if getattr(h, "_billing", False)]
    saved = [h.emit for h in handlers]

    def emitter(handler):
        def emit(record):
            try:
                console.print(Text(handler.format(record)))
            except Exception:  # a log line must never break the batch
                handler.handleError(record)
        return emit

    for handler in handlers:
        handler.emit = emitter(handler)
    try:
        yield
    finally:
        for handler, emit in zip(handlers, saved, strict=True):
            handler.emit = emit


@contextmanager
def progress(label: str, total: int | None = None, enabled: bool = True):
    """A Rich progress bar on a terminal (with its total when known); nothing when disabled (--json) or
    through a pipe. Yields a callable that advances it (or None)."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    # The total may be learnt after the batch starts (advance(new_total=…)): `3/?` until then.
    columns = [SpinnerColumn(), TextColumn(label), BarColumn(), MofNCompleteColumn()]
    with Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar, \
            _logs_above(bar.console):
        task = bar.add_task(label, total=total)

        def advance(n: int = 1, new_total: int | None = None) -> None:
            if new_total is not None:
                bar.update(task, total=new_total)
            bar.advance(task, n)

        yield advance
