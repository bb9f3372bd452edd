"""Typed contracts between gossamer's processes: role specs, assignment updates, data-plane op metadata."""

from __future__ import annotations

# Each contract is a frozen dataclass, validated where it is decoded (`from_*` raises
# ProtocolError or ConfigError naming the field), so no process reads another's bare dict keys.

# ---------------------------------------------------------------------------------------
# Node agent -> role processes (RoleSpec, AssignmentUpdate)
# ---------------------------------------------------------------------------------------

# (section owned by the worker refactor)


# ---------------------------------------------------------------------------------------
# Data plane: metadata of each op's header (PUSH, PULL, HELLO, ...)
# ---------------------------------------------------------------------------------------

# (section owned by the parameter-server refactor)
