"""Child-process check that an Experiment's user code paths (model, dataset, loss, ...) import (used by the coordinator)."""

from __future__ import annotations

import importlib
import sys


def resolve(path: str) -> object:
    """Return the object named by "package.module:attr"."""
    module, _, attr = path.partition(":")
    obj = getattr(importlib.import_module(module), attr, None)
    if obj is None:
        raise AttributeError(f"module {module!r} has no attribute {attr!r}")
    if not callable(obj):
        raise TypeError(f"{path!r} is not callable")
    return obj


def main(argv: list[str]) -> int:
    """Arguments are FIELD=PATH pairs (or bare model and dataset paths); prints "ok" or the first failure."""
    pairs = [a.partition("=")[::2] if "=" in a else (f, a) for f, a in zip(("model", "dataset", *argv), argv, strict=False)]
    for field, path in pairs:
        try:
            resolve(path)
        except Exception as e:  # noqa: BLE001 — any failure is the verdict
            print(f"{field}: cannot import {path!r}: {type(e).__name__}: {e}")
            return 0
    print("ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
