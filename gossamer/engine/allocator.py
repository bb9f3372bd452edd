"""How role processes allocate host memory: large buffers by mmap, handed back to the OS when freed."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["mmap_large_allocations"]


def mmap_large_allocations(threshold: int = 1 << 20) -> None:
    """Have glibc serve allocations >= `threshold` bytes by mmap, so freed ones go back to the OS at once.

    glibc raises its mmap threshold to the size of each mmapped block freed (up to 32 MiB), so
    after the first few, the buffers a role allocates and frees every step (gradients, the
    frames of every push and reply, FSDP's gathered layers) come from the heap arenas of
    whichever thread allocated them (libzmq's I/O thread, torch's) and stay resident there.
    FSDP on CPU grew past ddp's resident memory that way (bench/intranode.py: 989 MB per rank
    against ddp's 756; 0.51x of ddp with the threshold fixed), and a 415 MB model's shards and
    workers held several freed copies (bench/scale_model.py). GPUs use CUDA's caching allocator.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD (fixed: no more adaptive raising)
    except (OSError, AttributeError):  # not glibc (musl): nothing to tune
        pass
