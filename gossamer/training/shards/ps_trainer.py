"""The parameter-server trainer of one local rank: compute, reduce inside the node, exchange its chunks with the shards."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.compression.momentum_placement import density_warmup_steps, momentum_on_worker
from gossamer.compression.worker_momentum import WorkerMomentum
from gossamer.core.errors import ShardError
from gossamer.core.faults import die_at, gate_at, hold_at
from gossamer.core.protocol import AssignmentUpdate
from gossamer.engine import sampler
from gossamer.engine.loader import Want, index_tuple
from gossamer.engine.rank import Hook, RankContext, StepAbandoned
from gossamer.engine.shard_plan import chunk_groups
from gossamer.paramserver import ShardClient
from gossamer.training.rank_trainer import OnSaved, RankTrainer
from gossamer.training.shards.adaptive_link import AdaptiveLink
from gossamer.training.shards.density_warmup import DensityWarmup
from gossamer.transport.router import FAILED_PRECONDITION, REFORM

log = logging.getLogger(__name__)

__all__ = ["PULL_GROUP_BYTES", "ParameterServerTrainer"]

#: What one pull of `ParameterServerTrainer._pull_by_group` asks for at most (a larger chunk goes alone).
PULL_GROUP_BYTES = 16 << 20


class ParameterServerTrainer(RankTrainer):
    """One local rank of a worker node, exchanging with parameter-server shards.

    Every step: pick this rank's samples, backprop sum(loss)/denominator, all-reduce the
    gradient inside the node (gloo/NCCL), push this rank's chunks to their shards and get
    the new values back, then re-assemble the full parameters inside the node.
    """

    uses_servers = True
    #: Whether the worker's own loss goes into its reports (a train function reports its own).
    reports_loss = True

    def __init__(self, ctx: RankContext, *, on_metrics: Hook | None = None,
                 updates: Callable[[], AssignmentUpdate | None] | None = None,
                 should_stop: Callable[[], bool] | None = None, on_saved: OnSaved | None = None) -> None:
        super().__init__(ctx, on_metrics=on_metrics, updates=updates, should_stop=should_stop, on_saved=on_saved)
        # ddp: a balanced share of every chunk; fsdp/pipeline: exactly the chunks of this rank's regions.
        self.mine = self.layout.chunks()
        shapes = dict(self.layout.shapes)
        compressor = None
        if self.exp.compression not in ("none", "adaptive") or self.exp.compression_overrides:
            compressor = ChunkCompressor(
                "none" if self.exp.compression == "adaptive" else self.exp.compression,
                self.plan,
                overrides=list(self.exp.compression_overrides.items()),
                shapes=shapes,
                seed=self.exp.seed * 1000 + ctx.worker_index,
                error_feedback={"auto": None, "on": True, "off": False}[self.exp.error_feedback],
                # Sign and sparse codecs: the momentum runs here, before them (the shards run none).
                momentum=WorkerMomentum(self.exp.momentum, nesterov=self.exp.nesterov)
                if momentum_on_worker(self.exp) else None,
                # random-k then sends an unbiased sample of the momentum (ChunkCompressor)
                unbiased_random=momentum_on_worker(self.exp),
            )
        self.client = ShardClient(
            experiment=ctx.experiment_id,
            sender=f"{ctx.node_id}:{ctx.worker_index}",
            plan=self.plan,
            endpoints=self._shard_endpoints(),
            chunks=[c.index for c in self.mine],
            compressor=compressor,
            pull_codec=self.exp.pull_compression,
            shapes=shapes,
            throttle=ctx.throttle,
            token=ctx.sender_token,
            epochs=ctx.shard_epochs,
            timeout_s=self.exp.shard_timeout_s,
        )
        self.adaptive: AdaptiveLink | None = None
        if self.exp.compression == "adaptive" and self.mine:
            self.adaptive = AdaptiveLink(self.client, self.plan, shapes,
                                         target_share=self.exp.adaptive_target_share,
                                         seed=self.exp.seed * 1000 + ctx.worker_index)
        warmup = density_warmup_steps(self.exp)
        self.warmup = DensityWarmup(self.client, warmup) if warmup and compressor is not None else None
        self.client.on_wait = self._on_wait  # new endpoints reach a waiting request
        self.client.seed_source = self._copy_of_shard  # a shard rebuilt from its workers' copies
        self.profiler.watch(self.client.compressor, "encode", "decode")
        self.profiler.watch(self.client.pull_decoder, "decode")
        self.client.fault_ctx = {"worker": ctx.worker_index, "rank": ctx.local_rank}
        self.versions: dict[int, int] = {}
        self.unpulled: list[int] = []  # shards a push acknowledged whose values are still to pull (`_push_pull`)
        self.periodic_model_checkpoints = False
        self._exchanging = False
        self.redone = 0  # sync steps computed again after the barrier re-formed
        self.versions_lost = 0
        self._last_ckpt = 0
        self._ckpt_thread: threading.Thread | None = None
        #: Cumulative seconds of the step's parts: the node gradient, the push+pull round trip
        #: (encode and decode inside it are the client's), writing the pulled values in.
        self.compute_s = self.exchange_s = self.assemble_s = 0.0
        self._node_progress = 0  # sharded: the step every local rank agreed on at the last exchange
        self._node_stop = False

    # --- parameter exchange ------------------------------------------------------------
    def _agree(self, done: bool) -> bool:
        """Sharded layouts: every local rank adopts the same end flag, progress and lead flag.

        Ranks talk to different shards, so their views of progress differ by a step or so;
        evaluations and the end are collective and must be decided alike on every rank.
        """
        version = -float(self.version) if self.versions else -float("inf")  # no chunks: no say
        flags = torch.tensor([float(done), version, float(self.ctx.lead), float(self.should_stop())],
                             dtype=torch.float64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self._node_progress = max(0, int(-flags[1])) if math.isfinite(float(flags[1])) else 0
        self.ctx.lead = bool(flags[2] > 0)
        self._node_stop = bool(flags[3] > 0)  # SIGTERM reached one rank: the node stops together
        return bool(flags[0] > 0)

    def _assemble(self, values: dict[int, torch.Tensor], done: bool) -> bool:
        """Make every local rank hold the full parameters, given this rank's fresh chunks.

        Returns `done` agreed by all local ranks: one rank's shards may report the end a
        step before another's, and a rank that stopped alone would leave the others in
        their next collective. The flag rides in the same all-reduce as the parameters.
        """
        t0 = time.perf_counter()
        done = self.layout.write_chunks(values, done)
        self.assemble_s += time.perf_counter() - t0
        return self._agree(done) if self._agrees_on_node() else done

    def pull(self) -> bool:
        res = self.client.pull()
        self._note_versions(res.versions)
        return self._assemble(res.values, res.done)

    def _note_versions(self, versions: dict[int, int]) -> None:
        """Keep shard versions; a shard that went backwards was restored from a checkpoint."""
        for s, v in versions.items():
            old = self.versions.get(s)
            if old is not None and v < old:
                log.warning("shard %d went back from version %d to %d (restored from a checkpoint)", s, old, v)
                self.versions_lost += old - v
        self.versions = dict(versions)

    @property
    def version(self) -> int:
        return min(self.versions.values()) if self.versions else 0

    @property
    def progress(self) -> int:
        """Steps done by the experiment, as compared with `total_steps` and `eval_every`."""
        return self.node_version

    @property
    def node_version(self) -> int:
        """The shard version this rank counts from: its own, or the one its node's ranks agreed on."""
        return self._node_progress if self._agrees_on_node() else self.version

    def _agrees_on_node(self) -> bool:
        """Whether the node's local ranks decide the end, progress, lead and stop together (`_agree`): sharded
        layouts, whose ranks talk to different shards and meet in collectives."""
        return not self.layout.holds_full_model

    @property
    def barrier(self) -> bool:
        """The shards wait for every current worker's update (the step is redone on REFORM)."""
        return self.mode.barrier

    # --- one step ----------------------------------------------------------------------
    def _data_step(self) -> int:
        return self.version if self.mode.allows_global_batch else self.clock

    def _want_at(self, step: int) -> tuple[Want, int]:
        if not self.mode.allows_global_batch:
            return super()._want_at(step)
        # sync: the step's global batch is split over the workers
        g = self.exp.effective_global_batch(self.ctx.num_workers)
        if self.train_data.stream:  # the step's span of the stream, whatever the membership
            return self._span_want(step, g)[0], g
        idx = sampler.sync_global_batch(len(self.train_data), g, step, self.exp.seed)
        idx = sampler.even_split(idx, self.ctx.num_workers, self.ctx.worker_rank)
        return ("idx", index_tuple(self.layout.rank_share(idx))), g

    def step(self) -> bool:
        """One training step; True when the experiment has reached total_steps.

        Sync mode: when the barrier re-forms (a worker lost or joined) the shards answer
        REFORM and the step is computed again over the new membership. With
        `global_batch_size` set the global batch of the step is the same samples whatever
        the number of workers; otherwise each worker keeps `batch_size`.
        """
        for attempt in range(100):
            generation = self.ctx.generation
            try:
                return self._step_once()
            except ShardError as e:
                if not self.barrier:
                    raise
                if REFORM in e.codes:
                    self._await_generation(generation)
                elif FAILED_PRECONDITION in e.codes and attempt < 99:
                    log.info("shards moved on or rolled back (%s); pulling and redoing the step", e)
                    time.sleep(0.05 * min(attempt, 10))
                    self.pull()
                else:
                    raise
                self.redone += 1
        raise RuntimeError("the sync step could not be completed after 100 attempts")

    def _await_generation(self, old: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.ctx.generation <= old and time.monotonic() < deadline and not self.should_stop():
            self._apply_updates()
            time.sleep(0.02)
        log.info("worker %d: barrier re-formed (generation %d -> %d, %d workers); redoing the step",
                 self.ctx.worker_index, old, self.ctx.generation, self.ctx.num_workers)

    def _step_once(self) -> bool:
        with self.profiler.region("compute"):
            grad, node_samples, compute_s = self._local_grad(self.client.fault_ctx)
        self.compute_s += compute_s
        if not self.step_ok:  # fp16 overflow: nothing is pushed, the scale went down, the batch is redone
            self.skipped_steps += 1
            return self.pull()
        done = self._send_gradient(self.layout.chunk_grads(), compute_s)
        self._count(node_samples)
        return done

    def _send_gradient(self, grads: dict[int, torch.Tensor], compute_s: float) -> bool:
        """This step's gradient to the shards (`compute_s` spent on it) and their values back; True at the end."""
        if self.warmup is not None:
            self.warmup.at(self.clock)
        if self.exp.overlap:
            return self._exchange_overlapped(grads, compute_s)
        sent0, t_exchange = self.client.bytes_up, time.perf_counter()
        done = self._push_pull(grads, step=self.version)
        if self.adaptive is not None:
            self.adaptive.after_step(compute_s, self.client.bytes_up - sent0, time.perf_counter() - t_exchange)
        return done

    def _push_pull(self, grads: dict[int, torch.Tensor], *, step: int, consume: bool = False,
                   values: bool = True) -> bool:
        """Push `grads` computed at shard version `step`, write the values of the reply; True at the end.

        Under a barrier the push names its step, the membership size and generation, so the
        shards can hold it for the others' and refuse it after a re-form. `consume`: `grads` is
        emptied once encoded (`ShardClient.push_pull`), its buffers freed during the round trip.
        `values` False: the shards only acknowledge; the shards whose values are still to be pulled are
        left in `unpulled`, for the caller to pull a group of chunks at a time (`_pull_by_group`) once the
        push is gone (a shard that predates the ack sends the values: it is not left there).
        """
        gate_at("push", step=self.progress, **self.client.fault_ctx)
        die_at("mid-push", step=self.clock, **self.client.fault_ctx)
        self.client.fault_step = self.clock
        barrier = self.barrier
        t0 = time.perf_counter()
        with self.profiler.region("communication"):
            res = self.client.push_pull(
                grads,
                clock=self.clock,
                basis=self.versions,
                step=step if barrier else None,
                num_workers=self.ctx.num_workers if barrier else None,
                generation=self.ctx.generation if barrier else None,
                consume=consume,
                values=values,
            )
        self.exchange_s += time.perf_counter() - t0
        self._note_versions(res.versions)
        if not values:
            self.unpulled = [s for s in sorted(res.versions)
                             if not any(i in res.values for i in self.client.chunks_of_shard(s))]
        return self._assemble(res.values, res.done)

    def _pull_by_group(self, shard: int) -> bool:
        """Pull this rank's chunks of `shard` a group of at most `PULL_GROUP_BYTES` at a time, each written
        in before the next is asked for; True at the end. All groups are of one version: where the shard
        moved on between two of them (async, or a barrier re-formed without this worker) they are pulled
        again from the first, and after three tries in one reply."""
        groups = chunk_groups(self.client.chunks_of_shard(shard), self.client.plan.chunks, PULL_GROUP_BYTES)
        for _ in range(3):
            version, done = self.versions.get(shard), False
            for group in groups:
                t0 = time.perf_counter()
                res = self.client.pull([shard], chunks=group)
                self.exchange_s += time.perf_counter() - t0
                if res.versions[shard] != version:
                    self._note_versions({**self.versions, **res.versions})
                    break
                done = self._assemble(res.values, res.done) or done
                del res
            else:
                return done
        res = self.client.pull([shard])
        self._note_versions({**self.versions, **res.versions})
        return self._assemble(res.values, res.done)

    def _exchange_overlapped(self, grads: dict[int, torch.Tensor], compute_s: float) -> bool:
        """Async with `overlap`: this step's gradient leaves while the next one is computed.

        The gradient just computed is pushed once the reply to the previous push is in, so
        the round trip hides behind compute; every update is one step staler than without.
        """
        basis = dict(self.versions)  # what this gradient was computed on
        done = False
        if self.client.in_flight:
            with self.profiler.region("communication"):
                res = self.client.wait()
            self._note_versions(res.versions)
            done = self._assemble(res.values, res.done)
        if self.adaptive is not None:
            self.adaptive.after_step(compute_s)
        if not done:
            with self.profiler.region("communication"):
                self.client.push_async(grads, clock=self.clock, basis=basis)
        return done

    # --- whole run ---------------------------------------------------------------------
    def run(self) -> None:
        """Train until the shards report total_steps; the lead then evaluates and checkpoints."""
        self.client.hello(fresh=True)
        done = self.pull()
        t_report, t0, samples0 = time.monotonic(), time.monotonic(), 0
        self._exchanging = True
        while not done and not self._stopping():
            self._apply_updates()
            self.profiler.step(self.clock)
            try:
                done = self.step()
            except StepAbandoned:
                # SIGTERM while waiting on the shards: give the step up. A push is one message
                # per shard, applied whole or not at all; a part of a multi-rank update left
                # alone is discarded by the shard when this worker LEAVEs.
                log.info("worker %d rank %d: stop requested mid-exchange; step abandoned",
                         self.ctx.worker_index, self.ctx.local_rank)
                self.client.abandon()
                break
            if done:  # past the last step: its final counters go next (a test holds or kills it here)
                hold_at("final-report", **self.client.fault_ctx)
                die_at("final-report", step=self.clock, **self.client.fault_ctx)
            now = time.monotonic()
            if now - t_report >= 1.0 or done:
                rate = (self.stats.samples - samples0) / max(1e-9, now - t_report)
                t_report, samples0 = now, self.stats.samples
                self._report(rate)
            self._maybe_eval_and_checkpoint()
        self.profiler.close(self.clock)
        self._exchanging = False
        if self.client.in_flight:
            if self.should_stop():
                self.client.abandon()
            else:
                self.client.wait()  # stopped mid-overlap: collect the last reply
        if self._ckpt_thread is not None:
            self._ckpt_thread.join()
        if done:
            self._apply_updates()
            if self._agrees_on_node():
                self._agree(True)  # every rank of the node agrees on the lead flag, then on the finish
            self._await_lead()
            if self.ctx.lead and not self._stopping():
                die_at("before-finish", step=self.progress, **self.client.fault_ctx)
                self._drop_training_state()  # before the final values come in: nothing trains again
                self.pull()  # the final parameters, whoever pushed last
                self.finish()
        self.client.leave()
        self.client.close()
        self.finished = done
        log.info("worker %d rank %d finished after %d steps (%.1f s)", self.ctx.worker_index,
                 self.ctx.local_rank, self.stats.steps, time.monotonic() - t0)

    def _drop_training_state(self) -> None:
        """Past the last step, before the final pull and checkpoint: free what only training needs (the
        codec's error-feedback residual, as big as what is pushed), so the finish holds no more than training."""
        if self.client.compressor is not None:
            self.client.compressor.reset()

    def _await_lead(self) -> None:
        """Past the last step and not the lead: stay until the run completes or this worker becomes lead.

        The final evaluation and checkpoint are the lead's. A lead lost after the last step
        (or during its finish) is replaced by the coordinator; the worker it names then
        finishes. Every worker leaving at the end would leave nobody to take over.
        """
        if not self.ctx.coordinated:
            return
        if not self.ctx.lead and self.ctx.local_rank == 0:
            log.info("worker %d: run done; staying until it completes or this worker becomes the lead",
                     self.ctx.worker_index)
            self.report_final()  # this node's final counters are in before the run completes
        while not self.ctx.lead and not self._stopping():
            time.sleep(0.1)
            self._apply_updates()
            if self._agrees_on_node():
                self._agree(True)  # the node's ranks take the lead flag and the stop together

    def _stopping(self) -> bool:
        """ddp: this rank's stop flag; sharded layouts: the flag the node's ranks agreed on."""
        return self._node_stop if self._agrees_on_node() else self.should_stop()

    def _shard_endpoints(self, wait_s: float = 120.0) -> dict[int, str]:
        """The endpoints of the shards this rank exchanges with, waiting (at most `wait_s`) for any
        shard not serving yet: a worker started beside a shard being restored (nodes returned to a
        run that had lost them all) would otherwise fail and be respawned until the run gave up."""
        need = {self.plan.chunks[c.index].shard for c in self.mine}
        endpoints = dict(self.ctx.endpoints)
        deadline = time.monotonic() + wait_s
        said = False
        while need - set(endpoints) and time.monotonic() < deadline and not self.should_stop():
            if not said:
                log.warning("shards %s not serving yet: waiting for their endpoints", sorted(need - set(endpoints)))
                said = True
            upd = super()._apply_updates()
            if upd is not None and upd.endpoints:
                endpoints = dict(upd.endpoints)
                self.ctx.shard_epochs.update(upd.shard_epochs)
            else:
                time.sleep(0.05)
        return endpoints

    def _copy_of_shard(self, shard: int) -> tuple[int, dict[int, torch.Tensor]]:
        """The shard version this rank last pulled and its values of its chunks of `shard` (its model's)."""
        mine = set(self.client.chunks_of_shard(shard))
        return self.versions.get(shard, 0), {i: v for i, v in self.layout.chunk_values().items() if i in mine}

    def _on_wait(self) -> None:
        self._apply_updates()
        if self._exchanging and self._abandons_alone() and self.should_stop():
            raise StepAbandoned

    def _abandons_alone(self) -> bool:
        """Whether this rank may give a step up on its own stop flag: sharded layouts never do (the other ranks
        would wait in a collective)."""
        return self.layout.holds_full_model

    def _apply_updates(self) -> AssignmentUpdate | None:
        upd = super()._apply_updates()
        if upd is not None and upd.endpoints:
            self.client.set_endpoints(dict(upd.endpoints), dict(upd.shard_epochs))
        return upd

    def _report(self, rate: float) -> None:
        c = self.client
        values = {
            "bytes_up": float(c.bytes_up),
            "bytes_down": float(c.bytes_down),
            "raw_bytes_up": float(c.raw_bytes_up),
            "raw_bytes_down": float(c.raw_bytes_down),
            "resent": float(c.resent),
            "shard_retries": float(c.retried),
            "stale_replies": float(c.stale_replies),
            "split_acks": float(c.split_acks),
            "versions_regressed": float(self.versions_lost),  # shard versions seen going back (a rollback)
            "redone_steps": float(self.redone),
            "step_compute_s": self.compute_s,
            "step_exchange_s": self.exchange_s,
            "step_encode_s": c.encode_s,
            "step_decode_s": c.decode_s,
            "step_assemble_s": self.assemble_s,
        }
        if self.skipped_steps or self.scaler is not None:
            values["skipped_steps"] = float(self.skipped_steps)
            values["loss_scale"] = self._loss_scale()
        if self.exp.max_grad_norm and not math.isnan(self.grad_norm):  # a train function reports its own
            values["grad_norm"] = self.grad_norm
        if c.compressor is not None:
            values["encode_s"] = c.compressor.encode_seconds
        if self.adaptive is not None:
            values.update(self.adaptive.metrics())
        if self.ctx.local_rank == 0:
            values.update(
                samples=float(self.stats.samples), samples_per_s=rate,
                updates=float(self.stats.steps), version=float(self.version),
            )
            if self.reports_loss:
                values["loss"] = self.stats.loss
        self.on_metrics(self.progress, values)

    def _maybe_eval_and_checkpoint(self) -> None:
        self._maybe_eval(self.progress)
        if not self.ctx.lead or self.ctx.local_rank != 0 or not self.layout.holds_full_model:
            return
        # Periodic checkpoints are the shards' (sharded, DCP); the lead writes the final one.
        v = self.progress
        ck = self.exp.checkpoint_every if self.periodic_model_checkpoints else 0
        if ck and v // ck > self._last_ckpt and v < self.exp.total_steps:
            self._last_ckpt = v // ck
            if self._ckpt_thread is None or not self._ckpt_thread.is_alive():
                # Snapshot now, persist in the background: training does not wait for disk.
                snapshot = {k: t.detach().cpu().clone() for k, t in self.model.state_dict().items()}
                self._ckpt_thread = threading.Thread(
                    target=self._save, args=(snapshot, v, "periodic"), daemon=True
                )
                self._ckpt_thread.start()

    def finish(self) -> None:
        """Final eval and final checkpoint (lead, all local ranks hold the final parameters)."""
        self._finish_at(self.progress)
