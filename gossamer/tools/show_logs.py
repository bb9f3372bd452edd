"""`gossamer logs ID [--role worker/3] [--follow]`: a role's log and last traceback, from the node that ran it."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from gossamer.core.errors import UnavailableError
from gossamer.tools.watch import ctrl_c

_FINISHED = ("completed", "failed", "cancelled")


def _what(log: dict[str, Any]) -> str:
    if log["role"] == "worker":
        return f"worker/{log['index']} rank {log['local_rank']}"
    return f"ps/{log['index']}" + (" (backup)" if log["replica"] else "")


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def show_logs(job: Any, *, role: str = "", local_rank: int | None = None, follow: bool = False,
              max_bytes: int = 0, interval_s: float = 1.0, out: TextIO | None = None,
              err: TextIO | None = None) -> int:
    """Print a role's log (the last `max_bytes`, 64 KiB at most) and its last traceback; with `follow`, then
    print what the role writes until Ctrl-C or the experiment has finished and its log is still.

    Returns 0 (130 when Ctrl-C ended a follow).

    Raises:
        NotFoundError: unknown experiment, or no live node holds a log of the role.
    """
    out, err = out or sys.stdout, err or sys.stderr
    log = job.logs(role, local_rank=local_rank, max_bytes=max_bytes)
    err.write(f"== {_what(log)} of {job.id} on node {log['node'] or log['node_id']}, log bytes "
              f"{log['start']}-{log['end']}" + (f" ({log['skipped']} earlier bytes left out)" if log["skipped"] else "")
              + (f", last written {_stamp(log['modified_unix'])}" if log["modified_unix"] else "") + "\n")
    if log["note"]:
        err.write(f"== not asked: {log['note']}\n")
    out.write(log["text"])
    if log["text"] and not log["text"].endswith("\n"):
        out.write("\n")
    if log["traceback"]:
        err.write(f"== last traceback of {_what(log)} ({_stamp(log['traceback_unix'])}):\n")
        out.write(log["traceback"] + ("" if log["traceback"].endswith("\n") else "\n"))
    others = [a for a in log["available"] if not a.startswith(_what(log) + " on ")]
    if others and not follow:
        err.write("== other role logs: " + "; ".join(others[:8]) + (" ..." if len(others) > 8 else "") + "\n")
    out.flush()
    if not follow:
        return 0
    return _follow(job, log, interval_s, out, err)


def _follow(job: Any, log: dict[str, Any], interval_s: float, out: TextIO, err: TextIO) -> int:
    """Print what the role's log gains, polled from the same node, until Ctrl-C or a finished run's log is still."""
    end, rank = log["end"], log["local_rank"] if log["role"] == "worker" else None
    role = f"{log['role']}/{log['index']}"
    with ctrl_c() as stop:
        while not stop.wait(interval_s):
            try:
                finished = job.status()["state"] in _FINISHED
                new = job.logs(role, local_rank=rank, offset=end, node_id=log["node_id"])
            except UnavailableError as e:
                err.write(f"== {e}; retrying\n")
                continue
            if new["start"] < end:  # rolled over (or the role began a new file): from its tail
                err.write(f"== the log of {_what(new)} began again\n")
            out.write(new["text"])
            out.flush()
            if finished and new["end"] == end:
                return 0
            end = new["end"]
    return 130
