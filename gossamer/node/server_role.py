"""A parameter-server shard's role process: serves the shard, follows its assignment, checkpoints, reports."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from gossamer.checkpoint.fetch import Source, fetch_newest
from gossamer.checkpoint.sharded import AsyncCheckpointer, latest_good
from gossamer.compression.kernels import kernels_unless_asked
from gossamer.core.experiment import Experiment
from gossamer.core.faults import fault
from gossamer.core.metric_families import staleness_buckets
from gossamer.core.protocol import (
    RESTORE_NONE,
    RESTORE_SEEDING,
    AssignmentUpdate,
    LeaseRenewal,
    RoleSpec,
    ShardStop,
)
from gossamer.engine.model import build
from gossamer.node._role_process import EXIT_REPORTED, drain, keyring_of, refresh_keyring
from gossamer.node.node_metrics import MetricsFeed
from gossamer.node.reporter import Reporter
from gossamer.paramserver import Rebuilt, ShardConfig, ShardPlan, ShardServer, take_shard_values
from gossamer.training.train_function import capture_model
from gossamer.v1 import coordinator_pb2 as pb

log = logging.getLogger(__name__)

__all__ = ["ServerRole"]


def _staleness(histogram: dict[str, int]) -> dict[str, float]:
    """Mean and max versions behind of the updates a shard applied (its histogram, over the run)."""
    n = sum(histogram.values())
    if not n:
        return {}
    return {"staleness_mean": sum(int(k) * v for k, v in histogram.items()) / n,
            "staleness_max": float(max(int(k) for k in histogram))}


class ServerRole:
    """Hosts parameter-server shard `spec.index` (primary or backup) until `stop` or the end.

    The serve loop runs on its own thread; this one drains the agent's assignment updates
    (applied on the serve thread), tells the coordinator what changed, and feeds metrics.
    """

    def __init__(self, spec: RoleSpec, conn: Connection | None, stop: threading.Event) -> None:
        self.spec, self.conn, self.stop = spec, conn, stop
        self.shard = spec.index
        self.exp = Experiment.from_json(spec.experiment_json)
        self.feed = MetricsFeed(spec.metrics_socket, {"experiment": spec.experiment_id, "role": "ps",
                                                      "shard": self.shard})  # this node's /metrics
        self.reporter = Reporter(spec.coordinator, spec.experiment_id, f"{spec.node_id}/ps{self.shard}",
                                 security=spec.security)
        self.root = Path(spec.checkpoint_dir) / spec.experiment_id / "shards"
        self.checkpointer: AsyncCheckpointer | None = None
        self.keyring = keyring_of(spec)  # None: plaintext data plane
        self._snapshot_open_s = 0.0
        self.restored_epoch = 0
        self.restored_path = ""  # a restore the coordinator has not heard of yet
        #: Of that restore: the versions lost counted, and why that is not the exact count ("": it is).
        self.restored_lost: tuple[int, str] = (0, "")
        self.fetch_note = ""  # why no checkpoint could be fetched, for the coordinator's events
        self.endpoint = ""
        self._sent: tuple[bool | None, bool | None] = (None, None)  # (replicated, primary) the coordinator knows
        self._ckpt_failures_sent = 0  # checkpoint write failures the coordinator was told of
        self._saved_step = -1  # of the newest checkpoint written
        self._registered = False  # the coordinator took it
        #: time.monotonic() by which the final checkpoint must be written and registered (None: not leaving).
        self.leaving_until: float | None = None
        self.agent_stop = False  # the agent said stop: a SIGTERM is its (else from outside: serve on until it says)
        self._serve_stop = threading.Event()  # the serve thread's, set once this role stops
        self._outside_signal = False
        self._revoked = False  # the agent revoked the lease for good, or is gone (its pipe closed)
        self._abandoned = False  # a final checkpoint still writing when the node's grace ran out
        self.server: ShardServer

    # --- lifecycle -------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._start()
            self._serve()
        except Exception as e:  # noqa: BLE001 — report any failure to the coordinator, then exit non-zero
            log.exception("shard %d failed", self.shard)
            self.reporter.role(self.spec.node_id, pb.ROLE_PARAMETER_SERVER, self.shard, pb.ROLE_STATE_FAILED,
                               message=f"{type(e).__name__}: {e}", retry_s=10)
            self.reporter.close()
            raise SystemExit(EXIT_REPORTED) from None
        finally:
            if self.checkpointer is not None:
                self.checkpointer.close(timeout=0.0 if self._abandoned else None)
        self.reporter.flush(10.0 if self.leaving_until is None else max(0.0, self.leaving_until - time.monotonic()))
        self.reporter.close()

    def _start(self) -> None:
        """Build the shard from the seeded model, restore it if asked, bind, report SERVING."""
        kernels_unless_asked()  # a shard only decodes: numba's memory buys it little (`kernels_unless_asked`)
        if (slow := fault("slow-start")) is not None:
            time.sleep(float(slow.get("seconds", "0")))
        model = capture_model(self.exp) if self.exp.train else build(self.exp, torch.device("cpu"))[0]
        plan = ShardPlan.for_experiment(model, self.exp)
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        init = take_shard_values(model, plan, self.shard)  # empties the model: it is not needed again
        del model
        config = ShardConfig.for_experiment(self.exp, self.spec.experiment_id, self.shard)
        first = self.spec.assignment
        self.server = ShardServer(config, plan, init, shapes=shapes, backup=first.replica == 1,
                                  curve=self.keyring, own_init=True, epoch=first.shard_epochs.get(self.shard, 0))
        self.server.set_sender_key(first.sender_key)
        if self.spec.lease_until:
            self.server.renew_lease(self.spec.lease_until)
        if self.exp.checkpoint_every:
            self.checkpointer = AsyncCheckpointer(self.root, on_saved=self._saved, keep=3)
            self.server.on_snapshot = self._take_snapshot
        assignment = self.spec.assignment
        early = drain(self.conn, self._lease)  # the assignment may have changed while this process started
        if early is not None:
            assignment = early
            self.spec = replace(self.spec, assignment=early)
            refresh_keyring(self.keyring, early)
            if early.replica == 0:
                self.server.promote("assigned as primary before it served", early.shard_epochs.get(self.shard))
        if assignment.restore_epoch:
            self._restore(assignment)
        self.endpoint = self.server.bind(host=self.spec.address, port=0)
        log.info("shard %d (%s) of %s serving %d parameters on %s%s", self.shard,
                 "primary" if self.server.is_primary else "backup", self.spec.experiment_id,
                 plan.shard_numel(self.shard), self.endpoint,
                 f" over CurveZMQ ({len(self.keyring.members)} member keys)" if self.keyring is not None else "")
        self._apply(replace(assignment, restore_epoch=0))
        self._report()

    def _serve(self) -> None:
        thread = threading.Thread(target=self.server.serve, args=(self._serve_stop,), name=f"serve-shard-{self.shard}",
                                  daemon=True)
        thread.start()
        next_metrics = time.monotonic()
        while not self._stopping():
            if not thread.is_alive():
                # Never stay alive and heartbeating without serving: fail the process, so the
                # coordinator fails the shard over (promotes its backup, or restores it).
                why = self.server.serve_failure
                raise RuntimeError(f"the serve thread of shard {self.shard} died: "
                                   f"{type(why).__name__ if why else 'exited'}: {why}")
            update = drain(self.conn, self._lease, self._agent_stop)
            if self.leaving_until is not None:
                self._final_checkpoint(self.leaving_until)
                break
            if self.agent_stop:
                break
            if update is not None:
                refresh_keyring(self.keyring, update)  # members and server keys: read by the ZAP thread as well
                self.server.post(lambda u=update: self._apply(u))  # type: ignore[misc]
            if (self.server.replicated, self.server.is_primary) != self._sent or self.restored_path:
                self._report()
            self._report_checkpoint_failures()
            if time.monotonic() >= next_metrics:
                next_metrics += 1.0
                self._metrics()
        self._serve_stop.set()
        thread.join(timeout=5)
        self.server.close()

    def _stopping(self) -> bool:
        """Whether to stop now: the agent said so, or a signal came and no agent waits on this process.

        A SIGTERM from outside (a batch job's end, systemd, ^C) reaches the agent as well: the shard serves on
        until the agent's word, which keeps the handover to a backup and a final checkpoint in the agent's order.
        """
        if not self.stop.wait(0.1):
            return False
        if self.agent_stop or self.conn is None or self._revoked:
            return True
        if self._waiting():
            return False  # the agent's word may be waiting: read it first
        if not self._outside_signal:
            self._outside_signal = True
            log.warning("shard %d: signalled from outside the node agent: serving until the agent says stop",
                        self.shard)
        self.stop.clear()
        return False

    # --- assignment ------------------------------------------------------------------------
    def _apply(self, update: AssignmentUpdate) -> None:
        """Take in a changed assignment (on the serve thread)."""
        self.server.set_members(list(update.workers), update.generation)
        if update.sender_key:
            self.server.set_sender_key(update.sender_key)
        if update.restore_epoch > self.restored_epoch:
            self._restore(update)
        if update.replica == 0:
            self.server.promote("promoted by the coordinator", update.shard_epochs.get(self.shard))
        if self.server.is_primary:
            self.server.set_backup(update.backup_endpoint)

    def _waiting(self) -> bool:
        try:
            return self.conn is not None and self.conn.poll()
        except (EOFError, OSError):
            return True  # the next drain says the agent is gone

    def _agent_stop(self, msg: ShardStop) -> None:
        self.agent_stop = True
        if msg.checkpoint_s > 0:
            self.leaving_until = time.monotonic() + msg.checkpoint_s

    def _lease(self, lease: LeaseRenewal) -> None:
        """The agent renewed (or, `until` 0, revoked for good) this node's lease."""
        self.server.renew_lease(lease.until)
        self._revoked = self._revoked or lease.until == 0.0

    def _restore(self, update: AssignmentUpdate) -> None:
        """Load the newest good checkpoint (a corrupt one is refused, the previous used).

        Files this host lacks are fetched first from the nodes that hold them (within
        `FETCH_TIMEOUT_S`); without a checkpoint the shard is rebuilt from the workers' copies.
        """
        self.restored_epoch = update.restore_epoch
        fetched = ""
        if update.checkpoint_sources:
            sources = [Source(e, t, update.curve_server_keys.get(e, "")) for e, t in update.checkpoint_sources.items()]
            try:
                fetched = fetch_newest(self.root, self.spec.experiment_id, sources)
            except Exception as e:  # noqa: BLE001 — a failed fetch must not fail the restore
                fetched = f"no checkpoint fetched (the fetch failed: {type(e).__name__}: {e})"
            log.info("shard %d: %s", self.shard, fetched)
        path, refused = latest_good(self.root)
        for bad, why in refused:
            log.error("checkpoint %s refused: %s", bad, why)
        if path is None:
            log.error("no good checkpoint under %s: shard %d is rebuilt from the freshest worker's copy", self.root,
                      self.shard)
            self.server.on_seeded = self._seeded
            self.server.await_seed()
            self.restored_path = RESTORE_SEEDING
            self.fetch_note = f"shard {self.shard} restore: {fetched}" if fetched else ""
            return
        self.server.restore(str(path))
        self.restored_lost = (0, "a checkpoint holds no update after it; each worker's are counted as it pushes "
                                 "again")
        self.restored_path = f"{path} ({fetched})" if fetched.startswith("fetched") else str(path)

    def _seeded(self, rebuilt: Rebuilt) -> None:
        """The rebuild from the workers' copies ended (serve thread): the coordinator hears from where, and what
        it lost."""
        self.restored_lost = (rebuilt.lost, rebuilt.unknown)
        self.restored_path = f"worker {rebuilt.sender}'s copy" if rebuilt.sender else RESTORE_NONE

    def _report_checkpoint_failures(self) -> None:
        """A failed checkpoint write reaches the coordinator as a warning event, with its error."""
        ck = self.checkpointer
        if ck is None or ck.failed <= self._ckpt_failures_sent:
            return
        self._ckpt_failures_sent = ck.failed
        self._report(message=f"checkpoint write failed ({ck.failed} so far): {ck.last_error}")

    def _report(self, state: pb.RoleState.ValueType = pb.ROLE_STATE_SERVING, message: str = "",
                retry_s: float = 60.0) -> None:
        replicated, primary = self.server.replicated, self.server.is_primary
        if self.server.serve_failure is not None:
            # A dying serve thread keeps its failure, then closes its link to the backup: that
            # closed link is no detached backup (saying so made the coordinator restore the
            # shard instead of promoting its synced backup). The process's FAILED report follows.
            return
        message, self.fetch_note = message or self.fetch_note, "" if not message else self.fetch_note
        lost, unknown = self.restored_lost if self.restored_path else (0, "")
        self.reporter.role(self.spec.node_id, pb.ROLE_PARAMETER_SERVER, self.shard, state, endpoint=self.endpoint,
                           message=message,
                           replica=0 if primary else 1, replicated=replicated,
                           version=self.server.version, restored_from=self.restored_path,
                           versions_lost=lost, versions_lost_unknown=unknown, retry_s=retry_s)
        self._sent = (replicated, primary)
        self.restored_path = ""

    # --- checkpoints and metrics -----------------------------------------------------------
    def _take_snapshot(self, version: int) -> None:
        """At a checkpoint boundary (serve thread): save the state beside serving, streamed from the live tensors.

        Skipped while the previous save still runs. `ckpt_snapshot_s` is what the serve thread
        pays: opening the snapshot, waits for the writer (an update past the snapshot's budget
        of writes out of place) and any copy a write had to make for it (`PendingSnapshot`).
        """
        ck = self.checkpointer
        assert ck is not None
        if ck.busy:
            ck.skipped += 1
            return
        t0 = time.perf_counter()
        try:
            self.server.snapshot_later(version, ck.submit)
        except RuntimeError as e:  # the checkpointer closed as the role stops: the update stands, unsaved
            log.warning("checkpoint at version %d not taken: %s", version, e)
        self._snapshot_open_s += time.perf_counter() - t0

    def _saved(self, path: Path, snap: Any, seconds: float) -> None:
        self._saved_step = snap.step
        # Leaving: registered within the node's grace, or not at all (the coordinator may be gone; a
        # restore then finds the checkpoint by its manifest, the newest step under the root).
        until = self.leaving_until
        self._registered = self.reporter.register(
            snap.step, str(path), "shard", node_id=self.spec.node_id,
            retry_s=30.0 if until is None else max(0.0, until - time.monotonic()))

    def _final_checkpoint(self, until: float) -> None:
        """The node leaves and no backup holds this shard: stop acknowledging, then write the state (values,
        optimizer, version, the workers' clocks) as the newest checkpoint and register it, before `until`.

        Fenced first, so every update acknowledged is in the state written; the serve thread opens
        the snapshot, so an update being applied is whole in it. The periodic checkpoint's path writes
        it (a save still running is waited for first). One that cannot be written in time says so.
        """
        server = self.server
        if not server.is_primary or server.replicated or server.seeding:
            log.info("shard %d leaves without a final checkpoint: %s", self.shard,
                     "a backup" if not server.is_primary else "its backup holds it" if server.replicated
                     else "it waits for the workers' copies")
            return
        t0 = time.monotonic()
        server.renew_lease(0.0)  # for good: no push is acknowledged from here on
        if self.checkpointer is None:
            self.checkpointer = AsyncCheckpointer(self.root, on_saved=self._saved, keep=3)
        ck = self.checkpointer
        ck.wait(max(0.0, until - time.monotonic()))  # a periodic save still writing
        opened = threading.Event()
        taken: list[int] = []

        def take() -> None:  # on the serve thread: after any update in progress
            taken.append(server.version)
            if server.version != self._saved_step and not ck.busy:
                server.snapshot_later(server.version, ck.submit)
            opened.set()

        server.post(take)
        opened.wait(max(0.0, until - time.monotonic()))
        ck.wait(max(0.0, until - time.monotonic()))
        version = taken[0] if taken else server.version
        if self._saved_step == version:
            log.warning("shard %d: final checkpoint at version %d written in %.2f s, %s; acknowledging nothing "
                        "since", self.shard, version, ck.last_seconds,
                        "registered" if self._registered else "not registered (a restore finds it by its manifest)")
            return
        self._abandoned = ck.busy
        how = (f"not written within the node's grace ({time.monotonic() - t0:.1f} s of it, "
               f"{server.plan.shard_numel(self.shard) * 4 / 2**20:.0f} MiB of values)" if ck.busy
               else f"not written ({ck.last_error or 'no save could start'})")
        why = f"final checkpoint at version {version} {how}: a restore takes the newest periodic checkpoint"
        log.error("shard %d: %s", self.shard, why)
        self._report(message=why, retry_s=max(0.0, until - time.monotonic()))

    def _metrics(self) -> None:
        if self.server.seeding:
            # Its values and version are the initial ones until a worker's copy is taken: a point at version 0
            # would say the shard went back to the start.
            return
        st = self.server.stats()
        values = {
            "ps_updates": float(st.get("updates", 0)),
            "ps_bytes_in": float(st.get("bytes_in", 0)),
            "ps_bytes_out": float(st.get("bytes_out", 0)),
            "ps_errors": float(st.get("errors", 0)),
            "ps_decode_s": self.server.decode_seconds,
            "ps_apply_s": float(st.get("apply_s", 0.0)),
            "ps_unreplicated": float(st.get("unreplicated", 0)),
            "versions_lost": float(st.get("versions_lost", 0)),
            "ps_rate_limited": float(st.get("rate_limited", 0)),
            "ps_refused_not_member": float(st.get("not_member", 0)),
            "ps_refused_handshakes": float(st.get("curve_refused", 0)),
            "ckpt_snapshot_s": self._snapshot_open_s + self.server.snapshot_serve_seconds,
            "ps_cow_copies": float(st.get("cow_copies", 0)),
            # SSP updates from a worker the bound left out as a straggler (`SSPGate`): how much the pool
            # ran ahead of it.
            "ps_straggler_updates": float(st.get("straggler_updates", 0)),
        }
        values.update({f"discarded_{k}": float(v) for k, v in st.get("discarded", {}).items()})
        values.update(staleness_buckets(st.get("version_staleness", {})))
        values.update(_staleness(st.get("version_staleness", {})))
        if self.checkpointer is not None:
            ck = self.checkpointer
            values.update(ckpt_saved=float(ck.saved), ckpt_skipped=float(ck.skipped),
                          ckpt_failed=float(ck.failed), ckpt_write_s=ck.last_seconds)
        step = int(st.get("steps", st.get("version", 0)))  # a train function's sync: its optimizer steps
        self.reporter.metric(step, values)
        self.feed.send(step, {**values, "primary": float(self.server.is_primary)})
