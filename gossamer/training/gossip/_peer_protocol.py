"""The push-sum peer's protocol: what its I/O thread does with each MASS, CANCEL and SNAP and with their replies.

Incoming mass is validated and decoded (so it is ACKed or NACKed at once) and goes to
`PeerProtocol.inbox`; a hold settled by a reply goes to `PeerProtocol.settled`, a snapshot
request to `PeerProtocol.snap_requests`, all consumed by the trainer. Every outcome is
remembered per sender incarnation, so a duplicate or a CANCEL is answered as the first time.
The sockets, the thread and the sending belong to the `Wire` (`_io.PeerIO`).
"""

from __future__ import annotations

import logging
import math
import queue
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import zmq

from gossamer.compression import Codec, Payload
from gossamer.core.errors import ProtocolError
from gossamer.core.protocol import CancelMeta, MassMeta, SnapMeta
from gossamer.training.gossip.differences import EXACT, ReceivedValues
from gossamer.transport.frames import FrameLimits, Message, decode, encode
from gossamer.transport.outgoing import Reservation
from gossamer.transport.router import (
    FAILED_PRECONDITION,
    INVALID_ARGUMENT,
    NOT_MEMBER,
    OVER_RATE,
    PERMISSION_DENIED,
    RATE_LIMITED,
    RESOURCE_EXHAUSTED,
    UNAUTHENTICATED,
    Router,
)

logger = logging.getLogger("gossamer.training.gossip._io")  # one logger for the peer's I/O thread, whichever part logs

MASS, ACK, NACK, CANCEL, CANCELLED = "MASS", "ACK", "NACK", "CANCEL", "CANCELLED"
SNAP, SNAPSHOT, ERROR = "SNAP", "SNAPSHOT", "ERROR"

_LOG_EVERY_S = 5.0
# Outcomes remembered per sender incarnation: a CANCELLED id must outlive any late copy of
# its MASS, or the late copy would be applied after the sender took the mass back.
_SEEN_PER_SENDER = 1 << 16
_SEEN_SENDERS = 1024
#: Push-sum weights start at 1 per peer and only move between peers, so none exceeds the number
#: of peers; one far above it (1e308 passed as finite) left the receiver unable to send again.
_MAX_WEIGHT = float(1 << 20)
#: Why a snapshot request was refused: the connection, or the peer, holds its most in unread replies.
OVER_BUDGET = "reply_budget"
# A gossip ERROR carries the data plane's one vocabulary of codes (transport/router.py) and,
# as `reason`, the finer refusal reason it is counted under (`gossip_refused_<reason>`).
_CODE_OF_REASON = {"malformed": INVALID_ARGUMENT, NOT_MEMBER: PERMISSION_DENIED, OVER_RATE: RATE_LIMITED,
                   "unauthenticated": UNAUTHENTICATED, OVER_BUDGET: RESOURCE_EXHAUSTED}
_REASON_OF_CODE = {code: reason for reason, code in _CODE_OF_REASON.items()}


@dataclass
class Incoming:
    """Mass accepted (and ACKed) by the I/O thread, waiting for the trainer's next mix."""

    sender: str
    generation: int
    step: int
    weight: float
    d: torch.Tensor


class Wire(Protocol):
    """What the protocol needs of the I/O thread: its ROUTER, its sockets to neighbours, and sending."""

    @property
    def router(self) -> Router: ...

    def send(self, sock: zmq.Socket, identity: bytes | None, frames: list[Any], op: str, info: dict[str, Any],
             raw_extra: int = 0) -> None: ...

    def neighbour(self, peer: str, busy: Callable[[], set[str]]) -> zmq.Socket | None:
        """The socket to member `peer`, dialled now if need be (None: not a member, or undiallable)."""
        ...

    def open_neighbour(self, peer: str) -> zmq.Socket | None:
        """The socket to `peer` if one is open (none dialled)."""
        ...

    def resolve(self, rid: int, msg: Message | None) -> None:
        """Answer the snapshot request `rid` with `msg` (None: an error reply)."""
        ...


def _codec_of(own: Codec, m: MassMeta) -> Codec | None:
    """The codec a MASS's payload decodes with: this peer's, or fp32 for a whole value that
    re-synchronises a lost reference (`differences.EXACT`); None when neither applies."""
    if m.codec == own.spec:
        return own
    return EXACT if m.codec == EXACT.spec and m.ref == -1 else None


class _Every:
    """Says when `interval_s` has passed since it last said so: a flood must not flood the log too."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last = -interval_s

    def due(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return False
        self._last = now
        return True


def _outcomes(seen_by: OrderedDict[tuple[str, int], OrderedDict[int, bool]], sender: str,
              inc: int) -> OrderedDict[int, bool]:
    """The outcomes remembered for one sender incarnation (the least recent forgotten past `_SEEN_SENDERS`)."""
    key = (sender, inc)
    seen = seen_by.get(key)
    if seen is None:
        seen = seen_by[key] = OrderedDict()
        while len(seen_by) > _SEEN_SENDERS:
            seen_by.popitem(last=False)
    else:
        seen_by.move_to_end(key)
    return seen


def _remember(seen: OrderedDict[int, bool], hid: int, applied: bool) -> None:
    seen[hid] = applied
    while len(seen) > _SEEN_PER_SENDER:
        seen.popitem(last=False)


@dataclass
class _Outstanding:
    peer: str
    deadline: float  # when the next CANCEL goes out


def _int(meta: dict[str, Any], key: str) -> int | None:
    v = meta.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


class PeerProtocol:
    """The push-sum protocol of one peer, run on its I/O thread; the queues are what the trainer reads."""

    def __init__(self, wire: Wire, *, experiment: str, peer_id: str, codec: Codec, ack_timeout_s: float,
                 limits: FrameLimits, numel: int | None, snapshot_bytes: int) -> None:
        self.wire = wire
        self.experiment = experiment
        self.peer_id = peer_id
        self.limits = limits
        self.incarnation = secrets.randbits(62)  # a restarted peer's ids must not look seen
        self.codec = codec
        self._ack_timeout = ack_timeout_s
        self.numel = numel
        self._snapshot_bytes = snapshot_bytes  # reserved of the reply budget for a full snapshot reply

        self.inbox: queue.SimpleQueue[Incoming] = queue.SimpleQueue()
        self.settled: queue.Queue[tuple[int, bool]] = queue.Queue()  # (hold id, restore?)
        self.stale_refs: queue.SimpleQueue[str] = queue.SimpleQueue()  # NACKed: reference not held
        # (identity, rid, requester, light: step and done only, no parameters)
        # (..., the reply budget it holds until answered)
        self.snap_requests: queue.SimpleQueue[tuple[bytes, int, str, SnapMeta, Reservation | None]] = queue.SimpleQueue()
        self.rejected: Counter[str] = Counter()
        self.duplicates = 0
        self.rare = _Every(_LOG_EVERY_S)  # the I/O thread's rate of lines about floods

        self.values = ReceivedValues(_SEEN_SENDERS)  # references of MASSes sent as differences
        self.generation = 0
        self.refusing = False  # finished: incoming mass goes back to its sender
        self._outstanding: dict[int, _Outstanding] = {}
        self._seen: OrderedDict[tuple[str, int], OrderedDict[int, bool]] = OrderedDict()

    def message(self, op: str, meta: dict[str, Any]) -> list[Any]:
        return encode(Message(op=op, experiment=self.experiment, sender=self.peer_id, meta=meta))

    # -- holds awaiting an answer --------------------------------------------------------
    def send_mass(self, peer: str, hid: int, frames: list[Any], raw_extra: int, info: dict[str, Any]) -> None:
        sock = self.wire.neighbour(peer, lambda: {o.peer for o in self._outstanding.values()})
        if sock is None:  # left the membership between send() and here (or cannot be dialled): take it back
            self.settled.put((hid, True))
            return
        self._outstanding[hid] = _Outstanding(peer, time.monotonic() + self._ack_timeout)
        self.wire.send(sock, None, frames, MASS, info, raw_extra)

    def due(self, due: float) -> float:
        """The earlier of `due` and the next CANCEL's time."""
        for out in self._outstanding.values():
            due = min(due, out.deadline)
        return due

    def cancel_overdue(self, now: float) -> None:
        """A CANCEL for each hold unanswered past its deadline (again each `ack_timeout_s`)."""
        for hid, out in self._outstanding.items():
            if out.deadline > now:
                continue
            out.deadline = now + self._ack_timeout
            dealer = self.wire.open_neighbour(out.peer)
            if dealer is not None:
                frames = self.message(CANCEL, {"id": hid, "inc": self.incarnation})
                self.wire.send(dealer, None, frames, CANCEL, {"peer": out.peer, "id": hid})

    def members_changed(self, gone: set[str], generation: int) -> None:
        """The sockets to `gone` closed: the trainer folds holds to those back itself; replies to them are stale."""
        for hid in [h for h, o in self._outstanding.items() if o.peer in gone]:
            del self._outstanding[hid]
        self.generation = generation

    # -- requests on the ROUTER -----------------------------------------------------------
    def _reply(self, identity: bytes, op: str, meta: dict[str, Any], to: str) -> None:
        self.wire.send(self.wire.router.socket, identity, self.message(op, meta), op, {"peer": to, **meta})

    def _refuse(self, identity: bytes, msg: Message | None, reason: str, text: str) -> None:
        """Count and log a refused request; NACK a MASS with an id, else an ERROR reply."""
        self.rejected[reason] += 1
        sender = msg.sender if msg is not None else "?"
        (logger.warning if self.rare.due() else logger.debug)(
            "gossip peer %s: refused %s from %r: %s", self.peer_id, msg.op if msg is not None else "a message",
            sender, text)
        meta = msg.meta if msg is not None else {}
        hid = _int(meta, "id")
        if msg is not None and msg.op == MASS and hid is not None:
            self._reply(identity, NACK, {"id": hid, "error": text, "reason": reason}, sender)
            return
        err: dict[str, Any] = {"error": text, "code": _CODE_OF_REASON.get(reason, FAILED_PRECONDITION),
                               "reason": reason}
        rid = _int(meta, "rid")
        if rid is not None:
            err["rid"] = rid
        self._reply(identity, ERROR, err, sender)

    def refusal_reply(self, identity: bytes, rid: Any, code: str, text: str) -> None:
        """ERROR to a request the router's gate refused before decoding (counted there); no
        ACK/NACK: nothing is decided about its mass, so a CANCEL later settles it exactly."""
        err: dict[str, Any] = {"error": text, "code": code, "reason": _REASON_OF_CODE.get(code, code)}
        if isinstance(rid, int) and not isinstance(rid, bool):
            err["rid"] = rid
        self._reply(identity, ERROR, err, "?")

    def on_request(self, frames: Sequence[Any]) -> None:
        router = self.wire.router
        admitted = router.admit(frames)
        if admitted is None:
            return
        identity, payload = admitted
        try:
            msg = decode(payload, self.limits)
        except ProtocolError as e:
            self._refuse(identity, None, "malformed", str(e))
            return
        if msg.experiment != self.experiment:
            self._refuse(
                identity,
                msg,
                "experiment",
                f"experiment {msg.experiment!r} is not {self.experiment!r}",
            )
        elif not router.speaks_for(router.peer_key(payload), msg.sender):
            # Before any outcome is remembered under that sender: a forger must not settle its mass.
            self._refuse(identity, msg, "unauthenticated",
                         f"this connection's CURVE key is not the key of peer {msg.sender!r}'s node")
        elif msg.op == MASS:
            self._on_mass(identity, msg)
        elif msg.op == CANCEL:
            self._on_cancel(identity, msg)
        elif msg.op == SNAP:
            try:
                snap = SnapMeta.from_meta(msg.meta)
            except ProtocolError as e:
                self._refuse(identity, msg, "malformed", str(e))
                return
            why = router.over_budget(identity)
            if why is not None:
                self._refuse(identity, msg, OVER_BUDGET, why)
                return
            reserved = router.reserve(identity, 0 if snap.light else self._snapshot_bytes)
            self.snap_requests.put((identity, msg.meta["rid"], msg.sender, snap, reserved))
        else:
            self._refuse(identity, msg, "unknown_op", f"unknown op {msg.op!r}")

    def _on_mass(self, identity: bytes, msg: Message) -> None:
        try:
            m = MassMeta.from_meta(msg.meta)
        except ProtocolError as e:
            self._refuse(identity, msg, "malformed", str(e))
            return
        hid, gen, weight, pmeta = m.id, m.gen, m.weight, m.payload
        seen = _outcomes(self._seen, msg.sender, m.inc)
        if hid in seen:  # a duplicate: answer as the first time
            self.duplicates += 1
            self._reply(identity, ACK if seen[hid] else NACK, {"id": hid}, msg.sender)
            return
        reason, text = "", ""
        if self.refusing:
            reason, text = "finished", "this peer has finished training and takes no more mass"
        elif gen != self.generation:
            reason, text = "generation", f"generation {gen}, this peer is at {self.generation}"
        elif self.numel is None:
            reason, text = "not_ready", "this peer does not know its parameter size yet"
        elif (codec := _codec_of(self.codec, m)) is None:
            reason, text = "codec", f"codec {msg.meta.get('codec')!r}, this peer uses {self.codec.spec!r}"
        elif not (math.isfinite(weight) and 0 < weight <= _MAX_WEIGHT):
            reason, text = "weight", f"weight {weight!r} is not in (0, {_MAX_WEIGHT:g}]"
        elif pmeta is None:
            reason, text = "malformed", "MASS payload meta must be a map"
        elif m.ref is not None and not self.values.holds(msg.sender, m.inc, m.ref):
            reason, text = "reference", f"reference MASS {m.ref} is not (or no longer) held"
        if reason:
            _remember(seen, hid, False)
            self._refuse(identity, msg, reason, text)
            return
        assert self.numel is not None and pmeta is not None and codec is not None
        try:
            # A difference is added to its reference at once (scratch); a whole value becomes the
            # next reference; a plain MASS is the mass, kept until the trainer mixes it.
            into = "difference" if m.ref is not None and m.ref >= 0 else "value" if m.ref is not None else "mass"
            d = codec.decode(Payload(msg.tensors, pmeta), (self.numel,), torch.float32,
                             out=self.values.buffers.take(into, torch.float32, self.numel))
        except ProtocolError as e:
            bad = "NaN" in str(e) or "beyond the fp32 range" in str(e)
            _remember(seen, hid, False)
            self._refuse(identity, msg, "nonfinite" if bad else "payload", str(e))
            return
        mass = d if m.ref is None else self.values.mass(msg.sender, m.inc, m.ref, hid, d, weight)
        _remember(seen, hid, mass is not None)
        if mass is None:
            self._refuse(identity, msg, "nonfinite", "the value decodes beyond the fp32 range")
            return
        self.inbox.put(Incoming(msg.sender, gen, m.step, weight, mass))
        self._reply(identity, ACK, {"id": hid}, msg.sender)

    def _on_cancel(self, identity: bytes, msg: Message) -> None:
        try:
            cancel = CancelMeta.from_meta(msg.meta)
        except ProtocolError as e:
            self._refuse(identity, msg, "malformed", str(e))
            return
        hid = cancel.id
        seen = _outcomes(self._seen, msg.sender, cancel.inc)
        if hid in seen:
            self._reply(identity, ACK if seen[hid] else NACK, {"id": hid}, msg.sender)
        else:  # never arrived: a late copy will be NACKed
            _remember(seen, hid, False)
            self._reply(identity, CANCELLED, {"id": hid}, msg.sender)

    # -- replies on the DEALERs -----------------------------------------------------------
    def on_reply(self, peer: str | None, frames: Sequence[Any]) -> None:
        """A reply on the socket to `peer` (None: a snapshot request's own socket)."""
        try:
            msg = decode(frames, self.limits)
        except ProtocolError as e:
            self.rejected["bad_reply"] += 1
            logger.warning("gossip peer %s: malformed reply from %r: %s", self.peer_id, peer, e)
            return
        if msg.experiment != self.experiment:
            self.rejected["bad_reply"] += 1
            return
        if msg.op in (ACK, NACK, CANCELLED):
            hid = _int(msg.meta, "id")
            out = self._outstanding.get(hid) if hid is not None else None
            if out is None or out.peer != peer:
                return  # a duplicate reply, or about a hold already folded back
            assert hid is not None
            del self._outstanding[hid]
            if msg.op == NACK:
                logger.info("gossip peer %s: %s NACKed mass %d: %s", self.peer_id, peer, hid, msg.meta.get("error", ""))
            if msg.op == NACK and msg.meta.get("reason") == "reference" and peer is not None:
                self.stale_refs.put(peer)  # before `settled`: the trainer drains both in order
            self.settled.put((hid, msg.op != ACK))
        elif msg.op in (SNAPSHOT, ERROR) and _int(msg.meta, "rid") is not None:
            if msg.op == ERROR:
                logger.warning("gossip peer %s: %r answered an error: %s", self.peer_id, peer, msg.meta.get("error"))
            self.wire.resolve(msg.meta["rid"], msg if msg.op == SNAPSHOT else None)
        else:
            if msg.op == ERROR:
                logger.warning("gossip peer %s: %r answered an error: %s", self.peer_id, peer, msg.meta.get("error"))
            self.rejected["bad_reply"] += 1
