"""Logs: JSON lines on stderr; the spec's markers appear verbatim in the message."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

_RESERVED = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class HumanFormatter(logging.Formatter):
    """For a person at a terminal: `level: message (key=value …)`, no JSON, no escaped traceback."""

    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(f"{k}={v}" for k, v in record.__dict__.items()
                          if k not in _RESERVED and not k.startswith("_"))
        line = f"{record.levelname.lower()}: {record.getMessage()}" + (f" ({extras})" if extras else "")
        if record.exc_info and record.levelno >= logging.ERROR:
            line += "\n" + self.formatException(record.exc_info)
        return line


_last_warned: dict[str, float] = {}


def warn_now_and_then(logger: logging.Logger, key: str, message: str, *args, every: float = 60.0, **kw) -> None:
    """A warning about a lasting condition (Redis down: every call falls back) once a minute per `key`,
    not once per call; the error counters still count every occurrence."""
    import time

    now = time.monotonic()
    if now - _last_warned.get(key, -every) >= every:
        _last_warned[key] = now
        logger.warning(message, *args, **kw)


def item_failed(logger: logging.Logger, what: str, exc: BaseException, **ids) -> None:
    """One line per failed item of a batch: an expected failure (a refusal, a rate limit, an outage) is
    a concise warning; only an unexpected exception carries its traceback."""
    from billingctl.domain.errors import BillingError

    if isinstance(exc, BillingError):
        logger.warning("%s failed: %s", what, exc.message, extra={**ids, "error_code": exc.code})
    else:
        logger.exception("%s crashed", what, extra=ids)


def configure_logging(level: str = "INFO") -> None:
    root = logging.getLogger()
    if any(getattr(h, "_billing", False) for h in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    # JSON lines for machines (journal, cron, pipes), readable lines for a person at a terminal.
    handler.setFormatter(HumanFormatter() if sys.stderr.isatty() else JsonFormatter())
    handler._billing = True
    root.addHandler(handler)
    root.setLevel(level)
    # One line per outbound HTTP request is noise at INFO; our clients log failures themselves.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))


def set_level(level: str) -> None:
    root = logging.getLogger()
    root.setLevel(level)
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))
