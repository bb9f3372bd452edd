"""Built-in workloads on real data that ships with installed packages."""

from __future__ import annotations

__all__: list[str] = []
