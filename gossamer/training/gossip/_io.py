"""The push-sum peer's I/O thread: it alone touches the ZMQ sockets and moves messages to queues.

Sockets: one ROUTER (bound) receives ``MASS``, ``CANCEL`` and ``SNAP`` from neighbours; one
DEALER per current neighbour sends ``MASS``/``CANCEL`` and receives the replies (``ACK``,
``NACK``, ``CANCELLED``); a short-lived DEALER per snapshot request. What each message means
is `PeerProtocol`'s (`_peer_protocol.py`), run on this thread: it validates and decodes
incoming mass (so it can ACK or NACK at once) but never reads or writes the trainer's
parameters: accepted mass goes to `PeerIO.inbox`, settled holds to `PeerIO.settled`,
snapshot requests to `PeerIO.snap_requests`, all consumed by the trainer.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from gossamer.compression import Codec
from gossamer.core.errors import AuthError
from gossamer.security.curve import CurveKeyring, HandshakeMonitor
from gossamer.training.gossip._peer_protocol import (
    ACK,
    CANCEL,
    CANCELLED,
    ERROR,
    MASS,
    NACK,
    SNAP,
    SNAPSHOT,
    Incoming,
    PeerProtocol,
)
from gossamer.training.gossip.neighbours import NeighbourSockets
from gossamer.transport.frames import FrameLimits, Message, frames_nbytes
from gossamer.transport.outgoing import OutgoingReplies, ReplyBudget, Reservation, track
from gossamer.transport.ratelimit import RateLimit
from gossamer.transport.router import Router, configure_socket

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

#: A test hook called before each outgoing message with (op, info): None, "drop" or "delay:S".
Fault = Callable[[str, dict[str, Any]], str | None]

_MAX_POLL_S = 0.1
_RECV_BATCH = 256
_REDIAL_S = 1.0  # after a refused handshake, a neighbour's socket is opened again this often
#: A snapshot reply's reservation of the reply budget and the storage of the values it references.
_Budgeted = tuple[Reservation | None, int | None]


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


class PeerIO:
    """The socket side of a `PushSumPeer`; methods without a leading underscore are for the
    trainer thread (they only enqueue), everything else runs on the I/O thread (the `Wire` that
    `protocol` sends on: `router`, `send`, `neighbour`, `open_neighbour`, `resolve`)."""

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
        self.peer_id = peer_id
        self.limits = limits
        self._fault = fault
        # A snapshot reply is one fp32 copy of z; the only large reply a peer sends.
        snapshot_bytes = 4 * numel if numel else limits.max_message_bytes
        self.protocol = PeerProtocol(self, experiment=experiment, peer_id=peer_id, codec=codec,
                                     ack_timeout_s=ack_timeout_s, limits=limits, numel=numel,
                                     snapshot_bytes=snapshot_bytes)
        # What the trainer reads: the protocol's own queues and counts.
        self.incarnation = self.protocol.incarnation
        self.inbox = self.protocol.inbox
        self.settled = self.protocol.settled
        self.stale_refs = self.protocol.stale_refs
        self.snap_requests = self.protocol.snap_requests
        self.rejected = self.protocol.rejected
        self.bytes_up = 0
        self.bytes_down = 0
        self.raw_bytes_up = 0
        self.fault_dropped = 0
        self.send_failures = 0
        self.handshake_failures = 0  # our connections a neighbour refused (CURVE key, mechanism)
        self._curve = curve

        outgoing = OutgoingReplies(reply_budget, snapshot_bytes) if reply_budget is not None else None
        self._ctx = zmq.Context()
        try:
            self._router = Router(self._ctx, name=f"gossip peer {peer_id}", limits=limits,
                                  refusal_reply=self.protocol.refusal_reply, curve=curve, rate_limit=rate_limit,
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
        self._dealers = NeighbourSockets(self._dial, self._close)
        self._sock_peer: dict[zmq.Socket, str | None] = {}  # DEALER -> neighbour (None: snapshot)
        self._snap_socks: dict[int, zmq.Socket] = {}
        self._watch: dict[zmq.Socket, HandshakeMonitor] = {}  # DEALER -> its handshake monitor
        self._watched: dict[zmq.Socket, zmq.Socket] = {}  # monitor socket -> DEALER
        self._redial: dict[str, float] = {}  # neighbour -> when to open a new socket to it
        self._delayed: list[tuple[float, int, zmq.Socket, bytes | None, list[Any], int, _Budgeted | None]] = []
        self._seq = itertools.count()
        self._poller = zmq.Poller()
        self._thread = threading.Thread(target=self._run, name=f"gossip-io-{peer_id}", daemon=True)
        self._thread.start()

    @property
    def router(self) -> Router:
        return self._router

    @property
    def refused_handshakes(self) -> int:
        """CURVE handshakes the ZAP handler refused (keys of non-members)."""
        return self._router.curve_refused

    @property
    def duplicates(self) -> int:
        """MASSes and CANCELs that came again, answered as the first time."""
        return self.protocol.duplicates

    @property
    def buffers_reused(self) -> int:
        """How many received values and masses went into a buffer taken again (read from any thread)."""
        return self.protocol.values.buffers.reused

    @property
    def connections(self) -> int:
        """Neighbour sockets open now."""
        return len(self._dealers)

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
        due = self.protocol.due(due)
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
                    self.protocol.send_mass(*cmd[1:])
                elif kind == "reply":
                    _, identity, frames, info, reserved, shared = cmd
                    self.send(self._router.socket, identity, frames, SNAPSHOT, info, reply=(reserved, shared))
                elif kind == "members":
                    self._set_members(cmd[1], cmd[2])
                elif kind == "numel":
                    self.protocol.numel = cmd[1]
                elif kind == "refuse_mass":
                    self.protocol.refusing = True
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

    def _on_request(self, _sock: zmq.Socket, frames: list[Any]) -> None:
        self.protocol.on_request(frames)

    def _on_reply(self, sock: zmq.Socket, frames: list[Any]) -> None:
        self.protocol.on_reply(self._sock_peer.get(sock), frames)

    def _on_timers(self, now: float) -> None:
        for pid, at in list(self._redial.items()):
            if at > now:
                continue
            del self._redial[pid]
            self._dealers.redial(pid)
        while self._delayed and self._delayed[0][0] <= now:
            _, _, sock, identity, frames, raw_extra, reply = heapq.heappop(self._delayed)
            self._send_now(sock, identity, frames, raw_extra, reply)
        self.protocol.cancel_overdue(now)

    # -- sending -----------------------------------------------------------------------
    def send(
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
            if self.protocol.rare.due():  # a peer that never reads fills its queue: one line per interval, not per reply
                logger.warning("gossip peer %s: send failed: %s (%d so far)", self.peer_id, e, self.send_failures)
            return
        n = frames_nbytes(frames)
        self.bytes_up += n
        self.raw_bytes_up += n + raw_extra

    # -- neighbours and snapshots ----------------------------------------------------------
    def neighbour(self, peer: str, busy: Callable[[], set[str]]) -> zmq.Socket | None:
        """The socket to member `peer`, dialled now if need be; past the cap an idle one not in `busy()` (nor
        due for a redial) is closed first (None: not a member, or undiallable)."""
        return self._dealers.for_send(peer, lambda: busy() | set(self._redial))

    def open_neighbour(self, peer: str) -> zmq.Socket | None:
        return self._dealers.get(peer)

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
                self.resolve(rid, None)
        elif watch.fatal and peer not in self._redial:
            # libzmq gave up on this connection; the neighbour may not have heard of our
            # key yet. Mass sent meanwhile is lost on the wire and comes back by CANCEL.
            self._redial[peer] = time.monotonic() + _REDIAL_S

    def _set_members(self, peers: dict[str, str], generation: int) -> None:
        gone = set(self._dealers.set_members(peers))
        self.protocol.members_changed(gone, generation)
        for pid in [p for p in self._redial if p not in self._dealers]:
            del self._redial[pid]

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
            self.resolve(rid, None)
            return
        self._snap_socks[rid] = sock
        self.send(sock, None, frames, SNAP, {"endpoint": endpoint, "rid": rid})

    def resolve(self, rid: int, msg: Message | None) -> None:
        """Answer the snapshot request `rid` with `msg` (None: an error reply) and close its socket."""
        with self._waiters_lock:
            fut = self._waiters.get(rid)
        if fut is not None and not fut.done():
            fut.set_result(msg)
        sock = self._snap_socks.pop(rid, None)
        if sock is not None:
            self._close(sock)
