"""The coordinator's membership: nodes join, heartbeat and leave; the ones whose lease ran out are declared lost."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid

from gossamer.coordinator import failover
from gossamer.coordinator.beat_rate import BeatRate, renew
from gossamer.coordinator.blind_time import BlindTime
from gossamer.coordinator.records import NodeRec, check_node_id, checkpoint_server
from gossamer.coordinator.recovery import Recovery
from gossamer.coordinator.scheduling import Scheduler
from gossamer.coordinator.state import CoordinatorState
from gossamer.core.errors import ConfigError, NotFoundError
from gossamer.core.faults import hold_at
from gossamer.v1 import coordinator_pb2 as pb

log = logging.getLogger(__name__)


class Membership:
    """Nodes and their leases; a node that goes hands its experiment's roles to `Recovery`."""

    def __init__(self, state: CoordinatorState, recovery: Recovery, scheduler: Scheduler) -> None:
        config = state.config
        self.state, self.recovery, self.scheduler = state, recovery, scheduler
        self.beat_rate = BeatRate(interval_s=config.heartbeat_interval_s, window_s=config.lease_timeout_s)
        self._behind = False
        self.blind = BlindTime(tick_s=min(0.5, config.heartbeat_interval_s), keep_s=2 * config.lease_timeout_s + 1,
                               start=time.time())

    async def join(self, req: pb.JoinRequest) -> pb.JoinResponse:
        hold_at("join")  # a stalled coordinator that serves a Join after its sender gave up on it (tests)
        now = time.time()
        curve_key = _curve_key(req, self.state.curve)
        node = self.state.nodes.get(check_node_id(req.node_id)) if req.node_id else None
        if node is not None and node.alive:
            node.last_seen = now
            node.curve_key = curve_key  # the same key after a coordinator restart; assignments follow a new one
            node.checkpoint_endpoint, node.checkpoint_secret, node.checkpoint_key = checkpoint_server(req)
            kind, what = "rejoin", f"node {node.name} re-attached"
        else:
            node = NodeRec.from_join(req, req.node_id or uuid.uuid4().hex[:12], now, curve_key)
            self.state.nodes[node.id] = node
            kind, what = "join", f"node {node.name} joined ({'spot' if node.spot else 'on-demand'})"
        # One transaction, shared with the joins that arrive meanwhile (group_commit.py); answered once committed.
        await asyncio.gather(self.state.store.add_event(kind, what, node_id=node.id), self.state.store.save_node(node))
        await self.scheduler.reconcile(changed=kind == "rejoin")  # a new node is in no one's assignments; a re-attach may be
        return pb.JoinResponse(
            node_id=node.id,
            heartbeat_interval_s=self.state.config.heartbeat_interval_s,
            lease_timeout_s=self.state.config.lease_timeout_s,
            curve=self.state.curve,
        )

    async def heartbeat(self, node_id: str) -> bool:
        return renew(self.state.nodes.get(node_id), self.beat_rate)  # UDP beats renew the same way (udp_beats.py)

    async def leave(self, node_id: str, reason: str) -> None:
        node = self.state.nodes.get(node_id)
        if node is None:
            raise NotFoundError(f"node {node_id} is not known")
        if not node.alive:
            return
        await self._remove_node(node, pb.NODE_STATE_LEFT, f"left: {reason or 'no reason given'}")

    def stream_changed(self, node_id: str, *, is_open: bool) -> None:
        """A node's assignment stream opened or closed (a closed one is evidence for the reaper)."""
        streams = self.state.streams
        (streams.opened if is_open else streams.closed)(node_id)
        node = self.state.nodes.get(node_id)
        if node is not None and (is_open or node.alive):
            node.stream_lost_at = 0.0 if is_open else time.time()

    async def reap_leases(self, lag_s: float = 0.0, *, sweep: bool = False) -> None:
        """Declare nodes lost whose lease expired or whose stream dropped with no heartbeat since.

        While the coordinator is starved or backlogged (`BeatRate.behind`; `lag_s`: how late
        this tick is), no lease expires: the silence is its own. A closed stream still counts at
        once; a node cut off without its connection closing is caught once keepalive closes it.
        """
        now = time.time()
        config = self.state.config
        if sweep and (late := self.blind.sweep(now)) >= 0.5 * config.lease_timeout_s:
            log.warning("lease sweep %.1fs late (the coordinator was not scheduled): not counted against leases", late)
        lease = config.lease_timeout_s
        connected, suspects = failover.lease_suspects(self.state.nodes.values(), now=now, lease_timeout_s=lease,
                                                      is_open=self.state.streams.is_open)
        behind = self.beat_rate.behind(now, connected, lag_s)
        if behind != self._behind:
            self._behind = behind
            log.warning("coordinator %s", "behind its heartbeats: leases held"
                        if behind else "caught up with its heartbeats: leases expire again")
        for node in suspects:
            verdict = failover.lease_verdict(node, now=now, lease_timeout_s=math.inf if behind else lease,
                                             heartbeat_interval_s=config.heartbeat_interval_s,
                                             blind_since=self.blind.since)
            if verdict is not None:
                why, silent = verdict
                await self._remove_node(node, pb.NODE_STATE_LOST, why, silent)

    async def _remove_node(self, node: NodeRec, state: pb.NodeState.ValueType, why: str,
                           detect_s: float | None = None) -> None:
        node.state = state
        exp_id, node.experiment_id = node.experiment_id, ""
        kind = "lost" if state == pb.NODE_STATE_LOST else "leave"
        # Saved before any other await: retention may forget the node meanwhile, and a save after
        # its delete (the store runs them in order) brought a forgotten node back at the next start.
        await self.state.store.save_node(node)
        await self.state.store.add_event(kind, f"node {node.name} {why}", experiment_id=exp_id, node_id=node.id)
        exp = self.state.exps.get(exp_id)
        if exp is not None and exp.active:
            figures = {"nodes_lost" if kind == "lost" else "nodes_left": 1.0}
            if detect_s is not None:
                figures["detect_s"] = detect_s
            await self.state.recovery_metric(exp, figures)
            await self.recovery.node_gone(exp, node)
        await self.scheduler.reconcile(changed=exp is not None and exp.active)  # a node without roles changes no stream's


def _curve_key(req: pb.JoinRequest, curve: bool) -> str:
    """The joining node's public CURVE key ("" when the data plane runs without CURVE)."""
    if not curve:
        return ""
    if not req.curve_public_key:
        raise ConfigError("curve_public_key", "this coordinator runs the data plane with CurveZMQ (--curve) "
                          "and the node sent no CURVE public key: upgrade gossamer on the node")
    from gossamer.security.curve import check_public_key

    return check_public_key(req.curve_public_key)
