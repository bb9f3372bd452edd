"""One local rank of a worker's role process: joins the node's process group, runs its mode's trainer, reports."""

from __future__ import annotations

import json
import logging
import threading
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from gossamer.core.envinfo import fingerprint
from gossamer.core.errors import ConfigError
from gossamer.core.experiment import CODE_FIELDS, Experiment
from gossamer.core.import_check import resolve
from gossamer.core.modes import mode_of
from gossamer.core.protocol import AssignmentUpdate, RoleSpec
from gossamer.core.train_path import builtin_train_function
from gossamer.engine.process_group import end_process_group, start_process_group
from gossamer.engine.rank import RankContext
from gossamer.node._role_process import (
    drain,
    fault_bandwidth,
    fault_delay,
    keyring_of,
    refresh_keyring,
)
from gossamer.node.node_metrics import MetricsFeed
from gossamer.node.reporter import Reporter
from gossamer.security.curve import install as install_keyring
from gossamer.training.rank_trainer import RankTrainer
from gossamer.training.train_function import run_train_function
from gossamer.v1 import coordinator_pb2 as pb

log = logging.getLogger(__name__)

__all__ = ["WorkerRankRole"]


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device(f"cuda:{local_rank % torch.cuda.device_count()}")
    return torch.device("cpu")


class WorkerRankRole:
    """Local rank `spec.local_rank` of a worker role: the trainer of its experiment's mode, wired to
    the coordinator (reports, checkpoints), the node's /metrics and the agent's assignment updates."""

    def __init__(self, spec: RoleSpec, conn: Connection | None, stop: threading.Event) -> None:
        self.spec, self.conn, self.stop = spec, conn, stop
        self.rank, self.world, self.index = spec.local_rank, spec.nproc, spec.index
        self.device = _device(self.rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.reporter = Reporter(spec.coordinator, spec.experiment_id, f"{spec.node_id}/{self.rank}",
                                 security=spec.security)
        self.feed = MetricsFeed(spec.metrics_socket, {"experiment": spec.experiment_id, "role": "worker",
                                                      "worker": self.index, "rank": self.rank})  # this node's /metrics
        # The node's CURVE keys: every ShardClient and gossip peer of this process uses them.
        self.keyring = keyring_of(spec)
        install_keyring(self.keyring)

    def run(self) -> int:
        """Train; returns the exit code of the process (1: failed, reported to the coordinator)."""
        clean, finished = False, False
        try:
            start_process_group(rank=self.rank, world=self.world, port=self.spec.master_port,
                                cuda=self.device.type == "cuda")
            finished = self._train()
            clean = True
        except Exception as e:  # noqa: BLE001
            log.error("worker %d rank %d failed:\n%s", self.index, self.rank, traceback.format_exc())
            if not self.stop.is_set():
                # The experiment's own code failed (not this node): the coordinator stops retrying it.
                user = e.field if isinstance(e, ConfigError) and e.field in CODE_FIELDS else ""
                self.reporter.role(self.spec.node_id, pb.ROLE_WORKER, self.index, pb.ROLE_STATE_FAILED,
                                   message=f"{type(e).__name__}: {e}", retry_s=10, user_field=user)
        finally:
            # A stopped rank may have left its loop while another is inside a collective.
            end_process_group(finished_together=finished)
            self.reporter.close()  # joins its thread
        return 0 if clean else 1

    @property
    def ran_process_group(self) -> bool:
        """This rank was part of a process group (the node runs several local ranks)."""
        return self.world > 1

    # --- training ----------------------------------------------------------------------------
    def _context(self) -> RankContext:
        spec, a = self.spec, self.spec.assignment
        return RankContext(
            experiment_id=spec.experiment_id,
            experiment=builtin_train_function(Experiment.from_json(spec.experiment_json), local_ranks=self.world),
            node_id=spec.node_id,
            worker_index=self.index,
            worker_rank=a.worker_rank,
            generation=a.generation,
            num_workers=a.num_workers,
            endpoints=dict(a.endpoints),
            checkpoint_dir=spec.checkpoint_dir,
            lead=a.lead,
            coordinated=True,
            local_rank=self.rank,
            local_world=self.world,
            device=self.device,
            step_delay_s=fault_delay(self.index),
            node_name=spec.node_name,
            throttle=fault_bandwidth(),
            host=spec.address or "127.0.0.1",
            peers=dict(a.peers),
            sender_token=a.sender_token,
            shard_epochs=dict(a.shard_epochs),
        )

    def _updates(self) -> AssignmentUpdate | None:
        latest = drain(self.conn)
        if latest is not None:  # before the trainer connects anywhere new
            refresh_keyring(self.keyring, latest)
        return latest

    def _train(self) -> bool:
        """Run the trainer of the experiment's mode; whether it reached the end with every local rank."""
        ctx = self._context()
        if ctx.experiment.train:
            return self._train_function(ctx)
        trainer_class = resolve(mode_of(ctx.experiment).trainer)
        assert isinstance(trainer_class, type) and issubclass(trainer_class, RankTrainer)
        trainer = trainer_class(ctx, on_metrics=self.feed.tee(self.reporter.metric), updates=self._updates,
                                should_stop=self.stop.is_set, on_saved=self.reporter.checkpoint)
        trainer.report_final = self._report_final
        if self.rank == 0:
            self._record_environment()
            # a gossip worker's endpoint reaches its peers through the coordinator
            self.reporter.role(self.spec.node_id, pb.ROLE_WORKER, self.index, pb.ROLE_STATE_SERVING,
                               endpoint=trainer.endpoint)
        try:
            trainer.run()
        finally:
            trainer.loader.close()  # read-ahead threads and DataLoader worker processes
        self.reporter.flush()
        if self.rank == 0 and trainer.final_path:
            self.reporter.complete(self.spec.node_id, trainer.final_metrics, trainer.final_path)
        return trainer.finished

    def _train_function(self, ctx: RankContext) -> bool:
        """Call the experiment's train function; gossamer's exchange runs inside its optimizer's step."""
        if self.rank == 0:
            self._record_environment()

        def serving(endpoint: str) -> None:
            if self.rank == 0:  # a gossip worker's endpoint reaches its peers through the coordinator
                self.reporter.role(self.spec.node_id, pb.ROLE_WORKER, self.index, pb.ROLE_STATE_SERVING,
                                   endpoint=endpoint)

        trainer = run_train_function(ctx, on_metrics=self.feed.tee(self.reporter.metric), updates=self._updates,
                                     should_stop=self.stop.is_set, on_saved=self.reporter.checkpoint,
                                     report_final=self._report_final, serving=serving, flush=self.reporter.flush)
        self.reporter.flush()
        if trainer is not None and trainer.final_path:
            self.reporter.complete(self.spec.node_id, trainer.final_metrics, trainer.final_path)
        return trainer is not None and trainer.finished

    def _report_final(self) -> None:
        """This rank's final counters, then (rank 0) ROLE_STATE_DONE: the coordinator completes the run only
        once every worker said so, and a DONE that arrives finds the counters already merged."""
        delivered = self.reporter.flush()
        if self.rank == 0:
            self.reporter.role(self.spec.node_id, pb.ROLE_WORKER, self.index, pb.ROLE_STATE_DONE,
                               message="" if delivered else "final counters not delivered")

    def _record_environment(self) -> None:
        """Write this node's environment fingerprint next to the experiment's checkpoints.

        `<checkpoint_dir>/<experiment>/environment/<node>.json`: what every worker of the run
        ran on (torch, CUDA, NCCL, host), to explain a run that does not reproduce.
        """
        spec = self.spec
        try:
            d = Path(spec.checkpoint_dir) / spec.experiment_id / "environment"
            d.mkdir(parents=True, exist_ok=True)
            name = spec.node_name or spec.node_id
            tmp = d / f".{name}.json.tmp"
            tmp.write_text(json.dumps({"node": name, "node_id": spec.node_id, "worker": spec.index,
                                       "local_ranks": spec.nproc, **fingerprint(self.device)}, indent=1,
                                      sort_keys=True))
            tmp.replace(d / f"{name}.json")
        except OSError as e:  # a read-only or missing checkpoint volume must not stop training
            log.warning("could not record the environment fingerprint: %s", e)
