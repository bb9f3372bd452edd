"""Child-process check that an Experiment's user code paths (model, dataset, loss, ...) import (used by the coordinator)."""

from __future__ import annotations

import importlib
import os
import sys
from multiprocessing.connection import Connection


def resolve(path: str) -> object:
    """Return the object named by "package.module:attr"."""
    module, _, attr = path.partition(":")
    obj = getattr(importlib.import_module(module), attr, None)
    if obj is None:
        raise AttributeError(f"module {module!r} has no attribute {attr!r}")
    if not callable(obj):
        raise TypeError(f"{path!r} is not callable")
    return obj


def verdict(argv: list[str]) -> str:
    """Arguments are FIELD=PATH pairs (or bare model and dataset paths); "ok" or the first failure."""
    pairs = [a.partition("=")[::2] if "=" in a else (f, a) for f, a in zip(("model", "dataset", *argv), argv, strict=False)]
    for field, path in pairs:
        try:
            resolve(path)
        except Exception as e:  # noqa: BLE001 — any failure is the verdict
            return f"{field}: cannot import {path!r}: {type(e).__name__}: {e}"
    return "ok"


def send_verdict(argv: list[str], conn: Connection, env: dict[str, str]) -> None:
    """`verdict` sent through `conn`: the target of a check forked from a warm interpreter.

    `env` is the coordinator's environment now; its PYTHONPATH goes first on sys.path, as in
    the fresh interpreter this stands in for.
    """
    os.environ.clear()
    os.environ.update(env)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    conn.send(verdict(argv))


def main(argv: list[str]) -> int:
    """Prints the verdict (the coordinator reads stdout)."""
    print(verdict(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
