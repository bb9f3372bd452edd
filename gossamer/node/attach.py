"""Local ranks started by torchrun/srun attach to their node's agent over a Unix socket and run its worker ranks.

Local rank 0 runs the node agent and listens on `Launch.socket_path()`; every other local rank
connects there and, for each worker assignment, runs `roles.run_worker_rank(spec, pipe)` in a
spawned child with the spec the agent would have given its own spawned rank. Frames are a 4-byte
big-endian length and a msgpack map (never pickle); the socket lives in a directory only this
user can enter.

    rank -> agent   hello {rank, world, job, pid}         agent -> rank   welcome {grace_s} | refused {reason}
    agent -> rank   start {seq, spec} | update {seq, update} | stop {seq} | kill {seq} | bye
    rank -> agent   exited {seq, code}

`bye` ends an attached rank with exit code 0; a connection closed without it ends the rank with
1 and, on the agent's side, counts as the death of every child that rank ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import select
import signal
import socket
import struct
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

import msgpack

from gossamer.core.errors import ConfigError, ProtocolError, UnavailableError
from gossamer.core.protocol import AssignmentUpdate, LeaseRenewal, RoleSpec, ShardStop
from gossamer.node.launcher import Launch

log = logging.getLogger(__name__)
_SPAWN = mp.get_context("spawn")
_LEN = struct.Struct(">I")
MAX_FRAME = 16 << 20  # a spec is a few KiB; anything near this is not from a rank of ours
VERSION = 1


class RoleProcess(Protocol):
    """What the agent needs of a role process: a spawned `BaseProcess` or an attached rank's child."""

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def start(self) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...


class RolePipe(Protocol):
    """Where the agent sends a running role its assignment updates (and a shard its lease renewals and the
    node's leaving)."""

    def send(self, obj: AssignmentUpdate | LeaseRenewal | ShardStop) -> None: ...

    def close(self) -> None: ...


def _frame(msg: dict[str, Any]) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def _unpack(body: bytes) -> dict[str, Any]:
    msg = msgpack.unpackb(body, raw=False, strict_map_key=False)  # peers: {worker index (int): endpoint}
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ValueError("not a message")
    return msg


# --- the agent's side (asyncio) -------------------------------------------------------------
@dataclass
class _Rank:
    """One attached local rank: its connection and the children it runs for the agent."""

    rank: int
    pid: int
    writer: asyncio.StreamWriter
    children: dict[int, RemoteRank] = field(default_factory=dict)
    lost: bool = False

    def send(self, msg: dict[str, Any]) -> None:
        if not self.lost and not self.writer.is_closing():
            self.writer.write(_frame(msg))


class RemoteRank:
    """A worker rank that runs as a child of an attached local rank, seen as a process by the agent."""

    def __init__(self, peer: _Rank, seq: int, spec: RoleSpec) -> None:
        self._peer, self._seq, self._spec = peer, seq, spec
        self._exitcode: int | None = None

    @property
    def exitcode(self) -> int | None:
        return self._exitcode

    @property
    def pid(self) -> int:
        """The attached rank's process (the child is its own)."""
        return self._peer.pid

    def is_alive(self) -> bool:
        return self._exitcode is None

    def start(self) -> None:
        if self._peer.lost:
            self._exitcode = 1
            return
        self._peer.children[self._seq] = self
        self._peer.send({"op": "start", "seq": self._seq, "spec": self._spec.to_dict()})

    def terminate(self) -> None:
        self._peer.send({"op": "stop", "seq": self._seq})

    def kill(self) -> None:
        self._peer.send({"op": "kill", "seq": self._seq})

    def join(self, timeout: float | None = None) -> None:
        """Returns at once: the exit arrives as a message (or as the loss of the connection)."""

    def exited(self, code: int) -> None:
        self._exitcode = code
        self._peer.children.pop(self._seq, None)


class RemotePipe:
    """The update pipe of a `RemoteRank`: updates travel over its attached rank's connection."""

    def __init__(self, peer: _Rank, seq: int) -> None:
        self._peer, self._seq = peer, seq

    def send(self, obj: AssignmentUpdate | LeaseRenewal | ShardStop) -> None:
        if isinstance(obj, LeaseRenewal | ShardStop):
            return  # only shards keep a lease or are told to stop, and a shard never runs attached
        self._peer.send({"op": "update", "seq": self._seq, "update": obj.to_dict()})

    def close(self) -> None:
        pass


class AttachedRanks:
    """Local rank 0's listener: the other local ranks of its launch attach here (`gossamer worker join`
    under torchrun or srun)."""

    def __init__(self, launch: Launch, path: str, *, grace_s: float) -> None:
        self.launch, self.path, self.grace_s = launch, path, grace_s
        self.ranks: dict[int, _Rank] = {}
        self.lost: list[int] = []  # local ranks whose connection closed before `close()`
        self._all = asyncio.Event()
        self._server: asyncio.AbstractServer | None = None
        self._seq = 0
        self._closing = False
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def expected(self) -> set[int]:
        return set(range(1, self.launch.local_world))

    async def start(self) -> None:
        """Listen on `path`, replacing a stale socket left by a crashed agent, never a live one."""
        if os.path.exists(self.path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(self.path)
            except OSError:
                os.unlink(self.path)
            else:
                raise ConfigError("launcher", f"another node agent of this {self.launch.source} launch already "
                                              f"listens at {self.path}: two processes claim local rank 0")
            finally:
                probe.close()
        self._server = await asyncio.start_unix_server(self._serve, path=self.path, limit=MAX_FRAME + 4)
        os.chmod(self.path, 0o600)
        log.info("waiting for local ranks %s of %s to attach at %s", sorted(self.expected), self.launch.source,
                 self.path)

    async def wait_all(self) -> None:
        await self._all.wait()

    def missing(self) -> list[int]:
        return sorted(self.expected - set(self.ranks))

    def remote(self, rank: int, spec: RoleSpec) -> tuple[RemoteRank, RemotePipe]:
        """Local rank `rank`'s worker process for one assignment (started by its `start()`)."""
        peer = self.ranks[rank]
        self._seq += 1
        return RemoteRank(peer, self._seq, spec), RemotePipe(peer, self._seq)

    async def close(self) -> None:
        """Tell every attached rank to exit (code 0) and stop listening."""
        self._closing = True
        for peer in self.ranks.values():
            peer.send({"op": "bye"})
        for peer in self.ranks.values():
            with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
                await asyncio.wait_for(peer.writer.drain(), 2.0)
            peer.writer.close()
        if self._handlers:  # they end on the closed connections; cancelled instead, asyncio would log it
            await asyncio.wait(self._handlers, timeout=2.0)
        if self._server is not None:  # never another agent's socket (start() refused to replace it)
            self._server.close()
            self._server = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    async def _read(self, reader: asyncio.StreamReader) -> dict[str, Any] | None:
        try:
            (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
            if n > MAX_FRAME:
                raise ValueError(f"frame of {n} bytes")
            return _unpack(await reader.readexactly(n))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer: _Rank | None = None
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)
        try:
            hello = await asyncio.wait_for(self._read(reader), 10.0)
            if hello is None:
                return
            why = self._refuse(hello)
            if why:
                log.error("refused a local rank at %s: %s", self.path, why)
                writer.write(_frame({"op": "refused", "reason": why}))
                await writer.drain()
                return
            peer = _Rank(int(hello["rank"]), int(hello.get("pid", 0)), writer)
            self.ranks[peer.rank] = peer
            peer.send({"op": "welcome", "v": VERSION, "grace_s": self.grace_s})
            log.info("local rank %d attached (pid %d)", peer.rank, peer.pid)
            if not self.missing():
                self._all.set()
            while (msg := await self._read(reader)) is not None:
                if msg["op"] == "exited" and (child := peer.children.get(int(msg["seq"]))) is not None:
                    child.exited(int(msg["code"]))
        except (ValueError, KeyError, TypeError, asyncio.TimeoutError, msgpack.UnpackException) as e:
            log.error("bad message from a local rank at %s (%s): dropping it", self.path, e)
        finally:
            if peer is not None and self.ranks.get(peer.rank) is peer:
                peer.lost = True
                for child in list(peer.children.values()):
                    child.exited(1)
                if not self._closing:
                    self.lost.append(peer.rank)
                    log.error("local rank %d (pid %d) detached", peer.rank, peer.pid)
            writer.close()

    def _refuse(self, hello: dict[str, Any]) -> str:
        if hello.get("op") != "hello" or hello.get("v") != VERSION:
            return f"expected hello version {VERSION}, got {hello.get('op')!r} version {hello.get('v')!r}"
        if hello.get("job") != self.launch.job or hello.get("world") != self.launch.local_world:
            return "it belongs to another launch (job or local world size differs)"
        rank = hello.get("rank")
        if rank not in self.expected:
            return f"local rank {rank!r} is not one of {sorted(self.expected)}"
        if rank in self.ranks and not self.ranks[rank].lost:
            return f"local rank {rank} is already attached"
        if self._closing:
            return "the node agent is leaving"
        return ""


# --- an attached rank's side (blocking, its own process) --------------------------------------
class _Link:
    """A blocking framed connection to the agent."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.sendall(_frame(msg))

    def receive(self, timeout: float) -> list[dict[str, Any]] | None:
        """Messages that arrived within `timeout` ([] if none); None once the agent closed the connection."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if ready:
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionError:
                data = b""
            if not data:
                return None
            self._buf += data
        out = []
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if n > MAX_FRAME:
                raise ValueError(f"frame of {n} bytes from the agent")
            if len(self._buf) < _LEN.size + n:
                break
            out.append(_unpack(self._buf[_LEN.size:_LEN.size + n]))
            self._buf = self._buf[_LEN.size + n:]
        return out


def _connect(path: str, timeout_s: float, stopped: list[int]) -> socket.socket | None:
    deadline = time.monotonic() + timeout_s
    while not stopped:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
        if time.monotonic() > deadline:
            raise UnavailableError(
                f"no node agent at {path} after {timeout_s:.0f} s: local rank 0 of this launch runs it. Did it "
                f"start (see its log), and do all local ranks use the same --run-dir (env GOSSAMER_RUN_DIR)?")
        time.sleep(0.2)
    return None


class _Children:
    """The worker ranks an attached rank runs for its agent, keyed by the agent's sequence number."""

    def __init__(self) -> None:
        self.procs: dict[int, tuple[BaseProcess, Connection]] = {}

    def start(self, seq: int, spec: RoleSpec) -> None:
        from gossamer.node import roles

        recv, send = _SPAWN.Pipe(duplex=False)
        proc = _SPAWN.Process(target=roles.run_worker_rank, args=(spec, recv),
                              name=f"gossamer-{spec.label}")
        proc.start()
        recv.close()
        self.procs[seq] = (proc, send)
        log.info("started worker %s rank %s for the node agent (pid %s)", spec.index, spec.local_rank,
                 proc.pid)

    def update(self, seq: int, update: AssignmentUpdate) -> None:
        if seq in self.procs:
            with contextlib.suppress(BrokenPipeError, OSError):
                self.procs[seq][1].send(update)

    def signal(self, seq: int | None, kill: bool = False) -> None:
        """SIGTERM (SIGKILL) child `seq`, or every child."""
        for s, (proc, _) in self.procs.items():
            if (seq is None or s == seq) and proc.is_alive():
                (proc.kill if kill else proc.terminate)()

    def reap(self) -> list[tuple[int, int]]:
        """(seq, exit code) of the children that ended since the last call."""
        out = []
        for seq, (proc, send) in list(self.procs.items()):
            if proc.exitcode is not None:
                proc.join()
                send.close()
                del self.procs[seq]
                out.append((seq, proc.exitcode))
        return out

    def stop_all(self, grace_s: float = 5.0) -> None:
        self.signal(None)
        deadline = time.monotonic() + grace_s
        for proc, send in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
            send.close()
        self.procs.clear()


def run_attached_rank(launch: Launch, path: str, *, timeout_s: float = 120.0) -> int:
    """Attach to local rank 0's agent at `path` and run the worker ranks it sends until it says bye.

    SIGTERM/SIGINT are passed on to the running children; the process stays attached until the
    agent's bye (which a launcher's signal to the whole node brings), at most the agent's grace
    time plus 30 s.

    Returns:
        0 after the agent's bye (or a signal before attaching), 1 if the agent went away without one.

    Raises:
        UnavailableError: no agent listened within `timeout_s`, or it refused this rank.
    """
    stopped: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        stopped.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    sock = _connect(path, timeout_s, stopped)
    if sock is None:
        return 0
    link = _Link(sock)
    link.send({"op": "hello", "v": VERSION, "rank": launch.local_rank, "world": launch.local_world,
               "job": launch.job, "pid": os.getpid()})
    children = _Children()
    welcomed, grace_s, deadline = False, 30.0, 0.0
    try:
        while True:
            msgs = link.receive(0.2)
            if msgs is None:
                if not welcomed:
                    raise UnavailableError(f"the node agent at {path} closed the connection before welcoming "
                                           f"local rank {launch.local_rank}")
                log.error("the node agent (local rank 0) went away without a bye")
                return 1
            for msg in msgs:
                op = msg["op"]
                if op == "refused":
                    raise UnavailableError(f"the node agent at {path} refused local rank {launch.local_rank}: "
                                           f"{msg.get('reason')}")
                if op == "bye":
                    return 0
                if op == "welcome":
                    welcomed, grace_s = True, float(msg.get("grace_s", grace_s))
                    log.info("local rank %d of %s attached to the node agent at %s", launch.local_rank,
                             launch.source, path)
                elif op == "start":
                    children.start(int(msg["seq"]), RoleSpec.from_dict(msg["spec"]))
                elif op == "update":
                    children.update(int(msg["seq"]), AssignmentUpdate.from_dict(msg["update"]))
                elif op in ("stop", "kill"):
                    children.signal(int(msg["seq"]), kill=op == "kill")
            for seq, code in children.reap():
                link.send({"op": "exited", "seq": seq, "code": code})
            if stopped and not deadline:
                deadline = time.monotonic() + grace_s + 30.0
                children.signal(None)
            if deadline and time.monotonic() > deadline:
                log.error("no bye from the node agent %.0f s after a signal: exiting", grace_s + 30.0)
                return 0
    except (ConnectionError, ValueError, KeyError, TypeError, ProtocolError, msgpack.UnpackException) as e:
        log.error("lost the node agent at %s: %s", path, e)
        return 1
    finally:
        children.stop_all()
        sock.close()
