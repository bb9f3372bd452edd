"""Gossip mode's local rank: local steps, push-sum mixing with one peer per step, no servers; the lead averages at the end."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from gossamer.core.protocol import AssignmentUpdate
from gossamer.engine.rank import Hook, RankContext
from gossamer.training.gossip import PushSumPeer, Snapshot, out_peer
from gossamer.training.gossip.shares import LagBound, ShareWait, senders_to
from gossamer.training.local_optimizer import inner_optimizer, schedule_lr
from gossamer.training.rank_trainer import OnSaved, RankTrainer

log = logging.getLogger(__name__)

_MIN_WEIGHT = 2.0**-10


def consensus_distance(zs: list[torch.Tensor], weights: list[float]) -> tuple[torch.Tensor, float]:
    """(push-sum average sum(w_i z_i) / sum(w_i), mean squared distance of the z_i to it), on the first z's device."""
    total = sum(weights)
    zs = [z.to(zs[0].device) for z in zs]  # this node's parameters' device; peers' snapshots arrive on the CPU
    avg = sum((w * z for w, z in zip(weights, zs, strict=True)), torch.zeros_like(zs[0])) / total
    return avg, float(sum(float((z - avg).pow(2).sum()) for z in zs) / len(zs))


class GossipTrainer(RankTrainer):
    """One local rank of a gossip worker (Stochastic Gradient Push, arXiv:1811.10792).

    Every step: fold in the mass received since the last step (push-sum numerator and
    weight; the model holds the de-biased parameters), take a local optimizer step on this
    node's gradient (all-reduced inside the node), then send a share of the parameters to
    one peer of the time-varying graph (`topology`). The send leaves in the background
    while the next step computes; with `overlap` off the step waits until the peer has
    acknowledged it. Local rank 0 talks to the other nodes and broadcasts inside the node.

    `total_steps` counts each worker's steps (as in sync mode). A late joiner starts from
    the parameters and step of the most advanced peer. At every `eval_every` steps and at
    the end the lead gathers every peer's parameters, reports the consensus distance, and
    evaluates (and finally saves) their push-sum average.
    """

    #: Whether the worker's own loss goes into its reports (a train function reports its own).
    reports_loss = True

    def __init__(self, ctx: RankContext, *, on_metrics: Hook | None = None,
                 updates: Callable[[], AssignmentUpdate | None] | None = None,
                 should_stop: Callable[[], bool] | None = None, on_saved: OnSaved | None = None) -> None:
        super().__init__(ctx, on_metrics=on_metrics, updates=updates, should_stop=should_stop, on_saved=on_saved)
        self.opt = inner_optimizer(self.exp, self.model.parameters())
        self.outer: torch.optim.Optimizer | None = None
        self.theta0: torch.Tensor | None = None
        self.rounds = 0
        self._round_t = time.monotonic()  # when the last round's shares were mixed in
        self._round_s = 0.0  # how long the last round took here
        self.skipped_sends = 0
        self.sends = 0  # steps whose share left for a peer
        self.lone_steps = 0  # steps with no peer known (a share has nowhere to go)
        self.shares = ShareWait()
        self.lag = LagBound(self.exp.gossip_lag) if self.exp.gossip_lag is not None else None
        if self.mode.rounds:  # decentralized DiLoCo: an outer step on each node every `inner_steps`
            self.theta0 = self.flat.detach().clone().requires_grad_(True)
            self.outer = torch.optim.SGD([self.theta0], lr=self.exp.outer_lr, momentum=self.exp.outer_momentum,
                                         nesterov=self.exp.outer_momentum > 0)
        self.me = str(ctx.worker_index)
        self.peer: PushSumPeer | None = None
        if ctx.local_rank == 0:
            self.peer = PushSumPeer(experiment=ctx.experiment_id, peer_id=self.me, host=ctx.host,
                                    codec=self.exp.compression, numel=self.flat.numel())
        self.endpoint = self.peer.endpoint if self.peer is not None else ""
        self.profiler.watch(self.peer.codec if self.peer is not None else None, "encode", "decode")  # the sender's codec
        self.members: dict[str, str] = {}
        if self.peer is not None and ctx.peers:  # the members the assignment named at start
            self.members = {str(k): v for k, v in ctx.peers.items() if str(k) != self.me}
            self.peer.set_membership(dict(self.members), ctx.generation)
        self.consensus = float("nan")
        self.copied_from = ""
        self._collecting: _SnapshotCollector | None = None

    # --- membership ----------------------------------------------------------------------
    def _apply_updates(self) -> AssignmentUpdate | None:
        upd = super()._apply_updates()
        if upd is not None and self.peer is not None:
            self.members = {str(k): v for k, v in upd.peers.items() if str(k) != self.me}
            self.peer.set_membership(dict(self.members), self.ctx.generation)
        return upd

    def _target(self) -> str | None:
        ranks = sorted([self.me, *self.members], key=int)
        if len(ranks) < 2:
            return None
        j = out_peer(self.exp.topology, ranks.index(self.me), len(ranks), self.clock, self.exp.seed)
        return None if j is None else ranks[j]

    def _node_sync(self) -> None:
        """Local rank 0 mixed: every local rank takes its parameters (and step)."""
        if self.ctx.local_world > 1:
            dist.broadcast(self.flat, src=0)
            clock = torch.tensor([float(self.clock)])
            dist.broadcast(clock, src=0)
            self.clock = int(clock.item())
        self._params_changed()

    def _join(self) -> None:
        """Start from the most advanced peer's parameters (a late joiner copies a neighbour)."""
        if self.peer is not None:
            # A run starts together: wait (bounded) until the assignment names min_workers
            # peers, answering their snapshot requests meanwhile.
            deadline = time.monotonic() + 30.0
            while (len(self.members) + 1 < self.exp.min_workers and time.monotonic() < deadline
                   and not self.should_stop()):
                self.peer.serve(self.flat, self.clock)
                time.sleep(0.02)
                self._apply_updates()
        if self.peer is not None and self.members:
            best: tuple[str, Snapshot] | None = None
            # Steps first (light), then the model of the most advanced peer only.
            steps = self.peer.gather_snapshots(sorted(self.members, key=int), 5.0, self.flat, self.clock, light=True)
            ahead = max(steps.items(), key=lambda kv: (kv[1].step, -int(kv[0])), default=None)
            if ahead is not None and ahead[1].step > 0:
                snap = self.peer.request_snapshot(ahead[0], timeout=5.0)
                if snap is not None:
                    best = (ahead[0], snap)
            if best is not None and best[1].step > 0:
                self.flat.copy_(best[1].z)
                self.clock = best[1].step
                self.copied_from = best[0]
                self.on_metrics(self.clock, {"joined_at_step": float(self.clock)})
                log.info("worker %s joins at step %d with the parameters of worker %s", self.me, self.clock, best[0])
        self._node_sync()
        if self.theta0 is not None:
            with torch.no_grad():
                self.theta0.copy_(self.flat)

    # --- run -----------------------------------------------------------------------------
    def run(self) -> None:
        t0 = t_report = time.monotonic()
        samples0 = 0
        self._apply_updates()
        self._join()
        self._last_eval = self.clock // self.exp.eval_every if self.exp.eval_every else 0
        while self.clock < self.exp.total_steps and not self.should_stop():
            self._apply_updates()
            self.profiler.step(self.clock)
            with self.profiler.region("communication"):
                if self.peer is not None:
                    if self.outer is None:  # decentralized DiLoCo mixes once per round, in _mix_round
                        # Not waited for (ShareWait) here: per step, the lockstep let a node whose in-neighbour
                        # skipped sends drain its weight and train alone (final consensus 1.7-2.5, bench/modes).
                        # Only a node ahead of a neighbour by more than the lag waits (LagBound).
                        self._bound_lag()
                        self.peer.mix(self.flat)
                    self.peer.serve(self.flat, self.clock)
                if self.outer is None:
                    self._node_sync()
            with self.profiler.region("compute"):
                _, node_samples, _ = self._local_grad({"worker": self.ctx.worker_index, "rank": self.ctx.local_rank})
            schedule_lr(self.opt, self.exp, self.clock)
            self.opt.step()
            self._count(node_samples)
            if self.outer is None or self.clock % self.exp.inner_steps == 0 or self.clock >= self.exp.total_steps:
                self._exchange()
            now = time.monotonic()
            if now - t_report >= 1.0 or self.clock >= self.exp.total_steps:
                self._report((self.stats.samples - samples0) / max(1e-9, now - t_report))
                t_report, samples0 = now, self.stats.samples
            self._eval_average_when_due()
        self._end_eval_gather()
        self.profiler.close(self.clock)
        self._finish_or_serve()
        self.finished = self.clock >= self.exp.total_steps  # the node's ranks share the clock
        log.info("worker %s rank %d finished after %d steps (%.1f s)", self.me, self.ctx.local_rank,
                 self.stats.steps, time.monotonic() - t0)

    def _eval_average_when_due(self) -> None:
        """Every `eval_every` steps the lead gathers the peers' parameters (off the training path) and, once they
        are in, evaluates their push-sum average."""
        every = self.exp.eval_every
        if every and self.clock // every > self._last_eval and self.clock < self.exp.total_steps:
            self._last_eval = self.clock // every
            if self._evaluates() and self.peer is not None and self._collecting is None:
                self._collecting = _SnapshotCollector(self.peer, list(self.members), self.clock)
        if self._collecting is not None and self._collecting.done():
            self._eval_average(self._collecting.step, self._collecting.result())
            self._collecting = None

    def _end_eval_gather(self) -> None:
        """Past the loop: a gather still going is abandoned (at the end, what came in is evaluated)."""
        if self._collecting is not None:
            self._collecting.abandon()
            if self.clock >= self.exp.total_steps:  # the run outpaced the gather: report what came in
                self._eval_average(self._collecting.step, self._collecting.result())
            self._collecting = None

    def _exchange(self) -> None:
        """Send a share of the parameters to this round's peer (decentralized DiLoCo: after
        the outer step, once per round of `inner_steps`, then mix this round's shares in)."""
        if self.outer is not None:
            self._outer_step()
        self._send_share()
        if self.outer is not None:
            self._mix_round()

    def _send_share(self) -> None:
        to = self._target()
        if self.peer is None:
            return
        if to is None:
            self.lone_steps += 1
            return
        if self.peer.pending(to) >= 2 or self.peer.weight < _MIN_WEIGHT:
            # That neighbour answers nothing (dead, not yet removed): every hold keeps a
            # model-sized copy, so the mass stays here this round. A weight this small means
            # nothing has come in for many steps (the others finished or cannot reach this
            # peer): halving it again would drive z = x / w towards 0 / 0.
            self.skipped_sends += 1
            return
        with self.profiler.region("communication"):
            self.peer.send(self.flat, to, self.clock)
            self.sends += 1
            if not self.exp.overlap:
                self._wait_settled(limit_s=1.0)

    def _outer_step(self) -> None:
        """Decentralized DiLoCo: the outer Nesterov step on this node's pseudo-gradient theta_0 - theta_H.

        The neighbours' parameters are mixed in after it (`_mix_round`), not into theta_H before
        it: mixed before, the pseudo-gradient held the distance to the neighbours' parameters of the
        round's start (the shares sent after the last outer step), a round stale, and the outer
        momentum amplified it (up to 0.7 / (1 - 0.9) = 7x): the nodes never agreed (relative
        consensus distance about 1 with 4 nodes).
        """
        assert self.outer is not None and self.theta0 is not None
        self._node_sync()
        self.theta0.grad = self.theta0.detach() - self.flat
        self.outer.step()
        self.flat.copy_(self.theta0.detach())
        self._params_changed()
        self.rounds += 1

    def _mix_round(self) -> None:
        """Decentralized DiLoCo: mix the in-neighbours' shares of this round (sent after their outer
        step, waited for by `ShareWait`) into the new parameters; the next round starts from them."""
        assert self.theta0 is not None
        if self.peer is not None:  # local rank 0 talks to the other nodes
            self._await_shares()
            self.peer.mix(self.flat)
        self._node_sync()
        with torch.no_grad():
            self.theta0.copy_(self.flat)

    def _bound_lag(self) -> None:
        """Plain gossip: hold this step while an in-neighbour is more than the lag behind (`LagBound`)."""
        peer = self.peer
        assert peer is not None
        if self.lag is None:  # gossip_lag None: never held
            return

        def serve() -> None:
            peer.serve(self.flat, self.clock)
            self._apply_updates()  # a peer that left is no longer waited for

        self.lag.wait(peer, self.exp.topology, len(self.members) + 1, self.clock, serve=serve,
                      should_stop=self.should_stop)

    def _await_shares(self) -> None:
        """Decentralized DiLoCo without `overlap`: mix the in-neighbours' shares of this round now (`ShareWait`)."""
        if self.exp.overlap or self.clock == 0 or self.peer is None:
            return
        peer = self.peer
        expected = senders_to(self.exp.topology, self.me, list(self.members), self.clock, self.exp.seed)
        now = time.monotonic()
        self._round_s, self._round_t = now - self._round_t, now
        # A neighbour is late when it lags by more than half a round: on a loaded host a round of many steps
        # takes seconds, and mixed without a share on time the nodes drift apart by that round's updates.
        self.shares.wait(peer, expected, self.clock, serve=lambda: peer.serve(self.flat, self.clock),
                         should_stop=self.should_stop, limit_s=max(self.shares.limit_s, 0.5 * self._round_s))

    def _wait_settled(self, limit_s: float) -> None:
        """Wait for the peer's answer, at most `limit_s`: a silent peer delays one step, not the run."""
        assert self.peer is not None
        deadline = time.monotonic() + limit_s
        while not self.peer.wait_settled(0.05) and time.monotonic() < deadline:
            self.peer.serve(self.flat, self.clock)
            self._apply_updates()  # a peer that left: its hold is folded back
            if self.should_stop():
                return

    def _gather(self, *, wait_done: bool, timeout: float = 600.0) -> tuple[list[torch.Tensor], list[float]]:
        """Every current member's (z, weight), this node's included; with `wait_done`, once each has finished."""
        assert self.peer is not None
        got: dict[str, Snapshot] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.should_stop():
            self._apply_updates()
            self.peer.mix(self.flat)
            self.peer.serve(self.flat, self.clock, done=wait_done)
            for pid in list(self.members):
                if pid in got and (got[pid].done or not wait_done):
                    continue
                if wait_done:  # poll cheaply; the parameters move once, when the peer is done
                    status = self.peer.request_snapshot(pid, timeout=2.0, light=True)
                    if status is None or not status.done:
                        continue
                snap = self.peer.request_snapshot(pid, timeout=2.0)
                if snap is not None:
                    got[pid] = snap
            got = {p: s for p, s in got.items() if p in self.members}  # left meanwhile: not counted
            if all(p in got and (got[p].done or not wait_done) for p in self.members):
                break
            time.sleep(0.2)
        zs = [self.flat.clone(), *(s.z for s in got.values())]
        return zs, [self.peer.weight, *(s.weight for s in got.values())]

    def _eval_average(self, step: int, snaps: list[Snapshot]) -> None:
        """Evaluate the push-sum average of this node's parameters now and the peers' snapshots
        (asked for at `step`, under which it is reported; `eval_gathered_step` says when the
        average was formed)."""
        assert self.peer is not None
        snaps = [s for s in snaps if s.z.numel() == self.flat.numel()]
        zs = [self.flat.clone(), *(s.z for s in snaps)]
        ws = [self.peer.weight, *(s.weight for s in snaps)]
        avg, self.consensus = consensus_distance(zs, ws)
        mine = self.flat.clone()
        self.flat.copy_(avg)
        self._params_changed()
        self.on_metrics(step, {"consensus_distance": self.consensus, "gossip_peers": float(len(zs)),
                               "eval_gathered_step": float(self.clock)})
        self._evaluate(step)
        self.flat.copy_(mine)
        self._params_changed()

    def _finish_or_serve(self) -> None:
        """Lead: wait for every peer to finish, average, evaluate and save. Others: keep serving."""
        if self.peer is None:
            return  # local ranks > 0: rank 0 answers for the node
        self.peer.refuse_mass()  # peers still training keep their mass (and their weight)
        if not self.ctx.lead:
            self.report_final()  # this node's final counters are in before the run completes
        while not self.should_stop():
            self._apply_updates()
            if self.ctx.lead:
                zs, ws = self._gather(wait_done=True)
                avg, self.consensus = consensus_distance(zs, ws)
                self.on_metrics(self.clock, {"consensus_distance": self.consensus, "gossip_peers": float(len(zs)),
                                             "eval_gathered_step": float(self.clock)})  # not the mid-run eval's
                self.flat.copy_(avg)
                self._params_changed()
                self._report(0.0)
                self._finish_at(self.clock, {"consensus_distance": self.consensus})
                break
            self.peer.mix(self.flat)  # mass still arriving is kept: it is part of the average
            self.peer.serve(self.flat, self.clock, done=True)
            time.sleep(0.05)
        self.peer.close()

    def _report(self, rate: float) -> None:
        assert self.peer is not None or self.ctx.local_rank != 0
        values: dict[str, float] = {}
        if self.peer is not None:
            values = {
                "bytes_up": float(self.peer.bytes_up), "bytes_down": float(self.peer.bytes_down),
                "raw_bytes_up": float(self.peer.raw_bytes_up), "gossip_weight": self.peer.weight,
                "gossip_pending": float(self.peer.pending()), "gossip_skipped_sends": float(self.skipped_sends),
                "gossip_sends": float(self.sends), "gossip_lone_steps": float(self.lone_steps),
                "gossip_late_shares": float(self.shares.late), "gossip_share_timeouts": float(self.shares.timeouts),
                "gossip_lag_waits": float(self.lag.waits if self.lag else 0),
                "gossip_lag_timeouts": float(self.lag.timeouts if self.lag else 0),
            }
            if self.outer is not None:
                values["outer_rounds"] = float(self.rounds)
            # Refused mass goes back to its sender (NACK): nothing is lost, so not "discarded_".
            values.update({f"gossip_refused_{k}": float(v) for k, v in self.peer.rejected.items()})
            values.update(samples=float(self.stats.samples), samples_per_s=rate, updates=float(self.stats.steps))
            if self.reports_loss:
                values["loss"] = self.stats.loss
        self.on_metrics(self.clock, values)


class _SnapshotCollector:
    """Asks every peer for its parameters on a thread of its own, off the training path.

    The lead's periodic evaluation used to block its training loop while it gathered every
    peer's snapshot (2 s timeouts, one peer after another). `PushSumPeer.request_snapshot` may
    be called from any thread, and the trainer keeps serving the peers' own requests between
    its steps, so the lead now goes on training and evaluates once the snapshots are in.
    """

    def __init__(self, peer: PushSumPeer, members: list[str], step: int, timeout_s: float = 2.0) -> None:
        self.step = step  # the evaluation is reported at the step that asked for it
        self._peer = peer
        self._snaps: list[Snapshot] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(members, timeout_s), daemon=True,
                                        name="gossip-eval-gather")
        self._thread.start()

    def _run(self, members: list[str], timeout_s: float) -> None:
        # All at once, not one after another: each peer answers between its own steps, so the
        # waits overlap, and the replies share the link instead of queueing behind each other
        # (4 peers on 100 Mbit/s: one evaluation per ~20 steps asked one by one). The budget is
        # the one-by-one total.
        # As fp16: an evaluation's average need not be exact (the final one is gathered in fp32), and on a slow
        # link the gather's bytes are what spaces the evaluations out.
        got = self._peer.request_snapshots(members, timeout_s * max(1, len(members)), half=True,
                                           cancelled=self._stop.is_set)
        self._snaps.extend(got.values())

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> list[Snapshot]:
        return list(self._snaps)

    def abandon(self) -> None:
        """Stop asking (the run ended); returns once the thread has (at most one timeout)."""
        self._stop.set()
        self._thread.join()

