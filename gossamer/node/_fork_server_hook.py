"""Imported by a fork server as its last preload module: the only hook it has to run code, which installs
the handler that imports `late_imports.LATE_MODULES` when the agent asks (not imported anywhere else)."""

from __future__ import annotations

import threading

from gossamer.node import late_imports

if threading.current_thread() is threading.main_thread():
    late_imports.install()
