"""Whether a codec runs its numba kernel (`_numba_kernels`), and loading it: numba only for large tensors.

A kernel writes the same payload bytes as the torch path it replaces, so it is an optimisation
a peer cannot see. Below `MIN_NUMEL` values, or without numba, or once a kernel failed to
compile, the codecs take their torch path; `GOSSAMER_CODEC_JIT=0` turns the kernels off, and a
shard process has them only with `GOSSAMER_CODEC_JIT=1` (`kernels_unless_asked`).
numba is imported at the first large tensor, not at role-process startup. Its price, once per
process (measured here, load 2-4): the import 0.4-0.6 s, numba's initialisation at the first
kernel call 0.7-1.1 s, and 126-152 MB of resident memory; each kernel compiles once per
machine (0.5-4.5 s) into the on-disk cache under the user's cache directory, and loads from
there in about 20 ms.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

__all__ = ["MIN_NUMEL", "ENV", "PART_MIN", "available", "call", "call_parts", "set_enabled", "kernels_unless_asked"]

#: Tensors from this many values on use the kernels, so a process whose tensors are all
#: smaller (the small models of examples and tests) never imports numba. Not 2**20: the shard
#: plan cuts the flat model into near-equal chunks of at most 2**20 values (2**19 to 2**20
#: each), and a chunk is what a codec sees. On 100 chunks of 10**6 values the kernels took
#: 0.3x to 0.65x torch's time (int8 96 ms against 221), on 2**16-value ones 0.37x to 0.55x.
MIN_NUMEL = 1 << 18
ENV = "GOSSAMER_CODEC_JIT"
#: `call_parts` gives each of torch's threads at least this many values.
PART_MIN = 1 << 20

log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, Any] = {"enabled": os.environ.get(ENV, "1") != "0", "module": None, "tried": False}
_pools: dict[int, ThreadPoolExecutor] = {}
# A forked child has none of the pools' threads; a pool it inherited would never run a task.
os.register_at_fork(after_in_child=_pools.clear)


def kernels_unless_asked() -> bool:
    """Turn the kernels off in this process unless `GOSSAMER_CODEC_JIT=1` asks for them; returns the setting.

    For a process that only decodes (a shard): decoding is the cheap half (int8, 50M values, one
    thread: 46 ms with torch, 22 ms with the kernel; a shard's whole handling of a 52M-value int8
    push, 230-275 ms, did not change measurably either way), and numba would cost it about 120 MB
    resident (46 MB of heap, 74 MB of library pages) and 1-1.5 s at its first large push: on a
    104M-parameter DiLoCo run, shard hosts at 3.35x of what they hold with it, 2.65x without.
    """
    _state["enabled"] = os.environ.get(ENV) == "1"
    return bool(_state["enabled"])


def set_enabled(flag: bool) -> bool:
    """Turn the kernels on or off for this process (tests compare both paths); returns the old setting."""
    old = bool(_state["enabled"])
    _state["enabled"] = flag
    return old


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    for candidate in (Path(base) / "gossamer" / "numba", Path(tempfile.gettempdir()) / f"gossamer-numba-{os.getuid()}"):
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            if os.access(candidate, os.W_OK):
                return candidate
        except OSError:
            continue
    return Path(tempfile.mkdtemp(prefix="gossamer-numba-"))


def _load() -> ModuleType | None:
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            try:
                import numba

                if not os.environ.get("NUMBA_CACHE_DIR"):
                    # numba's default is __pycache__ beside the source, often read-only site-packages
                    setattr(numba.config, "CACHE_DIR", str(_cache_dir()))  # noqa: B010 (untyped in numba's stubs)
                from gossamer.compression import _numba_kernels
            except Exception as exc:  # ImportError, or numba refusing this numpy/CPU
                log.info("codec kernels unavailable, codecs use torch: %s", exc)
            else:
                _state["module"] = _numba_kernels
    return _state["module"]


def available(numel: int) -> bool:
    """Whether a tensor of `numel` values goes through a kernel (imports numba on first use)."""
    return numel >= MIN_NUMEL and bool(_state["enabled"]) and _load() is not None


def call(name: str, *args: Any) -> Any:
    """Run kernel `name`; None when it cannot (the caller takes its torch path). Tensors are
    passed as numpy views. A kernel that fails (to compile, say) is not tried again."""
    module = _state["module"]
    fn: Callable[..., Any] | None = None if module is None or not _state["enabled"] else getattr(module, name, None)
    if fn is None or any(isinstance(a, torch.Tensor) and not a.is_contiguous() for a in args):
        return None
    try:
        return fn(*(a.detach().numpy() if isinstance(a, torch.Tensor) else a for a in args))
    except Exception:
        log.warning("codec kernel %s failed; this process uses the torch path from now on", name, exc_info=True)
        _state["enabled"] = False
        return None


def call_parts(name: str, n: int, align: int, args_of: Callable[[int, int], tuple[Any, ...]]) -> list[Any] | None:
    """Run kernel `name` on consecutive parts [lo, hi) of n values, one per torch thread (as
    torch's own ops use them), concurrently: the kernels release the GIL. Parts start at
    multiples of `align`; `args_of(lo, hi)` gives a part's arguments. The results in order,
    or None when one part could not run (as `call`)."""
    threads = max(1, min(torch.get_num_threads(), n // PART_MIN))
    step = -(-n // threads // align) * align if threads > 1 else n
    bounds = [(lo, min(n, lo + step)) for lo in range(0, n, step)] if n else [(0, 0)]
    if len(bounds) == 1:
        result = call(name, *args_of(0, n))
        return None if result is None else [result]
    with _lock:
        pool = _pools.get(len(bounds) - 1)
        if pool is None:
            pool = _pools[len(bounds) - 1] = ThreadPoolExecutor(len(bounds) - 1, thread_name_prefix="codec-kernel")
    futures = [pool.submit(call, name, *args_of(lo, hi)) for lo, hi in bounds[1:]]
    results = [call(name, *args_of(*bounds[0])), *(f.result() for f in futures)]
    return None if any(r is None for r in results) else results
