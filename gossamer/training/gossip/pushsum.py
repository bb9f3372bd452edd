"""The push-sum peer of gossip mode (Stochastic Gradient Push): exact mass accounting over ZMQ.

SGP (Assran et al. 2019, https://arxiv.org/abs/1811.10792) runs push-sum averaging next to
local SGD. Each peer keeps the de-biased parameters ``z`` and a weight ``w``; its mass is the
numerator ``x = w*z`` and ``w``. Sending hands a share of both to one neighbour; mixing adds
what arrived. Because every transfer either lands at the receiver or comes back to the
sender, ``sum(w_i z_i)`` and ``sum(w_i)`` are conserved exactly, whatever the network drops,
delays or duplicates:

* the sender keeps a *hold* (the message's numerator ``d`` and weight) until the receiver
  answers ``ACK`` (applied) or ``NACK``/``CANCELLED`` (not applied: the hold is restored);
  an unanswered hold sends ``CANCEL`` every `ack_timeout_s` until one of those comes back;
* the receiver remembers each (sender, id) outcome, so a duplicate or a MASS arriving after
  its CANCEL is answered as the first time and never applied twice;
* a lossy codec loses nothing either: the sender sends ``d = decode(encode(share*w*z))`` and
  keeps ``w*z - d``, so the compression error stays with it (error feedback for free).

Membership generations keep the weights exact across joins and leaves: on a new generation
a peer resets ``w`` to 1 (``z`` unchanged), refuses mass from other generations (NACK), and
folds mass of an older generation that still reaches it (a late ACKed message, a restored
hold, a hold to a removed peer) into ``z`` without adding its weight. Once every member is
in generation g and the holds have settled, ``sum(w_i)`` equals the number of members.

Threads: every method runs on the trainer's thread except `request_snapshot`, which may be
called from any thread. A background I/O thread (`gossamer.training.gossip._io`) owns the sockets
and never touches ``z``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import queue
import time
import zlib
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from gossamer.core.errors import ConfigError, ProtocolError
from gossamer.core.protocol import MassMeta, SnapMeta, SnapshotMeta
from gossamer.security import curve as curve_keys
from gossamer.security.curve import CurveKeyring
from gossamer.training.gossip._io import MASS, SNAP, SNAPSHOT, Fault, Incoming, PeerIO
from gossamer.training.gossip.differences import References, model_buffers, value_mass
from gossamer.training.gossip.value_codec import parse_value_codec
from gossamer.transport.frames import FrameLimits, Message, encode
from gossamer.transport.outgoing import ReplyBudget
from gossamer.transport.ratelimit import RateLimit

__all__ = ["MixStats", "PushSumPeer", "Snapshot"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MixStats:
    """What one `PushSumPeer.mix` folded in, and running totals."""

    received: int  # incoming messages folded by this call
    restored: int  # holds folded back by this call (NACKed, cancelled, peer removed)
    bytes_in: int  # totals so far, on the wire
    bytes_out: int
    pending: int  # holds still unsettled
    rejected: int  # incoming messages refused so far (all reasons)


@dataclass(frozen=True)
class Snapshot:
    """A neighbour's de-biased parameters, push-sum weight and progress."""

    z: torch.Tensor
    weight: float
    step: int
    done: bool


@dataclass
class _Hold:
    peer: str
    generation: int  # -1: folded back without weight whatever the current generation
    d: torch.Tensor
    weight: float
    value: torch.Tensor | None = None  # sent as a value (`differences`): the receiver's reference


_DEFAULT_RATE = RateLimit()
_DEFAULT_BUDGET = ReplyBudget()


def _limits_for(numel: int | None) -> FrameLimits:
    # A peer receives one fp32 copy of z at most (a MASS with codec "none", a snapshot
    # reply); twice that leaves room for a codec's extra bytes.
    return FrameLimits() if numel is None else FrameLimits.for_values(numel, copies=2)


class PushSumPeer:
    """One gossip participant: sends and receives push-sum mass, serves snapshots.

    Args:
        experiment: messages of other experiments are refused.
        peer_id: this peer's name in the membership (the ``sender`` of its messages).
        host: interface the ROUTER binds (on a random port; see `endpoint`).
        codec: none | fp16 | bf16 | int8 | qsgd:L (`parse_value_codec`).
        share: the fraction of its mass a peer sends per `send` (1/2 in SGP).
        ack_timeout_s: how long a hold waits for an answer before each CANCEL.
        limits: frame limits for everything received, ZMQ MAXMSGSIZE included (default:
            twice a fp32 `numel` plus a header when `numel` is given, else `FrameLimits()`).
        fault: test hook, see `gossamer.training.gossip._io.Fault`.
        numel: the size of z, if known before the first `send`/`mix`/`serve` (until then
            incoming mass is NACKed and comes back to its sender).
        curve: serve and connect with CurveZMQ: only the keyring's members may connect,
            neighbours are reached with the server keys it names (default: the keyring
            installed in this process, if any).
        rate_limit: per-neighbour message rate (None: unlimited); a peer over it gets
            ERROR "rate_limit" replies and nothing of its messages is decided.
        reply_budget: what snapshot replies not yet read may hold (per connection, and in
            bytes over all; None: unbounded); a snapshot request over it gets ERROR
            RESOURCE_EXHAUSTED (reason "reply_budget") and is not answered.
        differences: send each MASS as a compressed difference against the value of the last
            one the neighbour applied (CHOCO-SGD, `gossamer.training.gossip.differences`), so a lossy
            codec's error shrinks with the disagreement instead of staying proportional to
            the parameters; None: on for every codec but "none".

    Raises:
        ConfigError: bad `codec`, `share` or `ack_timeout_s`.
    """

    def __init__(
        self,
        *,
        experiment: str,
        peer_id: str,
        host: str = "127.0.0.1",
        codec: str = "none",
        share: float = 0.5,
        ack_timeout_s: float = 2.0,
        limits: FrameLimits | None = None,
        fault: Fault | None = None,
        numel: int | None = None,
        curve: CurveKeyring | None = None,
        rate_limit: RateLimit | None = _DEFAULT_RATE,
        differences: bool | None = None,
        reply_budget: ReplyBudget | None = _DEFAULT_BUDGET,
    ) -> None:
        if not 0.0 < share < 1.0:
            raise ConfigError("share", f"must be in (0, 1), got {share!r}")
        if not (math.isfinite(ack_timeout_s) and ack_timeout_s > 0):
            raise ConfigError("ack_timeout_s", f"must be positive, got {ack_timeout_s!r}")
        self.experiment = experiment
        self.peer_id = peer_id
        self.share = share
        #: The value codec this peer sends with (the trainer's profiler times it). Seeded per
        #: peer so QSGD's draws neither touch nor follow torch's global generator.
        self.codec = parse_value_codec(codec, seed=zlib.crc32(peer_id.encode()))
        self._numel = numel
        #: The trainer thread's model-sized buffers (the I/O thread has its own: pools are not thread-safe).
        self._buffers = model_buffers(per_key=4)
        self._refs = (References(self._buffers)
                      if (differences is None and self.codec.spec != "none") or differences else None)
        self._io = PeerIO(
            experiment=experiment,
            peer_id=peer_id,
            host=host,
            codec=parse_value_codec(codec),  # its own instance: codecs are not thread-safe
            ack_timeout_s=ack_timeout_s,
            limits=limits or _limits_for(numel),
            fault=fault,
            numel=numel,
            curve=curve if curve is not None else curve_keys.installed(),
            rate_limit=rate_limit,
            reply_budget=reply_budget,
        )
        self.endpoint = self._io.endpoint
        self.weight = 1.0
        self.generation = 0
        self._peers: dict[str, str] = {}
        self._holds: dict[int, _Hold] = {}
        self._returned: list[_Hold] = []
        self._early: list[Incoming] = []  # taken off the inbox by `arrived_from`, folded by the next mix
        self._heard: dict[str, int] = {}  # member -> latest step of its mass that came in (`heard`)
        self._ids = itertools.count()
        self._rids = itertools.count()
        self._closed = False

    # -- counters ----------------------------------------------------------------------
    @property
    def buffers_reused(self) -> int:
        """Model-sized buffers taken again instead of allocated, by the trainer's and the I/O thread's pools."""
        return self._buffers.reused + self._io.buffers_reused

    @property
    def bytes_up(self) -> int:
        return self._io.bytes_up

    @property
    def bytes_down(self) -> int:
        return self._io.bytes_down

    @property
    def raw_bytes_up(self) -> int:
        """What `bytes_up` would be with every MASS numerator sent as fp32."""
        return self._io.raw_bytes_up

    @property
    def send_failures(self) -> int:
        """Messages and replies this peer could not send (a full queue, a peer gone) so far."""
        return self._io.send_failures

    @property
    def rejected(self) -> dict[str, int]:
        """Incoming messages refused so far, by reason ("generation", "nonfinite", ...)."""
        return dict(self._io.rejected)

    @property
    def handshake_failures(self) -> int:
        """Connections a neighbour refused at the handshake (CURVE key, or CURVE on one side only)."""
        return self._io.handshake_failures

    @property
    def refused_handshakes(self) -> int:
        """CURVE handshakes this peer's server refused (keys of non-members)."""
        return self._io.refused_handshakes

    @property
    def connections(self) -> int:
        """Sockets open to neighbours: the ones sent to lately, dialled at the first send to each."""
        return self._io.connections

    @property
    def duplicates(self) -> int:
        """MASS copies answered from an earlier decision (retransmits, or late after CANCEL)."""
        return self._io.duplicates

    @property
    def peers(self) -> dict[str, str]:
        return dict(self._peers)

    def refuse_mass(self) -> None:
        """From now on NACK every incoming MASS: the mass stays with its sender.

        A peer that has finished training no longer sends; if it kept accepting, a peer still
        training would hand it half its weight every step and get nothing back, its weight
        shrinking geometrically until z = x / w underflows.
        """
        self._check_open()
        self._io.post("refuse_mass")

    # -- membership --------------------------------------------------------------------
    def set_membership(self, peers: dict[str, str], generation: int) -> None:
        """Adopt the current members other than this peer (peer_id -> endpoint).

        A higher `generation` resets the weight to 1. Holds to a peer that is gone (or
        whose endpoint changed: a new process) are folded back at the next `mix`, without
        their weight.

        Raises:
            ValueError: `generation` is lower than the current one.
        """
        if generation < self.generation:
            raise ValueError(f"generation {generation} is older than {self.generation}")
        peers = {pid: ep for pid, ep in peers.items() if pid != self.peer_id}
        removed = {pid for pid, ep in self._peers.items() if peers.get(pid) != ep}
        self._settle()
        if self._refs is not None:
            self._refs.keep_only(set(peers) - removed)
        for hid, hold in list(self._holds.items()):
            if hold.peer in removed:
                del self._holds[hid]
                hold.generation = -1
                self._returned.append(hold)
        self._peers = peers
        self._heard = {pid: step for pid, step in self._heard.items() if pid in peers and pid not in removed}
        if generation > self.generation:
            self.generation = generation
            self.weight = 1.0
        self._io.post("members", dict(peers), generation)

    # -- the push-sum step -------------------------------------------------------------
    def send(self, z: torch.Tensor, to: str, step: int) -> None:
        """Send `share` of this peer's mass to neighbour `to`, keeping the rest in (z, w).

        Updates `z` in place and `weight`; the message goes out on the I/O thread.

        Raises:
            ValueError: `to` is not a current member, or `z` is not a flat float32 tensor
                of the known size, or holds NaN/Inf.
        """
        self._check_open()
        self._check_z(z)
        if to not in self._peers:
            raise ValueError(f"{to!r} is not a current member")
        w = self.weight
        w_s = self.share * w
        with torch.no_grad():
            value: torch.Tensor | None = None
            ref: int | None = None
            spec = self.codec.spec
            n = z.numel()
            held = self._buffers.take("held", torch.float32, n)  # the hold's mass, until it is answered
            if self._refs is None:
                scaled = torch.mul(z.detach().cpu().reshape(-1), w_s, out=self._buffers.take("scaled", torch.float32, n))
                payload = self.codec.encode(scaled, key="mass")
                del scaled
                d = self.codec.decode(payload, (n,), torch.float32, out=held)
            else:
                payload, ref, value, spec = self._refs.encode(self.codec, z.detach().cpu(), to)
                d = value_mass(value, w_s, out=held)
            del held
            hid = next(self._ids)
            meta = MassMeta(id=hid, inc=self._io.incarnation, gen=self.generation, step=step, weight=w_s,
                            codec=spec, payload=payload.meta, ref=ref).to_meta()
            frames = encode(
                Message(
                    op=MASS,
                    experiment=self.experiment,
                    sender=self.peer_id,
                    version=step,
                    meta=meta,
                    tensors=payload.tensors,
                )
            )
            self._holds[hid] = _Hold(to, self.generation, d, w_s, value)
            self.weight = w - w_s
            z.mul_(w).sub_(d.to(z.device)).div_(self.weight)
        raw_extra = 4 * z.numel() - payload.nbytes
        info = {"peer": to, "id": hid, "step": step, "gen": self.generation}
        self._io.post("mass", to, hid, frames, raw_extra, info)

    def mix(self, z: torch.Tensor) -> MixStats:
        """Fold every accepted incoming message and every returned hold into (z, weight).

        Current-generation mass adds its weight: ``z <- (w*z + sum d)/(w + sum w_d)``,
        ``w <- w + sum w_d``; older-generation mass is folded into z the same way but
        leaves w unchanged.
        """
        self._check_open()
        self._check_z(z)
        self._settle()
        total: torch.Tensor | None = None
        w_all = w_current = 0.0
        received = restored = 0
        items: list[tuple[torch.Tensor, float, int]] = []
        self._take_inbox()
        for inc in self._early:
            items.append((inc.d, inc.weight, inc.generation))
            received += 1
        self._early = []
        for hold in self._returned:
            items.append((hold.d, hold.weight, hold.generation))
            restored += 1
        self._returned = []
        for d, weight, generation in items:
            if total is None:
                total = self._buffers.take("total", torch.float32, d.numel()).copy_(d)
            else:
                total.add_(d)
            w_all += weight
            if generation == self.generation:
                w_current += weight
        if total is not None:
            with torch.no_grad():
                z.mul_(self.weight).add_(total.to(z.device)).div_(self.weight + w_all)
            self.weight += w_current
        return MixStats(
            received=received,
            restored=restored,
            bytes_in=self._io.bytes_down,
            bytes_out=self._io.bytes_up,
            pending=len(self._holds),
            rejected=sum(dict(self._io.rejected).values()),  # a copy: the I/O thread adds
        )

    def arrived_from(self, step: int, timeout: float = 0.0) -> set[str]:
        """The senders of mass sent at `step` or later that has come in, waiting for the next mix
        (with `timeout`, waiting up to that long for a message when none is in)."""
        self._check_open()
        self._take_inbox(timeout)
        return {inc.sender for inc in self._early if inc.step >= step}

    def heard(self, timeout: float = 0.0) -> dict[str, int]:
        """The latest step of the mass each current member sent that has come in (mixed or not):
        how far along this peer's in-neighbours are (with `timeout`, waiting up to that long for a
        message when none is in)."""
        self._check_open()
        self._take_inbox(timeout)
        return dict(self._heard)

    def _take_inbox(self, timeout: float = 0.0) -> None:
        if timeout > 0:
            with contextlib.suppress(queue.Empty):
                self._took(self._io.inbox.get(timeout=timeout))
        while True:
            try:
                self._took(self._io.inbox.get_nowait())
            except queue.Empty:
                return

    def _took(self, inc: Incoming) -> None:
        self._early.append(inc)
        if inc.sender in self._peers and inc.step > self._heard.get(inc.sender, -1):
            self._heard[inc.sender] = inc.step

    def pending(self, peer: str | None = None) -> int:
        """Holds still waiting for their answer (ACK, NACK or CANCELLED), to `peer` or all.

        Each hold keeps a model-sized tensor, so a trainer should pick another neighbour
        than one with several pending (a dead peer answers nothing until it is removed).
        """
        self._settle()
        if peer is None:
            return len(self._holds)
        return sum(1 for h in self._holds.values() if h.peer == peer)

    def wait_settled(self, timeout: float) -> bool:
        """Block until every hold is settled (the mass itself returns at the next `mix`)."""
        deadline = time.monotonic() + timeout
        self._settle()
        while self._holds:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                hid, restore = self._io.settled.get(timeout=left)
            except queue.Empty:
                return False
            self._settle_one(hid, restore)
            self._settle()
        return True

    def _settle(self) -> None:
        while self._refs is not None:
            try:
                self._refs.refused(self._io.stale_refs.get_nowait())
            except queue.Empty:
                break
        while True:
            try:
                hid, restore = self._io.settled.get_nowait()
            except queue.Empty:
                return
            self._settle_one(hid, restore)

    def _settle_one(self, hid: int, restore: bool) -> None:
        hold = self._holds.pop(hid, None)
        if hold is None:
            return
        if restore:
            self._returned.append(hold)  # the receiver's references are as they were
        elif self._refs is not None and hold.value is not None:
            self._refs.applied(hold.peer, hid, hold.value)

    # -- snapshots ---------------------------------------------------------------------
    def serve(self, z: torch.Tensor, step: int, done: bool = False) -> None:
        """Answer the snapshot requests received since the last call with (z, weight, step)."""
        if self._closed or self._io.snap_requests.empty():
            return
        snap = z.detach().to("cpu", torch.float32).reshape(-1).clone()
        half: torch.Tensor | None = None
        while True:
            try:
                identity, rid, requester, asked, reserved = self._io.snap_requests.get_nowait()
            except queue.Empty:
                return
            light = asked.light
            values = snap
            if asked.half and not light:
                if half is None:
                    half = snap.to(torch.float16)
                    if not bool(torch.isfinite(half).all()):  # beyond fp16's range: as they are
                        half = snap
                values = half
            meta = {"rid": rid, **SnapshotMeta(weight=self.weight, step=step, done=done, gen=self.generation).to_meta()}
            frames = encode(
                Message(
                    op=SNAPSHOT,
                    experiment=self.experiment,
                    sender=self.peer_id,
                    version=step,
                    meta=meta,
                    tensors={} if light else {"z": values},
                )
            )
            self._io.post("reply", identity, frames, {"peer": requester, "rid": rid}, reserved,
                          None if light else values.data_ptr())

    def _ask_snapshot(self, endpoint: str | None, light: bool, half: bool = False) -> tuple[int, Any] | None:
        """Send a SNAP request; (request id, future of the reply), or None if there is no one to ask."""
        if endpoint is None or self._closed:
            return None
        rid = next(self._rids)
        frames = encode(
            Message(op=SNAP, experiment=self.experiment, sender=self.peer_id,
                    meta={"rid": rid, **SnapMeta(light=light, half=half).to_meta()})
        )
        return rid, self._io.request(rid, endpoint, frames)

    def request_snapshot(self, peer: str, timeout: float, *, light: bool = False) -> Snapshot | None:
        """Ask `peer` (a member's id, or a ``tcp://`` endpoint) for its current state.

        `light`: only its weight, step and done flag (the snapshot's `z` is empty), for
        polling whether a peer has finished without moving a model each time.

        Returns:
            The snapshot, or None on timeout, an error reply, an invalid reply, or a peer
            that is not a member.
        """
        asked = self._ask_snapshot(self._peers.get(peer) or (peer if "://" in peer else None), light)
        if asked is None:
            return None
        rid, fut = asked
        try:
            msg = fut.result(timeout=timeout)
        except FutureTimeout:
            msg = None
        finally:
            self._io.forget(rid)
        return None if msg is None else self._snapshot(peer, msg, light)

    def gather_snapshots(self, peers: list[str], timeout: float, z: torch.Tensor, step: int, *,
                         light: bool = False) -> dict[str, Snapshot]:
        """Ask every peer at once for its state (`light`: weight, step, done only), answering
        their requests meanwhile.

        Peers that start together ask each other: asked one at a time without serving, each
        waited out the others' timeouts in turn (seconds of start-up skew on 4 workers).
        """
        return self._await_snapshots(self._ask_all(peers, light), timeout, light, lambda: self.serve(z, step))

    def request_snapshots(self, peers: list[str], timeout: float, *, half: bool = False,
                          cancelled: Callable[[], bool] = lambda: False) -> dict[str, Snapshot]:
        """Ask every peer at once for its full state and wait up to `timeout` for the replies,
        from any thread (nothing is served here: the training thread keeps answering between its
        steps). Stops waiting early once `cancelled()` is true. `half`: the values travel as fp16
        where they fit (half the bytes) and come back as fp32."""
        return self._await_snapshots(self._ask_all(peers, False, half), timeout, False, cancelled, half=half)

    def _ask_all(self, peers: list[str], light: bool, half: bool = False) -> dict[str, tuple[int, Any]]:
        pending: dict[str, tuple[int, Any]] = {}
        for peer in peers:
            asked = self._ask_snapshot(self._peers.get(peer), light, half)
            if asked is not None:
                pending[peer] = asked
        return pending

    def _await_snapshots(self, pending: dict[str, tuple[int, Any]], timeout: float, light: bool,
                         between: Callable[[], object], *, half: bool = False) -> dict[str, Snapshot]:
        """The replies to `pending` that arrive within `timeout`; `between()` runs each poll (a true
        result ends the wait)."""
        got: dict[str, Snapshot] = {}
        deadline = time.monotonic() + timeout
        try:
            while pending and time.monotonic() < deadline:
                if between():
                    break
                for peer, (rid, fut) in list(pending.items()):
                    if fut.done():
                        del pending[peer]
                        self._io.forget(rid)
                        msg = None if fut.exception() is not None else fut.result()
                        snap = None if msg is None else self._snapshot(peer, msg, light, half=half)
                        if snap is not None:
                            got[peer] = snap
                time.sleep(0.005)
        finally:
            for rid, _ in pending.values():
                self._io.forget(rid)
        return got

    def _snapshot(self, peer: str, msg: Message, light: bool = False, *, half: bool = False) -> Snapshot | None:
        z = torch.empty(0) if light and not msg.tensors else msg.tensors.get("z")
        if half and z is not None and z.dtype == torch.float16:
            z = z.float()
        if z is None or z.dtype != torch.float32 or z.dim() != 1:
            problem = "no flat float32 tensor 'z'"
        elif self._numel is not None and z.numel() != self._numel and not light:
            problem = f"{z.numel()} values, expected {self._numel}"
        elif not bool(torch.isfinite(z).all()):
            problem = "non-finite values"
        else:
            try:
                meta = SnapshotMeta.from_meta(msg.meta)
            except ProtocolError as e:
                problem = str(e)
            else:
                return Snapshot(z=z, weight=meta.weight, step=meta.step, done=meta.done)
        logger.warning("gossip peer %s: invalid snapshot from %r: %s", self.peer_id, peer, problem)
        return None

    # -- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        """Stop the I/O thread and close the sockets; unsettled holds are abandoned."""
        if self._closed:
            return
        self._closed = True
        self._io.close()

    def __enter__(self) -> PushSumPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"gossip peer {self.peer_id} is closed")

    def _check_z(self, z: torch.Tensor) -> None:
        if not isinstance(z, torch.Tensor) or z.dtype != torch.float32 or z.dim() != 1:
            raise ValueError("z must be a flat float32 tensor")
        if self._numel is None:
            self._numel = z.numel()
            self._io.post("numel", self._numel)
        elif z.numel() != self._numel:
            raise ValueError(f"z has {z.numel()} values, this peer gossips {self._numel}")
