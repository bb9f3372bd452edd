"""The node agent's heartbeats, sent from their own thread and channel on a fixed cadence."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from gossamer.security.channel import ChannelSecurity, open_channel
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

#: (send time on the monotonic clock, the coordinator's `known` answer or the call's error)
Answer = Callable[[float, "bool | grpc.RpcError"], None]


class HeartbeatThread:
    """Sends `Heartbeat` every `interval()` seconds and hands each answer to `on_answer` on `loop`.

    The agent's event loop is held while it starts role processes (a fork server's answer, on
    a loaded machine seconds); heartbeats behind it arrived late and the coordinator, rightly
    by its lease, counted a live node lost. Here nothing but the heartbeat waits on this
    thread. The answer still goes through the loop: only the loop writes to the shards' pipes,
    so a held loop renews their lease late, which fences them early, never late.
    """

    def __init__(self, address: str | Sequence[str], security: ChannelSecurity | None, *,
                 node_id: Callable[[], str], interval: Callable[[], float], on_answer: Answer,
                 loop: asyncio.AbstractEventLoop) -> None:
        self._address, self._security = address, security
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
                if self._stop.wait(max(0.0, due - start)):
                    return
                woke, interval = time.monotonic(), self._interval()
                late = woke - max(due, start)
                if late >= max(1.0, interval):  # says, in a loss's aftermath, which side was late
                    log.warning("heartbeat %.1fs late: this agent was not scheduled (the machine is overloaded)", late)
                # A fixed cadence: a slow answer does not push the next heartbeat back (nor do they bunch up).
                due = max(due + interval, woke)
                sent = time.monotonic()
                answer: bool | grpc.RpcError
                try:
                    answer = stub.Heartbeat(pb.HeartbeatRequest(node_id=self._node_id()), timeout=interval * 3).known
                except grpc.RpcError as e:
                    answer = e
                if self._stop.is_set():
                    return
                try:
                    self._loop.call_soon_threadsafe(self._on_answer, sent, answer)
                except RuntimeError:  # the loop closed
                    return
        finally:
            channel.close()
