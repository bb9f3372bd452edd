"""Runs the adaptive codec policy for one rank: measures compute and the link, swaps the compressor."""

from __future__ import annotations

import glob
import logging
import math
import time

import torch

from gossamer.compression.adaptive import AdaptiveConfig, AdaptivePolicy, BaseLatency, ProbeSchedule
from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.compression.codec_spec import parse_codec
from gossamer.engine.shard_plan import ShardPlan
from gossamer.paramserver.shard_client import ShardClient

log = logging.getLogger(__name__)

_CALIBRATION_NUMEL = 1 << 20


def codec_seconds_per_value(spec: str, numel: int) -> float:
    """Encode + decode seconds per value of `spec` on this machine (best of two timed runs).

    Measured on random values of the size of `numel` (at most 2**20: the per-value cost is
    flat beyond), so the policy can count a codec's time against the link it saves.
    """
    n = max(1, min(numel, _CALIBRATION_NUMEL))
    x = torch.randn(n) * 1e-3
    out = torch.empty(n)
    codec = parse_codec(spec)
    best = math.inf
    for _ in range(3):  # the first run pays for caches and allocations
        t0 = time.perf_counter()
        payload = codec.encode(x, key="calibration")
        codec.decode(payload, (n,), torch.float32, out=out)
        best = min(best, time.perf_counter() - t0)
    return best / n


class AdaptiveLink:
    """Owns the client's compressor when `compression="adaptive"`.

    Every `decide_every` steps it may probe the link (a small and a `probe_bytes` round
    trip to a shard) when its `ProbeSchedule` says so: probes take at most `probe_share` of
    the measured link, and a push that suddenly got slower brings the next one forward.
    Then the policy chooses a codec per parameter and a new compressor is installed that
    keeps the error-feedback memory.
    """

    def __init__(self, client: ShardClient, plan: ShardPlan, shapes: dict[str, tuple[int, ...]], *,
                 target_share: float = 0.2, seed: int = 0, probe_bytes: int = 128 * 1024,
                 probe_share: float = 0.02, max_probe_interval_s: float = 2.0) -> None:
        self.client = client
        self.plan = plan
        self.shapes = shapes
        self.seed = seed
        self.schedule = ProbeSchedule(probe_bytes=probe_bytes, share=probe_share,
                                      max_interval_s=max_probe_interval_s)
        tensors = {name: numel for name, numel in plan.params if numel}
        config = AdaptiveConfig(target_share=target_share)
        ratio = {}
        raw = 4 * sum(tensors.values())
        for spec in config.ladder:
            codec = parse_codec(spec)
            wire = sum(4 * n / codec.nominal_ratio(n, shapes.get(name)) for name, n in tensors.items())
            ratio[spec] = raw / wire
        biggest = max(tensors.values(), default=0)
        cost = {spec: codec_seconds_per_value(spec, biggest) for spec in config.ladder}
        self.policy = AdaptivePolicy(tensors, ratio, config, cost)
        self.latency_s = 0.0
        self.base_latency = BaseLatency()
        self.changes = 0
        self._install()

    def _install(self) -> None:
        overrides = [(glob.escape(name), spec) for name, spec in self.policy.choices().items() if spec != "none"]
        new = ChunkCompressor("none", self.plan, error_feedback=True, overrides=overrides,
                              shapes=self.shapes, seed=self.seed)
        old = self.client.compressor
        if old is not None:  # keep residuals, so nothing a lossy codec dropped is lost
            new.feedback = old.feedback
            new.momentum = old.momentum
            new.raw_bytes, new.wire_bytes = old.raw_bytes, old.wire_bytes
            new.encode_seconds, new.decode_seconds = old.encode_seconds, old.decode_seconds
        self.client.compressor = new

    def after_step(self, compute_s: float, sent_bytes: int = 0, exchange_s: float = 0.0) -> None:
        """Account one step: its compute time and, when known, its push (bytes, round trip)."""
        self.policy.observe_step(compute_s)
        if sent_bytes >= 32 * 1024 and exchange_s > self.latency_s:
            self.schedule.observe_push(sent_bytes, exchange_s - self.latency_s)
        if not self.policy.due():
            return
        now = time.monotonic()
        if self.schedule.due(self.policy.bandwidth_bps, now):
            # A probe that a fast link carries in under 20 ms is repeated, the least trip kept: a
            # few ms of scheduling stall (a loaded machine) would otherwise read as a slow link.
            bw = self.policy.bandwidth_bps
            quick = bw is None or self.schedule.probe_bytes / bw < 0.02
            bare_s, padded_s = self.client.probe(self.schedule.probe_bytes, repeats=3 if quick else 1)
            self.schedule.probed(now, took_s=time.monotonic() - now)
            self.latency_s = self.base_latency.observe(bare_s, now)
            # 0 s (the padded trip no slower than the latency: too fast to resolve) is skipped.
            self.policy.observe_transfer(self.schedule.probe_bytes, max(0.0, padded_s - self.latency_s), now)
            # A suspected drop is confirmed or dismissed by the very next decision's probe.
            self.schedule.urgent = self.policy.drop_pending is not None
        if self.policy.decide():
            self.changes += 1
            self._install()
            log.info("adaptive codecs (%.3g MB/s, compute %.2f ms): %s",
                     (self.policy.bandwidth_bps or 0) / 1e6, 1e3 * (self.policy.compute_s or 0),
                     self.policy.choices())

    def metrics(self) -> dict[str, float]:
        out = {
            "adaptive_level": self.policy.mean_level(),
            "adaptive_bandwidth_bps": float(self.policy.bandwidth_bps or 0.0),
            "adaptive_changes": float(self.changes),
            "link_latency_s": self.latency_s,
            "adaptive_probes": float(self.schedule.probes),
        }
        for name in self.policy.tensors:
            out[f"codec_level.{name}"] = float(self.policy.level[name])
        return out
