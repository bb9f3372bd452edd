"""Not a bullet of the issue: a bug found on main while reproducing "everything leaves" (1 run in 5 there).

When nodes return to an experiment whose nodes all left, the coordinator restores the shard
on the returning on-demand node and at once starts a worker on the spot node (coordinator
core.py `_resume` calls `_grow` right after `_place_restore`). If the worker's role starts
before the restored shard serves, it fails with "ConfigError: endpoints: no endpoint for
shards [0]", is respawned at once, fails again, and after 11 role failures in about 3 s the
experiment is FAILED. Here the race is made certain: the returning shard node's role
processes start 30 s late (a sitecustomize on its PYTHONPATH sleeps in forkserver and spawned
processes only: a slow host), otherwise as `everything_leaves`.
PASS: the experiment resumes (its steps grow) within 180 s of the nodes' return.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from _common import Outcome, main
from everything_leaves import leave_and_return

NAME = "resume_before_shard_serves"
SLOW_ROLES = '''import time
try:
    _cmd = open("/proc/self/cmdline", "rb").read()
except OSError:
    _cmd = b""
if b"forkserver" in _cmd or b"spawn_main" in _cmd:  # role processes, not the node agent
    time.sleep(30)
'''


def run(label: str) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="repro15-slow-") as slow:
        (Path(slow) / "sitecustomize.py").write_text(SLOW_ROLES)
        env = {"PYTHONPATH": os.pathsep.join([slow, os.environ.get("PYTHONPATH", "")])}
        return leave_and_return(label, NAME, shard_host_env=env)


if __name__ == "__main__":
    main(NAME, run)
