"""Role processes' log files and last tracebacks on their node, and the agent's bounded answers to the coordinator's `logs` requests."""

from __future__ import annotations

import logging
import logging.handlers
import os
import time
from pathlib import Path
from typing import Any

import msgpack

from gossamer.core.faults import hold_at
from gossamer.core.role_log_names import LOG_TAIL, MAX_LISTED, TRACEBACK_MAX, parse_stem

__all__ = ["RoleLogs", "record_to_files"]

#: A role's log file rolls over at this size, one older file kept: a role costs its node at most twice this.
ROTATE_BYTES = 16 << 20
_TRACE_START = "Traceback (most recent call last)"


class _TracebackFile(logging.Handler):
    """Keeps the last traceback a record carries (an exception logged, or a traceback in its text) in a file."""

    def __init__(self, path: Path) -> None:
        super().__init__(logging.ERROR)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = ""
            if record.exc_info:
                text = logging.Formatter().formatException(record.exc_info)
            else:
                msg = record.getMessage()
                if _TRACE_START in msg:
                    text = msg[msg.index(_TRACE_START):]
            if text:
                data = text.encode("utf-8", "replace")[-TRACEBACK_MAX:]
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_bytes(data)
                tmp.replace(self.path)  # a reader never sees half of one
        except Exception:  # noqa: BLE001 — logging must never raise into the role
            self.handleError(record)


def record_to_files(log_file: str, fmt: str = "text") -> None:
    """In a role process: log to `log_file` too (rolled over at `ROTATE_BYTES`), and keep the last traceback
    logged beside it (`<stem>.traceback`). The agent serves both (`RoleLogs`)."""
    from gossamer.core.logs import formatted

    path = Path(log_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    root.addHandler(formatted(logging.handlers.RotatingFileHandler(path, maxBytes=ROTATE_BYTES, backupCount=1,
                                                                    encoding="utf-8"), fmt))
    root.addHandler(_TracebackFile(path.with_suffix(".traceback")))


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


class RoleLogs:
    """The role logs of one node: `<root>/<experiment>/<stem>.log` and `.traceback`; answers the `logs` op.

    A request names the experiment (checked by the file server against its token) and optionally a
    `stem`, an `offset` and `max` bytes. The answer lists the experiment's role logs here (stem,
    size, mtime, traceback mtime; newest first, at most `MAX_LISTED`) and, for a stem, a piece of
    its log (the last `max` bytes, or from `offset`; never more than `LOG_TAIL`) and its traceback.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path(self, experiment: str, stem: str) -> Path:
        """Where a role of `experiment` writes its log."""
        return self.root / experiment / f"{stem}.log"

    def answer(self, experiment: str, req: dict[str, Any]) -> list[bytes]:
        hold_at("logs")  # a slow node (tests)
        d = self.root / experiment
        listed: list[dict[str, Any]] = []
        if d.is_dir():
            for p in d.iterdir():
                if p.suffix == ".log" and parse_stem(p.stem) is not None:
                    listed.append({"stem": p.stem, "size": _size(p), "mtime": _mtime(p),
                                   "traceback_mtime": _mtime(p.with_suffix(".traceback"))})
        listed.sort(key=lambda e: -max(e["mtime"], e["traceback_mtime"]))
        out: dict[str, Any] = {"ok": True, "logs": listed[:MAX_LISTED], "now": time.time()}
        stem = req.get("stem")
        if not stem:
            return [msgpack.packb(out)]
        if not isinstance(stem, str) or parse_stem(stem) is None:
            return [msgpack.packb({"ok": False, "error": "stem: not a role log's name"})]
        offset, most = req.get("offset", 0), req.get("max", LOG_TAIL)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (offset, most)):
            return [msgpack.packb({"ok": False, "error": "offset and max must be ints >= 0"})]
        path = self.path(experiment, stem)
        if not path.is_file():
            return [msgpack.packb({"ok": False, "error": f"no log {stem} of {experiment} here"})]
        blob, start, size = _piece(path, offset, min(most or LOG_TAIL, LOG_TAIL))
        tb = path.with_suffix(".traceback")
        try:
            traceback = tb.read_bytes()[-TRACEBACK_MAX:].decode("utf-8", "replace")
        except OSError:
            traceback = ""
        out.update(stem=stem, start=start, end=start + len(blob), size=size, traceback=traceback,
                   traceback_mtime=_mtime(tb), mtime=_mtime(path))
        return [msgpack.packb(out), blob]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _piece(path: Path, offset: int, most: int) -> tuple[bytes, int, int]:
    """(bytes, where they start, the file's size): from `offset` when the file reaches it, else its last `most` bytes."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start = offset if 0 < offset <= size else max(0, size - most)
        f.seek(start)
        return f.read(most), start, size
