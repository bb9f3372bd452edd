"""The WAN bench's straggler reaches only its own host: a process in the straggler host's namespace,
started with the bench's environment, pads its training compute (F - 1)x, one in another host does not.

Needs root and `ip netns` (skipped otherwise).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from bench import _netns

WHY = _netns.unavailable_reason()
pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(WHY is not None, reason=f"network namespaces unavailable: {WHY}")]

# A few training steps of the bench's model factory, as a role process would build it (by its path).
TRAIN = """
import importlib, json, torch
mod, _, fn = "bench._straggler:mlp".partition(":")
model = getattr(importlib.import_module(mod), fn)(hidden=256, depth=2)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
for _ in range(6):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
print(json.dumps({"factor": model.factor, "padded": model.padded_s, "compute": model.compute_s,
                  "last_bwd": model._last_bwd}))
"""


def test_only_the_straggler_host_is_slowed(tmp_path: Path) -> None:
    from bench import wan

    net = _netns.Topology(2, prefix=f"{_netns.BASE_PREFIX}{os.getpid()}-s-")
    with net:
        slow = (1, 4.0)
        procs = [net.spawn(h.index, [sys.executable, "-c", TRAIN], log=tmp_path / f"h{h.index}.log",
                           env=wan._env(h.index, slow), cwd=str(tmp_path)) for h in net.hosts]
        for p in procs:
            assert p.wait(timeout=90) == 0
    assert net.leftovers() == []
    out = [json.loads((tmp_path / f"h{i}.log").read_text().strip().splitlines()[-1]) for i in range(2)]
    assert out[0]["factor"] == 1.0 and out[0]["padded"] == 0.0
    assert out[1]["factor"] == 4.0
    # every forward and every backward but the first padded by 3x its own measured time
    assert out[1]["padded"] == pytest.approx(3 * (out[1]["compute"] - out[1]["last_bwd"]), rel=1e-6)
    assert out[1]["padded"] > 0
