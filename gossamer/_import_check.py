"""Child-process check that an Experiment's model and dataset paths import (used by the coordinator)."""

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
    for field, path in zip(("model", "dataset"), argv, strict=False):
        try:
            resolve(path)
        except Exception as e:  # noqa: BLE001 — any failure is the verdict
            print(f"{field}: cannot import {path!r}: {type(e).__name__}: {e}")
            return 0
    print("ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
