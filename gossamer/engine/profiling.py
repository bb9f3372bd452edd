"""The `profile_steps` experiment option: a torch.profiler trace of N steps of a rank and the split of its step time."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from gossamer.core.experiment import Experiment

log = logging.getLogger(__name__)

#: Regions of a step, as named in the trace (`record_function`) and in summary.json.
#: compute: forward, backward and the all-reduce inside the node; compression: encode and
#: decode of what crosses nodes; communication: push/pull/gossip round trips and waits,
#: less the compression inside them. Everything else in the window is "other".
REGIONS = ("compute", "compression", "communication")
_NULL = contextlib.nullcontext()


def profiles_node(exp: Experiment, node_id: str, node_name: str) -> bool:
    """Whether this node records a profile: `profile_steps` > 0 and the node is named in
    `profile_nodes` (by name or id), or that list is empty (every worker)."""
    if exp.profile_steps <= 0:
        return False
    return not exp.profile_nodes or node_id in exp.profile_nodes or (bool(node_name) and node_name in exp.profile_nodes)


def profile_dir(checkpoint_dir: str | Path, experiment_id: str, node: str, local_rank: int) -> Path:
    """Where a rank's trace.json.gz and summary.json go: next to the experiment's checkpoints."""
    return Path(checkpoint_dir) / experiment_id / "profile" / node / f"rank{local_rank}"


class StepProfiler:
    """Records `profile_steps` steps of one local rank, starting at its step `profile_start`.

    The trainer marks step boundaries with `step(clock)` and wraps the parts of a step in
    `region(name)`; `watch` times methods of other objects (codecs) as a region. Outside the
    window every call is a no-op. Region times are exclusive (compression inside a push
    counts as compression, not communication) and measured on the training thread only.
    """

    def __init__(self, exp: Experiment, *, experiment_id: str, node_id: str, node_name: str, local_rank: int,
                 device: torch.device, checkpoint_dir: str, on_metrics: Callable[[int, dict[str, float]], None]) -> None:
        self.enabled = profiles_node(exp, node_id, node_name)
        self.exp = exp
        self.experiment_id = experiment_id
        self.node_id = node_id
        self.node = node_name or node_id
        self.local_rank = local_rank
        self.device = device
        self.out_dir = profile_dir(checkpoint_dir, experiment_id, self.node, local_rank)
        self.on_metrics = on_metrics
        self.active = False
        self.done = False
        self.summary: dict[str, Any] | None = None
        self._prof: profile | None = None
        self._owner = 0
        self._first = 0
        self._t0 = 0.0
        self._seconds = dict.fromkeys(REGIONS, 0.0)
        self._stack: list[list[float]] = []  # [start, child seconds] of the open regions
        self._watched: list[tuple[Any, str, str]] = []
        self._patched: list[tuple[Any, str, bool, Any]] = []

    # --- instrumentation -------------------------------------------------------------------
    def region(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time a part of the step as `name` (one of REGIONS) while the window is open."""
        if not self.active or threading.get_ident() != self._owner:
            return _NULL
        return self._region(name)

    @contextlib.contextmanager
    def _region(self, name: str) -> Iterator[None]:
        frame = [time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            with record_function(name):
                yield
                if self.device.type == "cuda":  # attribute queued kernels to the region that launched them
                    torch.cuda.synchronize(self.device)
        finally:
            self._stack.pop()
            spent = time.perf_counter() - frame[0]
            self._seconds[name] += spent - frame[1]
            if self._stack:
                self._stack[-1][1] += spent

    def watch(self, obj: Any, *methods: str, region: str = "compression") -> None:
        """While the window is open, calls of `obj.<method>` count as `region` (obj may be None)."""
        if obj is not None and self.enabled:
            self._watched.extend((obj, m, region) for m in methods)

    def _patch(self) -> None:
        for obj, name, region in self._watched:
            own = name in vars(obj)
            original = getattr(obj, name)
            setattr(obj, name, self._timed(original, region))
            self._patched.append((obj, name, own, original))

    def _timed(self, f: Callable[..., Any], region: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.region(region):
                return f(*args, **kwargs)

        return timed

    def _unpatch(self) -> None:
        for obj, name, own, original in reversed(self._patched):
            if own:
                setattr(obj, name, original)
            else:
                delattr(obj, name)
        self._patched = []

    # --- the window ------------------------------------------------------------------------
    def step(self, clock: int) -> None:
        """Call before every step with the rank's step count: opens and closes the window."""
        if not self.enabled or self.done:
            return
        if not self.active and clock >= self.exp.profile_start:
            self._start(clock)
        elif self.active and clock >= self._first + self.exp.profile_steps:
            self._stop(clock)

    def close(self, clock: int) -> None:
        """The run ended: export what the window holds if it is still open."""
        if self.active:
            log.info("run ended inside the profiling window: %d of %d steps recorded",
                     clock - self._first, self.exp.profile_steps)
            self._stop(clock)
        elif self.enabled and not self.done:
            log.info("profiling: this rank never reached step %d (profile_start); nothing recorded",
                     self.exp.profile_start)

    def _start(self, clock: int) -> None:
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=activities)
        self._prof.start()
        self._owner = threading.get_ident()
        self._first = clock
        self._seconds = dict.fromkeys(REGIONS, 0.0)
        self._patch()
        self.active = True
        log.info("profiling %d steps from step %d into %s", self.exp.profile_steps, clock, self.out_dir)
        self._t0 = time.perf_counter()

    def _stop(self, clock: int) -> None:
        wall = time.perf_counter() - self._t0
        self.active = False
        self.done = True
        self._unpatch()
        assert self._prof is not None
        self._prof.stop()
        steps = clock - self._first
        seconds = {**self._seconds, "other": max(0.0, wall - sum(self._seconds.values()))}
        fractions = {k: v / wall if wall > 0 else 0.0 for k, v in seconds.items()}
        self.summary = {
            "experiment_id": self.experiment_id, "node": self.node, "node_id": self.node_id,
            "local_rank": self.local_rank, "mode": self.exp.mode, "compression": self.exp.compression,
            "device": str(self.device), "first_step": self._first, "steps": steps, "wall_s": wall,
            "step_s": wall / max(1, steps), "seconds": seconds, "fractions": fractions,
            "trace": "trace.json.gz", "torch": torch.__version__,
        }
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._prof.export_chrome_trace(str(self.out_dir / "trace.json.gz"))
            tmp = self.out_dir / "summary.json.tmp"
            tmp.write_text(json.dumps(self.summary, indent=1))
            tmp.replace(self.out_dir / "summary.json")
        except (OSError, RuntimeError) as e:
            log.warning("profile of %d steps not written to %s: %s", steps, self.out_dir, e)
        self._prof = None
        log.info("profile of steps %d-%d: %s", self._first, clock,
                 ", ".join(f"{k} {100 * v:.1f}%" for k, v in fractions.items()))
        tag = self.node if self.local_rank == 0 else f"{self.node}.{self.local_rank}"
        values = {f"profile_step_s.{tag}": wall / max(1, steps), f"profile_steps.{tag}": float(steps)}
        values.update({f"profile_{k}_frac.{tag}": v for k, v in fractions.items()})
        self.on_metrics(clock, values)
