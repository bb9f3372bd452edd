"""Log setup of every gossamer process: plain text, or one JSON object per line (`--log-format json`)."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

from gossamer.core.errors import ConfigError

LOG_FORMATS = ("text", "json")

#: Attributes every LogRecord has; anything else on a record came from `extra=` and is logged.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
_context: dict[str, str] = {}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (ISO 8601, UTC), level, logger, msg, the process's
    context (node, experiment, role when known), the record's `extra=` fields, and exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            **_context,
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return json.dumps(out, ensure_ascii=False)


class _TextContext(logging.Filter):
    """Text format: a `[role]` tag, like the role processes always had."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.context_tag = f"[{_context['role']}] " if "role" in _context else ""
        return True


def set_context(**fields: str) -> None:
    """Add fields (node, experiment, role, ...) to every later record of this process; "" removes one."""
    for key, value in fields.items():
        if value:
            _context[key] = str(value)
        else:
            _context.pop(key, None)


def configure(level: str = "INFO", fmt: str = "text", *, stream: TextIO | None = None, **context: str) -> None:
    """Replace the root logger's handlers with one writing `fmt` ("text" or "json") to `stream` (stderr).

    Raises:
        ConfigError: unknown `fmt` or `level`.
    """
    if fmt not in LOG_FORMATS:
        raise ConfigError("log_format", f"must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    if not isinstance(logging.getLevelName(level.upper()), int):
        raise ConfigError("log_level", f"unknown level {level!r}")
    set_context(**context)
    handler = formatted(logging.StreamHandler(stream or sys.stderr), fmt)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def formatted(handler: logging.Handler, fmt: str = "text") -> logging.Handler:
    """`handler` writing records as `configure` does in `fmt` (a second handler of the process, e.g. a file)."""
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.addFilter(_TextContext())
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(context_tag)s%(name)s: %(message)s"))
    return handler
