"""The push-sum peer's I/O thread: it alone touches the ZMQ sockets and moves messages to queues.

Sockets: one ROUTER (bound) receives ``MASS``, ``CANCEL`` and ``SNAP`` from neighbours; one
DEALER per current neighbour sends ``MASS``/``CANCEL`` and receives the replies (``ACK``,
``NACK``, ``CANCELLED``); a short-lived DEALER per snapshot request. The thread validates
and decodes incoming mass (so it can ACK or NACK at once) but never reads or writes the
trainer's parameters: accepted mass goes to `PeerIO.inbox`, settled holds to
`PeerIO.settled`, snapshot requests to `PeerIO.snap_requests`, all consumed by the trainer.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import os
import queue
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from gossamer.compression import Codec, Payload
from gossamer.core.errors import AuthError, ProtocolError
from gossamer.core.protocol import CancelMeta, MassMeta, SnapMeta
from gossamer.gossip.differences import EXACT, ReceivedValues
from gossamer.gossip.neighbours import NeighbourSockets
from gossamer.security.curve import CurveKeyring, HandshakeMonitor
from gossamer.transport.frames import FrameLimits, Message, decode, encode, frames_nbytes
from gossamer.transport.outgoing import OutgoingReplies, ReplyBudget, Reservation, track
from gossamer.transport.ratelimit import RateLimit
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
    configure_socket,
)

__all__ = [
    "ACK",
    "CANCEL",
    "CANCELLED",
    "ERROR",
    "MASS",
    "NACK",
    "SNAP",
    "SNAPSHOT",
    "Fault",
    "Incoming",
    "PeerIO",
]

logger = logging.getLogger(__name__)

MASS, ACK, NACK, CANCEL, CANCELLED = "MASS", "ACK", "NACK", "CANCEL", "CANCELLED"
SNAP, SNAPSHOT, ERROR = "SNAP", "SNAPSHOT", "ERROR"

#: A test hook called before each outgoing message with (op, info): None, "drop" or "delay:S".
Fault = Callable[[str, dict[str, Any]], str | None]

_MAX_POLL_S = 0.1
_RECV_BATCH = 256
# Outcomes remembered per sender incarnation: a CANCELLED id must outlive any late copy of
# its MASS, or the late copy would be applied after the sender took the mass back.
_SEEN_PER_SENDER = 1 << 16
_SEEN_SENDERS = 1024
#: Push-sum weights start at 1 per peer and only move between peers, so none exceeds the number
#: of peers; one far above it (1e308 passed as finite) left the receiver unable to send again.
_MAX_WEIGHT = float(1 << 20)
_REDIAL_S = 1.0  # after a refused handshake, a neighbour's socket is opened again this often
_LOG_EVERY_S = 5.0
#: Why a snapshot request was refused: the connection, or the peer, holds its most in unread replies.
OVER_BUDGET = "reply_budget"
#: A snapshot reply's reservation of the reply budget and the storage of the values it references.
_Budgeted = tuple[Reservation | None, int | None]
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


def _send_budgeted(router: Router, identity: bytes, frames: list[Any], reply: _Budgeted) -> int | None:
    """Send a snapshot reply held against `router`'s reply budget (its tensors tracked); its size, or None: dropped."""
    reserved, shared = reply
    n = frames_nbytes(frames)
    if len(frames) > 1:  # tensors: held until ZMQ lets go of them
        frames, tracker = track(frames)
        sent = router.send_tracked(identity, frames, tracker, n, shared=shared, reserved=reserved)
    else:
        sent = router.send_tracked(identity, frames, None, n, reserved=reserved)
    return n if sent else None


@dataclass
class _Outstanding:
    peer: str
    deadline: float  # when the next CANCEL goes out


def _int(meta: dict[str, Any], key: str) -> int | None:
    v = meta.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


class PeerIO:
    """The socket side of a `PushSumPeer`; methods without a leading underscore are for the
    trainer thread (they only enqueue), everything else runs on the I/O thread."""

    def __init__(
        self,
        *,
        experiment: str,
        peer_id: str,
        host: str,
        codec: Codec,
        ack_timeout_s: float,
        limits: FrameLimits,
        fault: Fault | None,
        numel: int | None,
        curve: CurveKeyring | None = None,
        rate_limit: RateLimit | None = None,
        reply_budget: ReplyBudget | None = None,
    ) -> None:
        self.experiment = experiment
        self.peer_id = peer_id
        self.limits = limits
        self.incarnation = secrets.randbits(62)  # a restarted peer's ids must not look seen
        self.codec = codec
        self._ack_timeout = ack_timeout_s
        self._fault = fault
        self._numel = numel

        self.inbox: queue.SimpleQueue[Incoming] = queue.SimpleQueue()
        self.settled: queue.Queue[tuple[int, bool]] = queue.Queue()  # (hold id, restore?)
        self.stale_refs: queue.SimpleQueue[str] = queue.SimpleQueue()  # NACKed: reference not held
        # (identity, rid, requester, light: step and done only, no parameters)
        # (..., the reply budget it holds until answered)
        self.snap_requests: queue.SimpleQueue[tuple[bytes, int, str, SnapMeta, Reservation | None]] = queue.SimpleQueue()
        self.bytes_up = 0
        self.bytes_down = 0
        self.raw_bytes_up = 0
        self.rejected: Counter[str] = Counter()
        self.duplicates = 0
        self.fault_dropped = 0
        self.send_failures = 0
        self.handshake_failures = 0  # our connections a neighbour refused (CURVE key, mechanism)
        self._curve = curve
        self._rare = _Every(_LOG_EVERY_S)

        # A snapshot reply is one fp32 copy of z; the only large reply a peer sends.
        self._snapshot_bytes = 4 * numel if numel else limits.max_message_bytes
        outgoing = OutgoingReplies(reply_budget, self._snapshot_bytes) if reply_budget is not None else None
        self._ctx = zmq.Context()
        try:
            self._router = Router(self._ctx, name=f"gossip peer {peer_id}", limits=limits,
                                  refusal_reply=self._refusal_reply, curve=curve, rate_limit=rate_limit,
                                  refused=self.rejected, outgoing=outgoing)
        except zmq.ZMQError:
            self._ctx.term()
            raise
        try:
            self.endpoint = self._router.bind(host)
        except zmq.ZMQError:
            self._router.close()
            self._ctx.term()
            raise
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        self._wake_pending = False  # a byte is in the pipe: the loop will run commands
        self._wake_lock = threading.Lock()
        self._closed = False
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._waiters: dict[int, Future[Message | None]] = {}
        self._waiters_lock = threading.Lock()

        # I/O-thread state.
        self._values = ReceivedValues(_SEEN_SENDERS)  # references of MASSes sent as differences
        self._generation = 0
        self._refusing = False  # finished: incoming mass goes back to its sender
        self._dealers = NeighbourSockets(self._dial, self._close)
        self._sock_peer: dict[zmq.Socket, str | None] = {}  # DEALER -> neighbour (None: snapshot)
        self._snap_socks: dict[int, zmq.Socket] = {}
        self._watch: dict[zmq.Socket, HandshakeMonitor] = {}  # DEALER -> its handshake monitor
        self._watched: dict[zmq.Socket, zmq.Socket] = {}  # monitor socket -> DEALER
        self._redial: dict[str, float] = {}  # neighbour -> when to open a new socket to it
        self._outstanding: dict[int, _Outstanding] = {}
        self._delayed: list[tuple[float, int, zmq.Socket, bytes | None, list[Any], int, _Budgeted | None]] = []
        self._seq = itertools.count()
        self._seen: OrderedDict[tuple[str, int], OrderedDict[int, bool]] = OrderedDict()
        self._poller = zmq.Poller()
        self._thread = threading.Thread(target=self._run, name=f"gossip-io-{peer_id}", daemon=True)
        self._thread.start()

    @property
    def refused_handshakes(self) -> int:
        """CURVE handshakes the ZAP handler refused (keys of non-members)."""
        return self._router.curve_refused

    # -- trainer side ------------------------------------------------------------------
    def post(self, *command: Any) -> None:
        """Hand a command to the I/O thread and wake it."""
        self._commands.put(command)
        if self._wake_pending:
            return  # os.write releases the GIL: skip it when the loop is already woken
        self._wake_pending = True
        with self._wake_lock:  # close() may be closing the pipe (and its fd be reused)
            if not self._closed:
                with contextlib.suppress(BlockingIOError):  # a full pipe wakes the loop too
                    os.write(self._wake_w, b"\0")

    def request(self, rid: int, endpoint: str, frames: list[Any]) -> Future[Message | None]:
        """Send a SNAP on a fresh DEALER; the future gets the reply (None: an error reply)."""
        fut: Future[Message | None] = Future()
        with self._waiters_lock:
            self._waiters[rid] = fut
        self.post("snap", rid, endpoint, frames)
        return fut

    def forget(self, rid: int) -> None:
        with self._waiters_lock:
            self._waiters.pop(rid, None)
        self.post("snap_done", rid)

    def close(self) -> None:
        self.post("stop")
        self._thread.join(timeout=10)
        self._router.stop_auth()
        if self._thread.is_alive():  # never seen; destroying closes the sockets under it
            logger.error("gossip peer %s: I/O thread did not stop", self.peer_id)
            self._ctx.destroy(linger=0)
        else:
            self._ctx.term()
        with self._wake_lock:
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)
        with self._waiters_lock:
            waiters, self._waiters = self._waiters, {}
        for fut in waiters.values():
            if not fut.done():
                fut.set_result(None)

    # -- the loop ----------------------------------------------------------------------
    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        configure_socket(sock, self.limits)
        return sock

    def _run(self) -> None:
        self._poller.register(self._router.socket, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        try:
            while True:
                try:
                    ready = dict(self._poller.poll(self._poll_ms()))
                    if self._wake_r in ready:
                        with contextlib.suppress(BlockingIOError):
                            while os.read(self._wake_r, 4096):
                                pass
                        # After draining, before running the commands: a post() that saw
                        # the flag still set has queued its command already.
                        self._wake_pending = False
                    if not self._run_commands():
                        return
                    for sock in ready:
                        if sock is self._router.socket:
                            self._receive(sock, self._on_request)
                        elif sock in self._watched:
                            self._on_handshake_event(sock)
                        elif isinstance(sock, zmq.Socket) and not sock.closed:
                            self._receive(sock, self._on_reply)
                    self._on_timers(time.monotonic())
                except Exception:  # keep the peer alive whatever one message did
                    logger.exception("gossip peer %s: error in the I/O loop", self.peer_id)
                    time.sleep(0.01)
        finally:
            for watch in self._watch.values():
                watch.close()
            self._router.close_socket()
            for sock in list(self._sock_peer):
                sock.close(linger=0)

    def _poll_ms(self) -> int:
        now = time.monotonic()
        due = now + _MAX_POLL_S
        if self._delayed:
            due = min(due, self._delayed[0][0])
        for out in self._outstanding.values():
            due = min(due, out.deadline)
        for at in self._redial.values():
            due = min(due, at)
        return max(0, math.ceil((due - now) * 1000))

    def _run_commands(self) -> bool:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True
            kind = cmd[0]
            if kind == "stop":
                return False
            try:
                if kind == "mass":
                    self._send_mass(*cmd[1:])
                elif kind == "reply":
                    _, identity, frames, info, reserved, shared = cmd
                    self._send(self._router.socket, identity, frames, SNAPSHOT, info, reply=(reserved, shared))
                elif kind == "members":
                    self._set_members(cmd[1], cmd[2])
                elif kind == "numel":
                    self._numel = cmd[1]
                elif kind == "refuse_mass":
                    self._refusing = True
                elif kind == "snap":
                    self._start_snapshot(cmd[1], cmd[2], cmd[3])
                elif kind == "snap_done":
                    sock = self._snap_socks.pop(cmd[1], None)
                    if sock is not None:
                        self._close(sock)
            except Exception:
                logger.exception("gossip peer %s: command %r failed", self.peer_id, kind)

    def _receive(self, sock: zmq.Socket, handler: Callable[[zmq.Socket, list[Any]], None]) -> None:
        for _ in range(_RECV_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.bytes_down += frames_nbytes(frames)
            try:
                handler(sock, frames)
            except Exception:
                self.rejected["internal"] += 1
                logger.exception("gossip peer %s: error handling a message", self.peer_id)
            if sock.closed:  # a handler may close a snapshot socket
                return

    # -- sending -----------------------------------------------------------------------
    def _send(
        self,
        sock: zmq.Socket,
        identity: bytes | None,
        frames: list[Any],
        op: str,
        info: dict[str, Any],
        raw_extra: int = 0,
        reply: _Budgeted | None = None,
    ) -> None:
        """`reply`: a snapshot reply's (reservation, storage of its values), held against the budget."""
        decision = None
        if self._fault is not None:
            try:
                decision = self._fault(op, dict(info))
            except Exception:
                logger.exception("gossip peer %s: fault hook failed", self.peer_id)
        if decision == "drop":
            self.fault_dropped += 1
            if reply is not None:
                self._router.release(reply[0])
            return
        if decision and decision.startswith("delay:"):
            due = time.monotonic() + float(decision.split(":", 1)[1])
            heapq.heappush(self._delayed, (due, next(self._seq), sock, identity, frames, raw_extra, reply))
            return
        self._send_now(sock, identity, frames, raw_extra, reply)

    def _send_now(
        self, sock: zmq.Socket, identity: bytes | None, frames: list[Any], raw_extra: int,
        reply: _Budgeted | None = None,
    ) -> None:
        if sock.closed:
            if reply is not None:
                self._router.release(reply[0])
            return
        if reply is not None and identity is not None:
            sent = _send_budgeted(self._router, identity, frames, reply)
            if sent is None:
                self.send_failures += 1
            else:
                self.bytes_up += sent
                self.raw_bytes_up += sent + raw_extra
            return
        try:
            sock.send_multipart(
                [identity, *frames] if identity else frames, zmq.NOBLOCK, copy=False
            )
        except zmq.ZMQError as e:
            self.send_failures += 1
            if self._rare.due():  # a peer that never reads fills its queue: one line per interval, not per reply
                logger.warning("gossip peer %s: send failed: %s (%d so far)", self.peer_id, e, self.send_failures)
            return
        n = frames_nbytes(frames)
        self.bytes_up += n
        self.raw_bytes_up += n + raw_extra

    def _message(self, op: str, meta: dict[str, Any]) -> list[Any]:
        return encode(Message(op=op, experiment=self.experiment, sender=self.peer_id, meta=meta))

    def _send_mass(
        self, peer: str, hid: int, frames: list[Any], raw_extra: int, info: dict[str, Any]
    ) -> None:
        sock = self._dealers.for_send(peer, lambda: {o.peer for o in self._outstanding.values()} | set(self._redial))
        if sock is None:  # left the membership between send() and here (or cannot be dialled): take it back
            self.settled.put((hid, True))
            return
        self._outstanding[hid] = _Outstanding(peer, time.monotonic() + self._ack_timeout)
        self._send(sock, None, frames, MASS, info, raw_extra)

    def _on_timers(self, now: float) -> None:
        for pid, at in list(self._redial.items()):
            if at > now:
                continue
            del self._redial[pid]
            self._dealers.redial(pid)
        while self._delayed and self._delayed[0][0] <= now:
            _, _, sock, identity, frames, raw_extra, reply = heapq.heappop(self._delayed)
            self._send_now(sock, identity, frames, raw_extra, reply)
        for hid, out in self._outstanding.items():
            if out.deadline > now:
                continue
            out.deadline = now + self._ack_timeout
            dealer = self._dealers.get(out.peer)
            if dealer is not None:
                frames = self._message(CANCEL, {"id": hid, "inc": self.incarnation})
                self._send(dealer, None, frames, CANCEL, {"peer": out.peer, "id": hid})

    # -- membership and snapshots --------------------------------------------------------
    @property
    def buffers_reused(self) -> int:
        """How many received values and masses went into a buffer taken again (read from any thread)."""
        return self._values.buffers.reused

    def _close(self, sock: zmq.Socket) -> None:
        watch = self._watch.pop(sock, None)
        if watch is not None:
            self._watched.pop(watch.socket, None)
            with contextlib.suppress(KeyError, zmq.ZMQError):
                self._poller.unregister(watch.socket)
            watch.close()
        with contextlib.suppress(KeyError, zmq.ZMQError):
            self._poller.unregister(sock)
        self._sock_peer.pop(sock, None)
        sock.close(linger=0)

    def _connect(self, endpoint: str, peer: str | None) -> zmq.Socket:
        """A DEALER to `endpoint` (raises zmq.ZMQError, or AuthError without a CURVE key for it)."""
        sock = self._socket(zmq.DEALER)
        try:
            if self._curve is not None:
                self._curve.secure_client(sock, endpoint)
            # Watched: a refused handshake is otherwise silence (no cost per message).
            watch = HandshakeMonitor(sock)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError:
                watch.close()
                raise
        except (zmq.ZMQError, AuthError):
            sock.close(linger=0)
            raise
        self._watch[sock] = watch
        self._watched[watch.socket] = sock
        self._poller.register(watch.socket, zmq.POLLIN)
        self._poller.register(sock, zmq.POLLIN)
        self._sock_peer[sock] = peer
        return sock

    def _dial(self, pid: str, endpoint: str) -> zmq.Socket | None:
        try:
            return self._connect(endpoint, pid)
        except (zmq.ZMQError, AuthError) as e:
            logger.error("gossip peer %s: cannot connect to %s at %r: %s", self.peer_id, pid, endpoint, e)
            return None

    @property
    def connections(self) -> int:
        """Neighbour sockets open now."""
        return len(self._dealers)

    def _on_handshake_event(self, monitor: zmq.Socket) -> None:
        sock = self._watched.get(monitor)
        watch = self._watch.get(sock) if sock is not None else None
        if sock is None or watch is None:
            return
        was = watch.failure
        failure = watch.check()
        if failure is None or failure == was:
            return
        self.handshake_failures += 1
        peer = self._sock_peer.get(sock)
        logger.error("gossip peer %s: %s did not complete the ZMQ handshake: %s", self.peer_id,
                     f"neighbour {peer}" if peer is not None else "a snapshot request", failure)
        if peer is None:  # a snapshot request: fail it now rather than at its timeout
            rid = next((r for r, s in self._snap_socks.items() if s is sock), None)
            if rid is not None:
                self._resolve(rid, None)
        elif watch.fatal and peer not in self._redial:
            # libzmq gave up on this connection; the neighbour may not have heard of our
            # key yet. Mass sent meanwhile is lost on the wire and comes back by CANCEL.
            self._redial[peer] = time.monotonic() + _REDIAL_S

    def _set_members(self, peers: dict[str, str], generation: int) -> None:
        gone = set(self._dealers.set_members(peers))
        # The trainer folds holds to those back itself; replies to them are now stale.
        for hid in [h for h, o in self._outstanding.items() if o.peer in gone]:
            del self._outstanding[hid]
        for pid in [p for p in self._redial if p not in self._dealers]:
            del self._redial[pid]
        self._generation = generation

    def _start_snapshot(self, rid: int, endpoint: str, frames: list[Any]) -> None:
        with self._waiters_lock:
            if rid not in self._waiters:  # the requester gave up already
                return
        try:
            sock = self._connect(endpoint, None)
        except (zmq.ZMQError, AuthError) as e:
            logger.warning(
                "gossip peer %s: bad snapshot endpoint %r: %s", self.peer_id, endpoint, e
            )
            self._resolve(rid, None)
            return
        self._snap_socks[rid] = sock
        self._send(sock, None, frames, SNAP, {"endpoint": endpoint, "rid": rid})

    def _resolve(self, rid: int, msg: Message | None) -> None:
        with self._waiters_lock:
            fut = self._waiters.get(rid)
        if fut is not None and not fut.done():
            fut.set_result(msg)
        sock = self._snap_socks.pop(rid, None)
        if sock is not None:
            self._close(sock)

    # -- receiving: requests on the ROUTER -----------------------------------------------
    def _reply(self, identity: bytes, op: str, meta: dict[str, Any], to: str) -> None:
        self._send(self._router.socket, identity, self._message(op, meta), op, {"peer": to, **meta})

    def _refuse(self, identity: bytes, msg: Message | None, reason: str, text: str) -> None:
        """Count and log a refused request; NACK a MASS with an id, else an ERROR reply."""
        self.rejected[reason] += 1
        sender = msg.sender if msg is not None else "?"
        (logger.warning if self._rare.due() else logger.debug)(
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

    def _refusal_reply(self, identity: bytes, rid: Any, code: str, text: str) -> None:
        """ERROR to a request the router's gate refused before decoding (counted there); no
        ACK/NACK: nothing is decided about its mass, so a CANCEL later settles it exactly."""
        err: dict[str, Any] = {"error": text, "code": code, "reason": _REASON_OF_CODE.get(code, code)}
        if isinstance(rid, int) and not isinstance(rid, bool):
            err["rid"] = rid
        self._reply(identity, ERROR, err, "?")

    def _on_request(self, _sock: zmq.Socket, frames: Sequence[Any]) -> None:
        admitted = self._router.admit(frames)
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
        elif not self._router.speaks_for(self._router.peer_key(payload), msg.sender):
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
            why = self._router.over_budget(identity)
            if why is not None:
                self._refuse(identity, msg, OVER_BUDGET, why)
                return
            reserved = self._router.reserve(identity, 0 if snap.light else self._snapshot_bytes)
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
        if self._refusing:
            reason, text = "finished", "this peer has finished training and takes no more mass"
        elif gen != self._generation:
            reason, text = "generation", f"generation {gen}, this peer is at {self._generation}"
        elif self._numel is None:
            reason, text = "not_ready", "this peer does not know its parameter size yet"
        elif (codec := _codec_of(self.codec, m)) is None:
            reason, text = "codec", f"codec {msg.meta.get('codec')!r}, this peer uses {self.codec.spec!r}"
        elif not (math.isfinite(weight) and 0 < weight <= _MAX_WEIGHT):
            reason, text = "weight", f"weight {weight!r} is not in (0, {_MAX_WEIGHT:g}]"
        elif pmeta is None:
            reason, text = "malformed", "MASS payload meta must be a map"
        elif m.ref is not None and not self._values.holds(msg.sender, m.inc, m.ref):
            reason, text = "reference", f"reference MASS {m.ref} is not (or no longer) held"
        if reason:
            _remember(seen, hid, False)
            self._refuse(identity, msg, reason, text)
            return
        assert self._numel is not None and pmeta is not None and codec is not None
        try:
            # A difference is added to its reference at once (scratch); a whole value becomes the
            # next reference; a plain MASS is the mass, kept until the trainer mixes it.
            into = "difference" if m.ref is not None and m.ref >= 0 else "value" if m.ref is not None else "mass"
            d = codec.decode(Payload(msg.tensors, pmeta), (self._numel,), torch.float32,
                             out=self._values.buffers.take(into, torch.float32, self._numel))
        except ProtocolError as e:
            bad = "NaN" in str(e) or "beyond the fp32 range" in str(e)
            _remember(seen, hid, False)
            self._refuse(identity, msg, "nonfinite" if bad else "payload", str(e))
            return
        mass = d if m.ref is None else self._values.mass(msg.sender, m.inc, m.ref, hid, d, weight)
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

    # -- receiving: replies on the DEALERs -------------------------------------------------
    def _on_reply(self, sock: zmq.Socket, frames: Sequence[Any]) -> None:
        peer = self._sock_peer.get(sock)
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
            self._resolve(msg.meta["rid"], msg if msg.op == SNAPSHOT else None)
        else:
            if msg.op == ERROR:
                logger.warning("gossip peer %s: %r answered an error: %s", self.peer_id, peer, msg.meta.get("error"))
            self.rejected["bad_reply"] += 1
