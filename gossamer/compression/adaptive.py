"""`compression="adaptive"`: per tensor, the least lossy codec that keeps transfer time under a share of compute."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from gossamer.core.errors import ConfigError

#: From exact to most aggressive; each step costs some accuracy and saves bytes.
LADDER: tuple[str, ...] = ("none", "bf16", "int8", "topk:0.1", "topk:0.01", "topk:0.001")


@dataclass(frozen=True, kw_only=True)
class AdaptiveConfig:
    """Knobs of the adaptive policy.

    `target_share`: transfer time allowed per step, as a share of compute time (0.2 = 20%).
    Transfer time is bytes / bandwidth; the fixed round-trip latency is measured apart and
    not counted, since no codec can shorten it.
    """

    target_share: float = 0.2
    ladder: tuple[str, ...] = LADDER
    decide_every: int = 5
    smoothing: float = 0.5  # EWMA weight of the newest compute-time measurement
    hysteresis: float = 0.7  # go less lossy only if the prediction is under this share of budget
    bandwidth_window_s: float = 3.0  # bandwidth = the best sample of this window (see observe_transfer)
    drop_factor: float = 0.1  # a sample this far under the estimate is a real drop, not noise

    def __post_init__(self) -> None:
        if not 0 < self.target_share <= 10:
            raise ConfigError("target_share", "must be in (0, 10]")
        if len(self.ladder) < 2:
            raise ConfigError("ladder", "needs at least two codecs")
        if self.decide_every < 1:
            raise ConfigError("decide_every", "must be >= 1")
        if not 0 < self.smoothing <= 1 or not 0 < self.hysteresis <= 1:
            raise ConfigError("smoothing", "smoothing and hysteresis must be in (0, 1]")


class AdaptivePolicy:
    """Chooses a codec per tensor from measured compute time and link bandwidth.

    Feed it `observe_step(compute_s)` every step and `observe_transfer(nbytes, seconds)`
    whenever a transfer's pure transmission time is known (a bandwidth probe: a padded
    round trip minus a bare one; see `ProbeSchedule` for why pushes are not samples).
    `decide()` re-plans every `decide_every` steps: all tensors start at the least lossy
    codec and the tensor with the most bytes moves one step down the ladder until the
    predicted transfer time fits the budget.

    A codec's own time counts against the link it saves: with `cost` (codec spec -> encode
    plus decode seconds per value, measured on this machine) a tensor's predicted cost is
    its wire bytes plus its codec time times the bandwidth, in bytes of the link. A codec
    whose time alone exceeds sending the raw fp32 value (cost * bandwidth >= 4 bytes) is
    skipped: on a fast link top-k's selection takes longer than sending everything.
    """

    def __init__(
        self,
        tensors: dict[str, int],
        ratio: dict[str, float],
        config: AdaptiveConfig | None = None,
        cost: dict[str, float] | None = None,
    ) -> None:
        """`tensors`: name -> numel; `ratio`: codec spec -> nominal compression ratio;
        `cost`: codec spec -> measured encode + decode seconds per value (default none)."""
        self.config = config or AdaptiveConfig()
        missing = [c for c in self.config.ladder if c not in ratio]
        if missing:
            raise ConfigError("ladder", f"no nominal ratio for {missing}")
        self.tensors = dict(tensors)
        self.ratio = ratio
        self.cost = {spec: 0.0 for spec in self.config.ladder} | dict(cost or {})
        self.level = {name: 0 for name in self.tensors}
        self.compute_s: float | None = None
        self.bandwidth_bps: float | None = None
        self._samples: list[tuple[float, float]] = []  # (time, bytes/s)
        self.drop_pending: tuple[float, float] | None = None  # a low sample awaiting confirmation
        self._steps = 0
        self.decisions = 0

    def _ewma(self, old: float | None, new: float) -> float:
        a = self.config.smoothing
        return new if old is None else a * new + (1 - a) * old

    def observe_step(self, compute_s: float) -> None:
        if compute_s > 0 and math.isfinite(compute_s):
            self.compute_s = self._ewma(self.compute_s, compute_s)
        self._steps += 1

    def observe_transfer(self, nbytes: int, seconds: float, now: float | None = None) -> None:
        """A transfer of `nbytes` took `seconds` beyond the round-trip latency.

        Noise (scheduling, other traffic) only ever makes a transfer look slower, so the
        estimate is the best rate seen in the last `bandwidth_window_s` (a max filter, as
        BBR does). A sample under `drop_factor` of the estimate is either a real drop (a
        throttled or shared link) or a stall of the measuring process: it is held as
        `drop_pending` and changes nothing until the next sample. If that one is low too,
        the drop is real and the window restarts from the two; otherwise the outlier is
        forgotten. One noisy probe on a loaded machine (a 5 ms stall on a 0.2 ms transfer)
        used to flip every codec to top-k until the next probe.
        """
        if nbytes <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        now = time.monotonic() if now is None else now
        rate = nbytes / seconds
        horizon = now - self.config.bandwidth_window_s
        if self.bandwidth_bps is not None and rate < self.config.drop_factor * self.bandwidth_bps:
            if self.drop_pending is None:
                self.drop_pending = (now, rate)
                return
            self._samples = [self.drop_pending]
            horizon = -math.inf
        self.drop_pending = None
        self._samples = [(t, r) for t, r in self._samples if t >= horizon] + [(now, rate)]
        self.bandwidth_bps = max(r for _, r in self._samples)

    def codec(self, name: str) -> str:
        return self.config.ladder[self.level[name]]

    def choices(self) -> dict[str, str]:
        return {name: self.codec(name) for name in self.tensors}

    def predicted_bytes(self, levels: dict[str, int]) -> float:
        """Wire bytes per step, plus the codecs' time as bytes the link could have sent."""
        return sum(self._tensor_bytes(name, levels[name]) for name in self.tensors)

    def _tensor_bytes(self, name: str, level: int) -> float:
        spec = self.config.ladder[level]
        n = self.tensors[name]
        return 4 * n / self.ratio[spec] + self.cost[spec] * n * (self.bandwidth_bps or 0.0)

    def worth_it(self, spec: str) -> bool:
        """Whether `spec`'s own time per value is under the time of sending the value raw."""
        return self.cost[spec] * (self.bandwidth_bps or 0.0) < 4.0

    def due(self) -> bool:
        return self._steps > 0 and self._steps % self.config.decide_every == 0

    def decide(self) -> bool:
        """Re-plan the codecs; True when any choice changed."""
        if self.compute_s is None or self.bandwidth_bps is None:
            return False
        budget = self.config.target_share * self.compute_s * self.bandwidth_bps  # bytes per step
        levels = self._plan(budget)
        # Hysteresis: a tensor goes more lossy as soon as the budget needs it, but less lossy
        # only as far as the plan for a tighter budget (`hysteresis` of it) allows, so a noisy
        # measurement does not flip codecs back and forth. Each tensor relaxes on its own: an
        # all-or-nothing rule kept every tensor at the top of the ladder after a throttle was
        # lifted whenever the exact plan sat just over the tighter budget.
        tight = self._plan(self.config.hysteresis * budget)
        levels = {n: max(levels[n], min(self.level[n], tight[n])) for n in levels}
        changed = levels != self.level
        self.level = levels
        self.decisions += 1
        return changed

    def _plan(self, budget: float) -> dict[str, int]:
        """Least lossy levels whose predicted bytes fit `budget`: the biggest tensor moves first."""
        top = len(self.config.ladder) - 1
        levels = {name: 0 for name in self.tensors}
        ladder = self.config.ladder
        usable = [lv for lv in range(1, top + 1) if self.worth_it(ladder[lv])]
        while self.predicted_bytes(levels) > budget:
            movable = [n for n in self.tensors if any(lv > levels[n] for lv in usable)]
            if not movable:
                break
            worst = max(movable, key=lambda n: (self._tensor_bytes(n, levels[n]), n))
            levels[worst] = min(lv for lv in usable if lv > levels[worst])
        return levels

    def mean_level(self) -> float:
        total = sum(self.tensors.values()) or 1
        return sum(self.level[n] * k for n, k in self.tensors.items()) / total


@dataclass(kw_only=True)
class BaseLatency:
    """The link's round-trip latency without payload: the least bare round trip of `window_s`.

    A probe's transmission time is its padded round trip minus this. Subtracting the bare
    trip measured just before it instead made the noise two-sided: a bare trip that hit a
    stall left a padded one that looked almost free, read as 20-90 GB/s on loopback, and the
    bandwidth estimate (a max filter) kept the outlier. Noise only ever lengthens a trip, so
    the least one is the latency (as BBR's min_rtt); the window lets a real rise show.
    """

    window_s: float = 10.0
    _samples: deque[tuple[float, float]] = field(default_factory=deque)

    def observe(self, seconds: float, now: float) -> float:
        """Add a bare round trip measured at `now`; returns the latency estimate."""
        if seconds >= 0 and math.isfinite(seconds):
            self._samples.append((now, seconds))
        while len(self._samples) > 1 and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        return min((s for _, s in self._samples), default=0.0)


@dataclass(kw_only=True)
class ProbeSchedule:
    """When to spend bytes measuring the link: probing costs at most `share` of its capacity
    and at most `share` of the worker's time.

    A probe of `probe_bytes` is due once `probe_bytes / (share * bandwidth)` seconds have
    passed since the last one, and at least `took / share` (the last probe's own duration),
    capped at `max_interval_s`: on a fast link that is a few times a second, so a sudden
    throttle shows within a few steps; on a slow link it is rare, so probing does not eat
    the bytes it is meant to save. (Bytes alone made a fast link probe at every decision:
    two to six round trips every 5 steps of a small model.) A big push much slower per byte than
    the pushes since the last probe hints that the link changed and makes a probe due at once.
    Pushes are only hints, never bandwidth samples: their time includes the shard's decode
    and apply and the reply's download, which read 10-40x under the link's rate on a loaded
    machine.
    """

    probe_bytes: int
    share: float = 0.02
    max_interval_s: float = 2.0
    slowdown: float = 4.0
    last: float = -math.inf
    took: float = 0.0  # seconds the last probe took
    urgent: bool = False
    probes: int = 0
    _costs: deque[float] = field(default_factory=lambda: deque(maxlen=16))

    def __post_init__(self) -> None:
        if self.probe_bytes <= 0 or not 0 < self.share <= 1 or self.max_interval_s <= 0 or self.slowdown <= 1:
            raise ConfigError("probe", "probe_bytes > 0, share in (0, 1], max_interval_s > 0, slowdown > 1")

    def interval(self, bandwidth_bps: float | None) -> float:
        if not bandwidth_bps:
            return 0.0
        return min(self.max_interval_s, max(self.probe_bytes / (self.share * bandwidth_bps), self.took / self.share))

    def due(self, bandwidth_bps: float | None, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return self.urgent or now - self.last >= self.interval(bandwidth_bps)

    def probed(self, now: float | None = None, took_s: float = 0.0) -> None:
        """A probe started at `now` and took `took_s` seconds."""
        self.last = time.monotonic() if now is None else now
        self.took = max(0.0, took_s)
        self.probes += 1
        self.urgent = False
        self._costs.clear()

    def observe_push(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        cost = seconds / nbytes
        if self._costs and cost > self.slowdown * min(self._costs):
            self.urgent = True
        self._costs.append(cost)
