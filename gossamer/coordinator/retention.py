"""Bounded coordinator state: old metric points downsampled; old events, finished experiments and lost nodes pruned."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gossamer.v1 import coordinator_pb2 as pb

if TYPE_CHECKING:
    from gossamer.coordinator.core import Coordinator

log = logging.getLogger(__name__)

#: Seconds between housekeeping passes (shorter when a retention period is shorter).
INTERVAL_S = 60.0
_GONE = (pb.NODE_STATE_LOST, pb.NODE_STATE_LEFT)


@dataclass(frozen=True)
class Swept:
    """What one pass removed."""

    metric_rows_merged: int
    experiments: int
    nodes: int


async def housekeep(coord: Coordinator, now: float | None = None) -> Swept:
    """One pass over the coordinator's state by its config's retention periods (0: keep)."""
    cfg = coord.config
    now = time.time() if now is None else now
    merged = 0
    if cfg.metrics_retention_s:
        merged = await coord.store.downsample_metrics(now - cfg.metrics_retention_s, cfg.metrics_bucket_s)
    exps = [e.id for e in coord.exps.values()
            if cfg.finished_retention_s and not e.active and e.finished_unix
            and now - e.finished_unix > cfg.finished_retention_s]
    nodes = [n.id for n in coord.nodes.values()
             if cfg.lost_node_retention_s and n.state in _GONE and now - n.last_seen > cfg.lost_node_retention_s]
    events_before = now - cfg.event_retention_s if cfg.event_retention_s else 0.0
    for exp_id in exps:  # forgotten before the store's await, so nothing saves them again meanwhile
        coord.exps.pop(exp_id, None)
        coord.step_rates.forget(exp_id)
    for node_id in nodes:
        coord.nodes.pop(node_id, None)
    await coord.store.prune(events_before, exps, nodes)
    if merged or exps or nodes:
        log.info("retention: merged %d old metric points, forgot %d finished experiment(s) and %d lost node(s)",
                 merged, len(exps), len(nodes))
    return Swept(merged, len(exps), len(nodes))


def interval(coord: Coordinator) -> float:
    """Seconds between passes: INTERVAL_S, or a tenth of the shortest retention period."""
    cfg = coord.config
    periods = [p for p in (cfg.metrics_retention_s, cfg.event_retention_s, cfg.finished_retention_s,
                           cfg.lost_node_retention_s) if p]
    return max(0.05, min([INTERVAL_S, *(p / 10 for p in periods)]))


async def keep_bounded(coord: Coordinator) -> None:
    """Run `housekeep` every `interval` seconds until cancelled; a failed pass is logged, not fatal."""
    while True:
        await asyncio.sleep(interval(coord))
        try:
            await housekeep(coord)
        except Exception:  # noqa: BLE001 — the coordinator must outlive a bad pass
            log.exception("retention pass")
