"""Prometheus collector over the coordinator's live state: experiments, nodes, stragglers, recoveries."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from gossamer.coordinator.records import ExpRec, NodeRec
from gossamer.coordinator.stragglers import worker_speeds
from gossamer.core.metric_families import Rows, counter, gauge, histogram_buckets, sum_buckets
from gossamer.v1 import coordinator_pb2 as pb

if TYPE_CHECKING:
    from gossamer.coordinator.core import Coordinator

#: A finished experiment stays on /metrics this long (its counters' last values).
KEEP_FINISHED_S = 3600.0


def state_label(state: int) -> str:
    return pb.ExperimentState.Name(pb.ExperimentState.ValueType(state)).removeprefix("EXPERIMENT_STATE_").lower()


def node_state_label(state: int) -> str:
    return pb.NodeState.Name(pb.NodeState.ValueType(state)).removeprefix("NODE_STATE_").lower()


def role_label(role: int) -> str:
    names: dict[int, str] = {pb.ROLE_PARAMETER_SERVER: "ps", pb.ROLE_WORKER: "worker"}
    return names.get(int(role), "")


class CoordinatorCollector:
    """Reads the coordinator at scrape time; nothing is copied or kept between scrapes."""

    def __init__(self, coord: Coordinator) -> None:
        self.c = coord

    def registry(self) -> CollectorRegistry:
        reg = CollectorRegistry(auto_describe=False)
        reg.register(self)  # type: ignore[arg-type]
        return reg

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        now = time.time()
        exps = [e for e in sorted(self.c.exps.values(), key=lambda e: e.seq)
                if e.active or now - e.finished_unix < KEEP_FINISHED_S]
        yield from self._nodes(now)
        yield from self._experiments(exps)
        yield from self._per_node(exps, now)
        yield from self._grpc()

    # --- nodes -------------------------------------------------------------------------
    def _nodes(self, now: float) -> Iterator[Metric]:
        nodes = sorted(self.c.nodes.values(), key=lambda n: n.joined_unix)
        by_state: dict[str, float] = {node_state_label(s): 0.0 for s in pb.NodeState.values()
                                      if s != pb.NODE_STATE_UNSPECIFIED}
        for n in nodes:
            by_state[node_state_label(n.state)] = by_state.get(node_state_label(n.state), 0.0) + 1
        yield gauge("gossamer_nodes", "Known nodes by state.", ["state"], [([k], v) for k, v in by_state.items()])
        alive = [n for n in nodes if n.alive]
        yield gauge("gossamer_node_info", "A live node (value 1), its role and experiment.",
                    ["node", "node_id", "address", "state", "role", "experiment", "spot"],
                    [([n.name, n.id, n.address, node_state_label(n.state), self._role_of(n), n.experiment_id,
                       "true" if n.spot else "false"], 1.0) for n in alive])
        yield gauge("gossamer_node_lease_age_seconds", "Seconds since the node's last heartbeat.", ["node"],
                    [([n.name], max(0.0, now - n.last_seen)) for n in alive])

    def _role_of(self, n: NodeRec) -> str:
        exp = self.c.exps.get(n.experiment_id)
        mine = [r.role for r in exp.roles if r.node_id == n.id] if exp is not None else []
        return "+".join(sorted({role_label(r) for r in mine}))

    # --- experiments -------------------------------------------------------------------
    def _experiments(self, exps: list[ExpRec]) -> Iterator[Metric]:
        lab = ["experiment"]
        totals = {e.id: e.totals() for e in exps}

        def rows(key: str) -> Rows:
            return [([e.id], totals[e.id][key]) for e in exps if key in totals[e.id]]

        yield gauge("gossamer_experiment_info", "An experiment (value 1): name, mode, state.",
                    ["experiment", "name", "mode", "state"],
                    [([e.id, e.name, str(e.spec.get("mode", "")), state_label(e.state)], 1.0) for e in exps])
        yield counter("gossamer_experiment_steps", "Global steps done (parameter versions applied).", lab,
                      [([e.id], float(e.steps)) for e in exps])
        yield gauge("gossamer_experiment_target_steps", "The experiment's total_steps.", lab,
                    [([e.id], float(e.spec.get("total_steps", 0))) for e in exps])
        yield gauge("gossamer_experiment_generation", "Membership generation (bumped by every join or loss).", lab,
                    [([e.id], float(e.generation)) for e in exps])
        yield gauge("gossamer_experiment_workers", "Workers currently assigned.", lab,
                    [([e.id], float(len(e.roles_of(pb.ROLE_WORKER)))) for e in exps])
        yield counter("gossamer_experiment_samples", "Samples trained on, all workers.", lab, rows("samples"))
        yield gauge("gossamer_experiment_samples_per_second", "Training throughput, all workers.", lab,
                    rows("samples_per_s"))
        yield gauge("gossamer_experiment_loss", "Latest training loss.", lab, rows("loss"))
        yield gauge("gossamer_experiment_eval_accuracy", "Latest evaluation accuracy.", lab, rows("eval_accuracy"))
        yield gauge("gossamer_experiment_eval_loss", "Latest evaluation loss.", lab, rows("eval_loss"))
        yield gauge("gossamer_experiment_eval", "Latest evaluation figures by name (eval_<metric>: loss, accuracy, "
                    "perplexity, the experiment's own `metrics`).", ["experiment", "metric"],
                    [([e.id, k.removeprefix("eval_")], float(v)) for e in exps for k, v in sorted(totals[e.id].items())
                     if k.startswith("eval_") and k != "eval_step"])
        yield counter("gossamer_experiment_bytes_up", "Bytes workers sent to the shards (on the wire).", lab,
                      rows("bytes_up"))
        yield counter("gossamer_experiment_bytes_down", "Bytes workers received from the shards (on the wire).",
                      lab, rows("bytes_down"))
        yield gauge("gossamer_experiment_compression_ratio", "Uncompressed / sent bytes of pushes.", lab,
                    rows("compression_ratio"))
        yield counter("gossamer_experiment_nodes_lost", "Nodes lost while running it (crash, kill, lease expiry).",
                      lab, [([e.id], totals[e.id].get("nodes_lost", 0.0)) for e in exps])
        yield counter("gossamer_experiment_role_failures", "Role processes that failed on live nodes.", lab,
                      [([e.id], float(e.failures)) for e in exps])
        rec = CounterMetricFamily("gossamer_experiment_recoveries",
                                  "Shard recoveries: a backup promoted, or a shard restored from a checkpoint.",
                                  labels=["experiment", "kind"])
        for e in exps:
            rec.add_metric([e.id, "promotion"], totals[e.id].get("promotions", 0.0))
            rec.add_metric([e.id, "restore"], totals[e.id].get("restores", 0.0))
        yield rec
        yield counter("gossamer_experiment_versions_lost", "Updates rolled back by restores from checkpoints.", lab,
                      rows("versions_lost"))
        disc = CounterMetricFamily("gossamer_experiment_discarded_updates", "Updates not applied, by cause.",
                                   labels=["experiment", "cause"])
        for e in exps:
            for k, v in sorted(totals[e.id].items()):
                if k.startswith("discarded_"):
                    disc.add_metric([e.id, k.removeprefix("discarded_")], v)
        yield disc
        hist = HistogramMetricFamily("gossamer_experiment_staleness",
                                     "Staleness (versions) of the updates the shards applied.",
                                     labels=["experiment", "shard"])
        for e in exps:
            per_shard: dict[str, list[tuple[str, float]] | None] = {}
            sums: dict[str, float] = {}
            for source, values in e.latest.items():
                shard = source.rpartition("/ps")[2]
                buckets = histogram_buckets(values) if shard.isdigit() else None
                if buckets is not None:
                    # Every replica that ever served counts what it applied itself.
                    per_shard[shard] = sum_buckets(per_shard.get(shard), buckets)
                    sums[shard] = sums.get(shard, 0.0) + values.get("staleness_sum", 0.0)
            for shard, b in sorted(per_shard.items()):
                if b is not None:
                    hist.add_metric([e.id, shard], b, sum_value=sums[shard])
        yield hist

    # --- per node, per experiment --------------------------------------------------------
    def _per_node(self, exps: list[ExpRec], now: float) -> Iterator[Metric]:
        lab = ["experiment", "node"]
        steps: Rows = []
        loss: Rows = []
        acc: Rows = []
        up: Rows = []
        down: Rows = []
        ratio: Rows = []
        rate: Rows = []
        slow: Rows = []
        for e in exps:
            by_node: dict[str, dict[str, float]] = {}
            for source, values in e.latest.items():
                node_id, _, rank = source.partition("/")
                if not rank or rank.startswith("ps"):
                    continue
                agg = by_node.setdefault(node_id, {})
                for k in ("bytes_up", "bytes_down", "raw_bytes_up"):
                    if k in values:
                        agg[k] = agg.get(k, 0.0) + values[k]
                if rank == "0":
                    for k in ("updates", "loss", "eval_accuracy"):
                        if k in values:
                            agg[k] = values[k]
            for node_id, agg in by_node.items():
                lv = [e.id, self._name(node_id)]
                if "updates" in agg:
                    steps.append((lv, agg["updates"]))
                if "loss" in agg and e.active:
                    loss.append((lv, agg["loss"]))
                if "eval_accuracy" in agg:
                    acc.append((lv, agg["eval_accuracy"]))
                if "bytes_up" in agg:
                    up.append((lv, agg["bytes_up"]))
                if "bytes_down" in agg:
                    down.append((lv, agg["bytes_down"]))
                if agg.get("bytes_up") and "raw_bytes_up" in agg:
                    ratio.append((lv, agg["raw_bytes_up"] / agg["bytes_up"]))
            rates, stragglers = worker_speeds(self.c.step_rates, e, now)
            for node_id, r in rates.items():
                lv = [e.id, self._name(node_id)]
                rate.append((lv, r))
                slow.append((lv, 1.0 if node_id in stragglers else 0.0))
        yield counter("gossamer_node_steps", "Steps the node's worker has taken in the experiment.", lab, steps)
        yield gauge("gossamer_node_step_rate", "The node's worker steps per second (last ~10 s).", lab, rate)
        yield gauge("gossamer_node_straggler",
                    "1 if the node's worker is slower than half the median step rate of the experiment's workers.",
                    lab, slow)
        yield gauge("gossamer_node_loss", "Training loss the node's worker reported last.", lab, loss)
        yield gauge("gossamer_node_eval_accuracy", "Evaluation accuracy the node reported last (the lead).", lab, acc)
        yield counter("gossamer_node_bytes_up", "Bytes the node's worker sent to the shards (on the wire).", lab, up)
        yield counter("gossamer_node_bytes_down", "Bytes the node's worker received from the shards.", lab, down)
        yield gauge("gossamer_node_compression_ratio", "Uncompressed / sent bytes of the node's pushes.", lab, ratio)

    def _name(self, node_id: str) -> str:
        node = self.c.nodes.get(node_id)
        return node.name if node is not None else node_id

    # --- the gRPC server -------------------------------------------------------------------
    def _grpc(self) -> Iterator[Metric]:
        srv = self.c.grpc_server
        if srv is None:  # a Coordinator without its server (tests): nothing to count
            return
        yield counter("gossamer_grpc_server_restarts",
                      "gRPC servers started again (same port, same state) after a malformed request stopped one.",
                      [], [([], float(srv.restarts))])
        yield counter("gossamer_grpc_malformed_refused",
                      "gRPC requests refused with INVALID_ARGUMENT because their body did not parse.",
                      [], [([], float(srv.malformed_refused))])
        yield counter("gossamer_udp_beats", "UDP heartbeats answered (docs/scale.md, \"UDP heartbeats\").",
                      [], [([], float(srv.beats_served))])
        yield counter("gossamer_udp_beats_dropped",
                      "UDP datagrams dropped unanswered, by reason: standby (not leading), malformed, unknown "
                      "(no such node, or no key from this coordinator), replay (counter not above the last), budget "
                      "(over the MAC checks a node id may cost an interval), mac (bad MAC), error.",
                      ["reason"], [([k], float(v)) for k, v in srv.beats_dropped.items()])


def render(coord: Coordinator) -> bytes:
    """The coordinator's metrics in the Prometheus text format."""
    return generate_latest(CoordinatorCollector(coord).registry())
