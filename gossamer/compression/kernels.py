"""Whether a process runs the codecs' numba kernels: the public side of `_jit`, which owns numba."""

from __future__ import annotations

from gossamer.compression._jit import kernels_unless_asked

__all__ = ["kernels_unless_asked"]
