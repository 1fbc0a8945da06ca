"""The output sink chosen by --json: data to stdout, errors, warnings and hints to stderr."""

from __future__ import annotations

import json
import sys
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


class Output:
    def __init__(self, json_mode: bool = False):
        self.json_mode = json_mode

    def _console(self, stderr: bool = False):
        from rich.console import Console

        return Console(stderr=stderr, highlight=False, soft_wrap=True)

    def result(self, data, human: str | None = None) -> None:
        """One result: the JSON document, or a human line (or key: value lines)."""
        if self.json_mode:
            sys.stdout.write(dumps(data) + "\n")
            return
        if not sys.stdout.isatty():
            # A pipe (cron, systemd, a script): plain text, no Rich import on the job's start-up path.
            if human is not None:
                sys.stdout.write(f"{human}\n")
            elif isinstance(data, dict):
                sys.stdout.write("".join(f"{k}: {v}\n" for k, v in data.items()))
            else:
                sys.stdout.write(f"{data}\n")
            return
        if human is not None:
            self._console().print(human)
        elif isinstance(data, dict):
            for key, value in data.items():
                self._console().print(f"[bold]{key}[/bold]: {value}")
        else:
            self._console().print(str(data))

    def table(self, rows: list[dict], columns: list[str] | None = None, title: str | None = None,
              data=None) -> None:
        if self.json_mode:
            sys.stdout.write(dumps(data if data is not None else rows) + "\n")
            return
        from rich.table import Table

        columns = columns or (list(rows[0].keys()) if rows else [])
        table = Table(title=title)
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*("" if row.get(c) is None else str(row.get(c)) for c in columns))
        self._console().print(table)

    def error(self, message: str) -> None:
        sys.stderr.write(f"error: {message}\n")

    def warn(self, message: str) -> None:
        sys.stderr.write(f"warning: {message}\n")

    def info(self, message: str) -> None:
        if not self.json_mode:
            sys.stderr.write(message + "\n")
