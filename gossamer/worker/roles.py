"""Entry points of role processes (spawned by the node agent): a parameter-server shard or a worker rank."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from gossamer.security.curve import install as install_keyring
from gossamer.security.curve import keyring_from_spec
from gossamer.v1 import coordinator_pb2 as pb

log = logging.getLogger(__name__)


def _setup(spec: dict[str, Any]) -> None:
    from gossamer.logs import configure

    configure(spec.get("log_level", "INFO"), spec.get("log_format", "text"), role=spec.get("label", "role"),
              node=spec.get("node_name", ""), experiment=spec.get("experiment_id", ""))
    import torch

    # Role processes share the machine with each other: one intra-op thread each unless told.
    torch.set_num_threads(int(os.environ.get("GOSSAMER_THREADS", spec.get("threads", 1))))


def _fault_bandwidth() -> Any:
    """GOSSAMER_FAULT=bandwidth:rate=10mbit caps this node's pushes (a token bucket)."""
    from gossamer.transport.throttle import TokenBucket, parse_bandwidth

    for fault in filter(None, os.environ.get("GOSSAMER_FAULT", "").split(",")):
        kind, *kvs = fault.split(":")
        args = dict(kv.split("=", 1) for kv in kvs if "=" in kv)
        if kind == "bandwidth" and "rate" in args:
            return TokenBucket(parse_bandwidth(args["rate"]), burst_bytes=int(args.get("burst", 16384)))
    return None


def _fault_delay(worker_index: int) -> float:
    """GOSSAMER_FAULT=delay:seconds=S[:worker=I] slows worker I (any worker of this node) by S s per step."""
    spec = os.environ.get("GOSSAMER_FAULT", "")
    for fault in filter(None, spec.split(",")):
        kind, *kvs = fault.split(":")
        args = dict(kv.split("=", 1) for kv in kvs if "=" in kv)
        if kind == "delay" and int(args.get("worker", worker_index)) == worker_index:
            return float(args.get("seconds", 0.0))
    return 0.0


def _staleness(histogram: dict[str, int]) -> dict[str, float]:
    """Mean and max versions behind of the updates a shard applied (its histogram, over the run)."""
    n = sum(histogram.values())
    if not n:
        return {}
    return {"staleness_mean": sum(int(k) * v for k, v in histogram.items()) / n,
            "staleness_max": float(max(int(k) for k in histogram))}


def _drain(conn: Connection | None) -> dict[str, Any] | None:
    """The newest assignment update waiting on the agent's pipe (None if none)."""
    latest = None
    try:
        while conn is not None and conn.poll():
            latest = conn.recv()
    except (EOFError, OSError):
        pass
    return latest


def run_server(spec: dict[str, Any], conn: Connection | None = None) -> None:
    """Host parameter-server shard `spec['index']` (primary or backup) until SIGTERM or the end."""
    _setup(spec)
    from pathlib import Path

    from gossamer.checkpoint.sharded import AsyncCheckpointer, latest_good
    from gossamer.experiment import Experiment
    from gossamer.metric_families import staleness_buckets
    from gossamer.paramserver import (
        ShardConfig,
        ShardPlan,
        ShardServer,
        flatten_params,
    )
    from gossamer.worker.node_metrics import MetricsFeed
    from gossamer.worker.reporter import Reporter
    from gossamer.worker.trainer import build

    exp = Experiment.from_json(spec["experiment_json"])
    shard = spec["index"]
    feed = MetricsFeed.for_spec(spec, "ps", shard=shard)  # this node's /metrics
    reporter = Reporter(spec["coordinator"], spec["experiment_id"], f"{spec['node_id']}/ps{shard}",
                        security=spec.get("security"))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    root = Path(spec["checkpoint_dir"]) / spec["experiment_id"] / "shards"
    checkpointer: AsyncCheckpointer | None = None
    try:
        import torch

        model, _, _ = build(exp, torch.device("cpu"))
        plan = ShardPlan.for_experiment(model, exp)
        flat = flatten_params(model)
        init = {c.index: flat[c.flat_offset : c.flat_offset + c.numel].clone() for c in plan.chunks_of_shard(shard)}
        config = ShardConfig.for_experiment(exp, spec["experiment_id"], shard)
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        keyring = keyring_from_spec(spec)  # None: plaintext data plane
        server = ShardServer(config, plan, init, shapes=shapes, backup=spec.get("replica", 0) == 1, curve=keyring)
        snapshot_s = [0.0]

        def saved(path: Path, snap: Any, seconds: float) -> None:
            reporter.checkpoint(snap.step, str(path), "shard")

        if exp.checkpoint_every:
            checkpointer = AsyncCheckpointer(root, on_saved=saved, keep=3)

            def take_snapshot(version: int) -> None:
                t0 = time.perf_counter()
                snap = server.snapshot(version)
                snapshot_s[0] += time.perf_counter() - t0
                assert checkpointer is not None
                checkpointer.submit(snap)

            server.on_snapshot = take_snapshot
        restored = {"epoch": 0, "path": ""}

        def restore(epoch: int) -> None:
            """Load the newest good checkpoint (a corrupt one is refused, the previous used)."""
            restored["epoch"] = epoch
            path, refused = latest_good(root)
            for bad, why in refused:
                log.error("checkpoint %s refused: %s", bad, why)
            if path is None:
                log.error("no good checkpoint under %s: shard %d starts over from its initial values", root, shard)
                restored["path"] = "(none: initial values)"
                return
            server.restore(str(path))
            restored["path"] = str(path)

        early = _drain(conn)  # the assignment may have changed while this process started
        if early is not None:
            spec = {**spec, **early}
            if keyring is not None:
                keyring.update_from(early)
            if spec.get("replica", 0) == 0:
                server.promote("assigned as primary before it served")
        if spec.get("restore_epoch", 0):
            restore(spec["restore_epoch"])
        endpoint = server.bind(host=spec["address"], port=0)
        log.info("shard %d (%s) of %s serving %d parameters on %s%s", shard,
                 "primary" if server.is_primary else "backup", spec["experiment_id"], plan.shard_numel(shard), endpoint,
                 f" over CurveZMQ ({len(keyring.members)} member keys)" if keyring is not None else "")

        sent: dict[str, bool | None] = {"replicated": None, "primary": None}

        def report(state: pb.RoleState.ValueType = pb.ROLE_STATE_SERVING) -> None:
            replicated, primary = server.replicated, server.is_primary
            reporter.role(spec["node_id"], pb.ROLE_PARAMETER_SERVER, shard, state, endpoint=endpoint,
                          replica=0 if primary else 1, replicated=replicated,
                          version=server.version, restored_from=restored["path"])
            sent.update(replicated=replicated, primary=primary)  # what the coordinator now knows
            restored["path"] = ""

        def apply(update: dict[str, Any]) -> None:  # on the serve thread
            server.set_members(list(update.get("workers", [])), update.get("generation"))
            if update.get("restore_epoch", 0) > restored["epoch"]:
                restore(update["restore_epoch"])
            if update.get("replica", 0) == 0:
                server.promote()
            if server.is_primary:
                server.set_backup(update.get("backup_endpoint", ""))

        apply({k: spec.get(k) for k in ("workers", "replica", "backup_endpoint", "generation")} | {"restore_epoch": 0})
        report()
        thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
        thread.start()
        next_metrics = time.monotonic()
        while not stop.wait(0.1):
            update = _drain(conn)
            if update is not None:
                if keyring is not None:  # members and server keys: read by the ZAP thread as well
                    keyring.update_from(update)
                server.post(lambda u=update: apply(u))  # type: ignore[misc]
            if (server.replicated, server.is_primary) != (sent["replicated"], sent["primary"]) or restored["path"]:
                report()
            if time.monotonic() >= next_metrics:
                next_metrics += 1.0
                st = server.stats()
                values = {
                    "ps_updates": float(st.get("updates", 0)),
                    "ps_bytes_in": float(st.get("bytes_in", 0)),
                    "ps_bytes_out": float(st.get("bytes_out", 0)),
                    "ps_errors": float(st.get("errors", 0)),
                    "ps_decode_s": server.decode_seconds,
                    "ps_unreplicated": float(st.get("unreplicated", 0)),
                    "versions_lost": float(st.get("versions_lost", 0)),
                    "ps_rate_limited": float(st.get("rate_limited", 0)),
                    "ps_refused_not_member": float(st.get("not_member", 0)),
                    "ps_refused_handshakes": float(st.get("curve_refused", 0)),
                    "ckpt_snapshot_s": snapshot_s[0],
                }
                values.update({f"discarded_{k}": float(v) for k, v in st.get("discarded", {}).items()})
                values.update(staleness_buckets(st.get("version_staleness", {})))
                values.update(_staleness(st.get("version_staleness", {})))
                if checkpointer is not None:
                    values.update(ckpt_saved=float(checkpointer.saved), ckpt_skipped=float(checkpointer.skipped),
                                  ckpt_failed=float(checkpointer.failed), ckpt_write_s=checkpointer.last_seconds)
                reporter.metric(int(st.get("version", 0)), values)
                feed.send(int(st.get("version", 0)), {**values, "primary": float(server.is_primary)})
        thread.join(timeout=5)
        server.close()
    except Exception as e:  # noqa: BLE001 — report any failure to the coordinator, then exit non-zero
        log.exception("shard %d failed", shard)
        reporter.role(spec["node_id"], pb.ROLE_PARAMETER_SERVER, shard, pb.ROLE_STATE_FAILED,
                      message=f"{type(e).__name__}: {e}", retry_s=10)
        reporter.close()
        raise SystemExit(1) from None
    finally:
        if checkpointer is not None:
            checkpointer.close()
    reporter.flush()
    reporter.close()


def _record_environment(spec: dict[str, Any], device: Any) -> None:
    """Write this node's environment fingerprint next to the experiment's checkpoints.

    `<checkpoint_dir>/<experiment>/environment/<node>.json`: what every worker of the run
    ran on (torch, CUDA, NCCL, host), to explain a run that does not reproduce.
    """
    import json
    from pathlib import Path

    from gossamer.envinfo import fingerprint

    try:
        d = Path(spec["checkpoint_dir"]) / spec["experiment_id"] / "environment"
        d.mkdir(parents=True, exist_ok=True)
        name = spec.get("node_name") or spec["node_id"]
        tmp = d / f".{name}.json.tmp"
        tmp.write_text(json.dumps({"node": name, "node_id": spec["node_id"], "worker": spec["index"],
                                   "local_ranks": spec["nproc"], **fingerprint(device)}, indent=1, sort_keys=True))
        tmp.replace(d / f"{name}.json")
    except OSError as e:  # a read-only or missing checkpoint volume must not stop training
        log.warning("could not record the environment fingerprint: %s", e)


def run_worker_rank(spec: dict[str, Any], conn: Connection | None = None) -> None:
    """Run local rank `spec['local_rank']` of a worker role."""
    _setup(spec)
    import torch
    import torch.distributed as dist

    from gossamer.experiment import Experiment
    from gossamer.worker.node_metrics import MetricsFeed
    from gossamer.worker.reporter import Reporter
    from gossamer.worker.trainer import RankContext, RankTrainer, Trainer

    rank, world = spec["local_rank"], spec["nproc"]
    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    device = torch.device(f"cuda:{spec.get('device_index', rank) % max(1, torch.cuda.device_count())}") \
        if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    source = f"{spec['node_id']}/{rank}"
    reporter = Reporter(spec["coordinator"], spec["experiment_id"], source, security=spec.get("security"))
    index = spec["index"]
    feed = MetricsFeed.for_spec(spec, "worker", worker=index, rank=rank)  # this node's /metrics
    # The node's CURVE keys: every ShardClient and gossip peer of this process uses them.
    keyring = keyring_from_spec(spec)
    install_keyring(keyring)
    try:
        if world > 1 and not dist.is_initialized():
            dist.init_process_group(
                backend="nccl" if cuda else "gloo",
                init_method=f"tcp://127.0.0.1:{spec['master_port']}",
                rank=rank,
                world_size=world,
            )
        ctx = RankContext(
            experiment_id=spec["experiment_id"],
            experiment=Experiment.from_json(spec["experiment_json"]),
            node_id=spec["node_id"],
            worker_index=index,
            worker_rank=spec.get("worker_rank", index),
            generation=spec.get("generation", 0),
            num_workers=spec["num_workers"],
            endpoints={int(k): v for k, v in spec["shard_endpoints"].items()},
            checkpoint_dir=spec["checkpoint_dir"],
            lead=spec["lead"],
            local_rank=rank,
            local_world=world,
            device=device,
            step_delay_s=_fault_delay(index),
            node_name=spec.get("node_name", ""),
            throttle=_fault_bandwidth(),
        )

        def updates() -> dict[str, Any] | None:
            latest = None
            while conn is not None and conn.poll():
                latest = conn.recv()
            if latest is not None and keyring is not None:  # before the trainer connects anywhere new
                keyring.update_from(latest)
            return latest

        base: type[RankTrainer] = Trainer
        kwargs: dict[str, Any] = {}
        exp = ctx.experiment
        if exp.mode == "diloco" and exp.outer_step != "gossip":
            from gossamer.worker.diloco import DilocoTrainer

            base = DilocoTrainer
        elif exp.mode in ("gossip", "diloco"):  # gossip, and DiLoCo averaged by gossip
            from gossamer.worker.gossip import GossipTrainer

            base, kwargs = GossipTrainer, {"host": spec.get("address") or "127.0.0.1", "peers": spec.get("peers", {})}

        class _Trainer(base):  # type: ignore[valid-type,misc]
            def saved(self, step: int, path: str, kind: str) -> None:
                reporter.checkpoint(step, path, kind)

        trainer = _Trainer(ctx, on_metrics=feed.tee(reporter.metric), updates=updates, should_stop=stop.is_set,
                           **kwargs)
        trainer.flush_metrics = reporter.flush
        if rank == 0:
            _record_environment(spec, device)
        if rank == 0:  # a gossip worker's endpoint reaches its peers through the coordinator
            reporter.role(spec["node_id"], pb.ROLE_WORKER, index, pb.ROLE_STATE_SERVING,
                          endpoint=getattr(trainer, "endpoint", ""))
        trainer.run()
        reporter.flush()
        if rank == 0 and trainer.final_path:
            reporter.complete(spec["node_id"], trainer.final_metrics, trainer.final_path)
    except Exception as e:  # noqa: BLE001
        log.error("worker %d rank %d failed:\n%s", index, rank, traceback.format_exc())
        if not stop.is_set():
            reporter.role(spec["node_id"], pb.ROLE_WORKER, index, pb.ROLE_STATE_FAILED,
                          message=f"{type(e).__name__}: {e}", retry_s=10)
        reporter.close()
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    reporter.close()
