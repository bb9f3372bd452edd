"""The node agent's heartbeats, sent from their own thread and channel on a fixed cadence, over UDP when the coordinator offers it."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from gossamer.node.beat_sender import UdpBeats, wait_for_replies
from gossamer.security.channel import ChannelSecurity, open_channel
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

#: (send time on the monotonic clock, the coordinator's `known` answer or the call's error)
Answer = Callable[[float, "bool | grpc.RpcError"], None]
#: How often a thread waiting on UDP replies looks whether it was stopped.
STOP_POLL_S = 0.25


class HeartbeatThread:
    """Sends `Heartbeat` every `interval()` seconds and hands each answer to `on_answer` on `loop`.

    The agent's event loop is held while it starts role processes (a fork server's answer, on
    a loaded machine seconds); heartbeats behind it arrived late and the coordinator, rightly
    by its lease, counted a live node lost. Here nothing but the heartbeat waits on this
    thread. The answer still goes through the loop: only the loop writes to the shards' pipes,
    so a held loop renews their lease late, which fences them early, never late.

    With `udp` (keyed by the agent's Join and by Heartbeat answers), a tick sends one datagram
    and, while UDP answers, no gRPC call; an answered beat is handed on as a `known` answer.
    Without a key (a coordinator serving no UDP) every tick is the gRPC call, as it always was.
    """

    def __init__(self, address: str | Sequence[str], security: ChannelSecurity | None, *,
                 node_id: Callable[[], str], interval: Callable[[], float], on_answer: Answer,
                 loop: asyncio.AbstractEventLoop, udp: UdpBeats | None = None) -> None:
        self._address, self._security, self._udp = address, security, udp
        self._node_id, self._interval, self._on_answer, self._loop = node_id, interval, on_answer, loop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gossamer-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Send no more (the call in flight, if any, ends within its deadline)."""
        self._stop.set()

    def _run(self) -> None:
        channel = open_channel(self._address, self._security)
        stub = pb_grpc.NodeServiceStub(channel)
        try:
            due = time.monotonic() + self._interval()
            while True:
                start = time.monotonic()
                if self._wait(due):
                    return
                woke, interval = time.monotonic(), self._interval()
                late = woke - max(due, start)
                if late >= max(1.0, interval):  # says, in a loss's aftermath, which side was late
                    log.warning("heartbeat %.1fs late: this agent was not scheduled (the machine is overloaded)", late)
                # A fixed cadence: a slow answer does not push the next heartbeat back (nor do they bunch up).
                due = max(due + interval, woke)
                sent = time.monotonic()
                if self._udp is not None and not self._udp.beat(self._node_id(), sent, interval):
                    continue  # UDP answers: its reply is the answer
                answer: bool | grpc.RpcError
                try:
                    resp = stub.Heartbeat(pb.HeartbeatRequest(node_id=self._node_id()), timeout=interval * 3)
                    answer = resp.known
                    if self._udp is not None and resp.known:
                        self._udp.rekey(resp.beat_port, resp.beat_key)
                except grpc.RpcError as e:
                    answer = e
                if self._udp is not None:
                    self._udp.grpc_done(time.monotonic() - sent, answered=answer is True, interval=interval)
                if self._stop.is_set() or not self._hand_on(sent, answer):
                    return
        finally:
            channel.close()
            if self._udp is not None:
                self._udp.close()

    def _hand_on(self, sent: float, answer: bool | grpc.RpcError) -> bool:
        """`answer` to the agent's loop; False once that loop is closed."""
        try:
            self._loop.call_soon_threadsafe(self._on_answer, sent, answer)
        except RuntimeError:
            return False
        return True

    def _wait(self, due: float) -> bool:
        """Wait until `due` (monotonic), handing UDP replies on as they come; True once stopped.

        Returns early when a reply says the node is not known: the next tick, at once, asks gRPC.
        """
        udp = self._udp
        while True:
            left = due - time.monotonic()
            socks = udp.sockets() if udp is not None else []
            if udp is None or not socks:
                return self._stop.wait(max(0.0, left))
            if left > 0 and wait_for_replies(socks, min(left, STOP_POLL_S)):
                now = time.monotonic()
                for sent in udp.replies(now, self._interval()):
                    if not self._hand_on(sent, True):
                        return True
            if self._stop.is_set():
                return True
            if left <= 0 or udp.urgent:
                return False
