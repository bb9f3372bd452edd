"""10,000 random and mutated frames at a live shard and a live coordinator; both still answer correctly after.

The shard gets ZMQ messages (random bytes, random multipart, random headers, and mutations
of the HELLO/PULL/PUSH/STATS/LEAVE messages a real ShardClient sent, plain and compressed)
from DEALER, REQ, PUB and PUSH sockets, sockets that vanish right after sending, and raw TCP
that breaks off inside a ZMTP frame. The coordinator's gRPC port gets raw TCP garbage,
HTTP/1.1, malformed HTTP/2, and gRPC calls with random and mutated protobuf bodies on every
method. A push-sum gossip peer gets a smaller storm of the same kinds. The mutations are
seeded (GOSSAMER_FUZZ_SEED; a failure names its seed). Each bug the storms found has its own
regression test at the end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import signal
import socket
import struct
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import msgpack
import pytest
import torch
import zmq
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message as Proto
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from gossamer import Experiment
from gossamer.compression import ChunkCompressor
from gossamer.core.errors import ProtocolError
from gossamer.paramserver import OptimizerConfig, ShardClient, ShardConfig, ShardPlan, ShardServer
from gossamer.transport.frames import DTYPES, Message, decode, encode
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc
from tests._fixtures import InProcessCoordinator, MakeCluster, StartCoordinator, experiment

pytestmark = pytest.mark.timeout(300)

SEED = int(os.environ.get("GOSSAMER_FUZZ_SEED", "7"))
SHARD_MESSAGES = 6_000  # ZMQ messages and raw TCP connections at the shard
GRPC_CALLS = 2_400  # gRPC calls with random or mutated bodies at the coordinator
RAW_CONNECTIONS = 700  # raw TCP connections at the coordinator's gRPC port (several frames each)
EXP = "fuzz"
LR = 0.5  # a power of two: p - LR * g rounds once however the optimizer fuses it

OPS = ["HELLO", "PULL", "PUSH", "STATS", "LEAVE", "SYNC", "REPLICATE", "PARAMS", "ERROR", "ACK", "FROB", ""]
NASTY: list[Any] = [
    None, True, False, 0, -1, 1, 3, 16, 17, 2**31, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1,
    0.5, -0.0, float("nan"), float("inf"), 1e308, "", "x" * 300, "c0", "c99", "c0/0/values",
    "w", "none", "int8", "fp16", "topk:0.5", "topk:2", "qsgd:0", "qsgd:4", "qsgd:²", "powersgd:1",
    "powersgd:999999", "sign", "adaptive", "float32", "bfloat16", "float8", b"\x00\xff", [], {},
    [1, 2], [[1, 2]], [["*", "topk:0.5"]], ["w", "int8"], {"a": 1}, {"0": {"v": 1}},
    {"0": {"v": 1, "chunk": 0, "numel": 16, "segments": []}}, [-1], [2**40], [0, 2**62],
]


def _rand_bytes(rng: random.Random, n: int) -> bytes:
    return rng.getrandbits(8 * n).to_bytes(n, "little") if n else b""


def _flip(rng: random.Random, data: bytes, flips: int = 0) -> bytes:
    if not data:
        return _rand_bytes(rng, rng.randint(1, 8))
    buf = bytearray(data)
    for _ in range(flips or rng.randint(1, 4)):
        buf[rng.randrange(len(buf))] ^= rng.randint(1, 255)
    return bytes(buf)


def _paths(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*path, i))


def mutate_tree(rng: random.Random, root: dict[str, Any]) -> dict[str, Any]:
    """Replace, nudge, delete or add one node anywhere in a decoded msgpack header."""
    path = rng.choice(list(_paths(root))[1:] or [("extra",)])
    parent: Any = root
    for p in path[:-1]:
        parent = parent[p]
    key = path[-1]
    old = parent[key] if (isinstance(parent, dict) and key in parent) or isinstance(parent, list) else None
    r = rng.random()
    if r < 0.12:
        del parent[key]
    elif r < 0.22 and isinstance(parent, dict):
        parent[rng.choice(["rid", "clock", "basis", "chunks", "pull_codec", "fresh", "compression", "codec",
                           "codec_overrides", "step", "num_workers", "generation", "x"])] = rng.choice(NASTY)
    elif isinstance(old, int) and not isinstance(old, bool) and r < 0.55:
        nudged = [old + 1, old - 1, -old, old * 2 ** rng.randint(1, 40), 0, 2**63 - 1]
        parent[key] = rng.choice([v for v in nudged if -(2**63) <= v < 2**64])  # what msgpack can carry
    elif key == "op":
        parent[key] = rng.choice(OPS)
    else:
        parent[key] = rng.choice(NASTY)
    return root


def mutate_frames(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    """One to three damages to a recorded message: bytes, header fields, frame counts, values."""
    frames = list(frames)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(10)
        i = rng.randrange(len(frames)) if frames else 0
        if not frames:
            frames = [_rand_bytes(rng, rng.randint(0, 64))]
        elif op == 0:
            frames[0] = _flip(rng, frames[0])
        elif op in (1, 2) and _is_map(frames[0]):
            frames[0] = msgpack.packb(mutate_tree(rng, msgpack.unpackb(frames[0], raw=False)), use_bin_type=True)
        elif op == 3:
            frames[i] = frames[i][: rng.randint(0, max(0, len(frames[i]) - 1))]
        elif op == 4:
            frames[i] += _rand_bytes(rng, rng.choice([1, 4, 100]))
        elif op == 5:
            del frames[i]
        elif op == 6:
            frames.insert(i, frames[i] if rng.random() < 0.5 else _rand_bytes(rng, rng.randint(0, 64)))
        elif op == 7 and len(frames) > 1:
            j = rng.randrange(len(frames))
            frames[i], frames[j] = frames[j], frames[i]
        elif op == 8 and len(frames) > 1:  # same length, hostile values: NaN, Inf, huge, denormal
            k = rng.randrange(1, len(frames))
            special = rng.choice([b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\xff\xff\x7f\x7f", b"\x01\x00\x00\x00"])
            frames[k] = (special * (len(frames[k]) // 4 + 1))[: len(frames[k])]
        elif len(frames) > 1:
            k = rng.randrange(1, len(frames))
            frames[k] = _flip(rng, frames[k])
    return frames or [b""]


def _is_map(head: bytes) -> bool:
    try:
        return isinstance(msgpack.unpackb(head, raw=False), dict)
    except Exception:  # noqa: BLE001 — already garbage: other mutations apply
        return False


def random_header_message(rng: random.Random) -> list[bytes]:
    """A msgpack header with plausible and implausible fields, and tensor frames mostly of the declared size."""
    specs = []
    frames: list[bytes] = []
    for _ in range(rng.randint(0, 3)):
        dtype = rng.choice([*DTYPES, "float8"])
        shape = [rng.choice([0, 1, 3, 16, 17])] * rng.randint(0, 2)
        specs.append({"name": rng.choice(["c0", "c1", "c2", "c9", "x", "c0/0/values", "c1/0/indices"]),
                      "dtype": dtype, "shape": shape})
        itemsize = DTYPES[dtype].itemsize if dtype in DTYPES else 1
        n = itemsize * int(torch.tensor(shape).prod()) if shape else itemsize
        frames.append(_rand_bytes(rng, n if rng.random() < 0.8 else rng.randint(0, 40)))
    header = {
        "v": rng.choice([1, 1, 1, 0, 2, "1"]), "op": rng.choice(OPS), "experiment": rng.choice([EXP, EXP, "other"]),
        "shard": rng.choice([0, 0, 1, -1]), "version": rng.choice([0, 3, -1, 2**63 - 1]),
        "sender": rng.choice(["r", "", "z" * 40]), "tensors": specs,
        "meta": {rng.choice(["rid", "clock", "basis", "chunks", "pull_codec", "compression", "fresh"]): rng.choice(NASTY)
                 for _ in range(rng.randint(0, 4))},
    }
    if rng.random() < 0.1:
        del header[rng.choice(list(header))]
    return [msgpack.packb(header, use_bin_type=True), *frames]


# -- the shard ------------------------------------------------------------------------------

SHAPES = {"w": (5, 8), "b": (8,)}


@pytest.fixture
def shard() -> Iterator[tuple[ShardServer, ShardPlan, str, dict[int, dict[int, torch.Tensor]]]]:
    plan = ShardPlan.build([("w", 40), ("b", 8)], 1, chunk_numel=16)
    init = (torch.arange(plan.total_numel, dtype=torch.float32) - 20) / 8
    srv = ShardServer(
        ShardConfig(experiment=EXP, shard=0, mode="async", staleness=None, total_steps=10**6,
                    optimizer=OptimizerConfig(name="sgd", lr=LR), expect_backup=False, checkpoint_every=1),
        plan, {c.index: init[c.flat_offset : c.flat_offset + c.numel].clone() for c in plan.chunks}, shapes=SHAPES,
    )
    # Every applied version's parameters, taken on the serve thread right after the update.
    history: dict[int, dict[int, torch.Tensor]] = {0: srv.values()}
    srv.on_snapshot = lambda v: history.__setitem__(v, srv.values())
    endpoint = srv.bind()
    srv.start()
    try:
        yield srv, plan, endpoint, history
    finally:
        srv.close()


class RecordingRelay:
    """A ROUTER/DEALER relay in front of `endpoint` that keeps every request a real client sends."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.front, self.back = self.ctx.socket(zmq.ROUTER), self.ctx.socket(zmq.DEALER)
        self.endpoint = f"tcp://127.0.0.1:{self.front.bind_to_random_port('tcp://127.0.0.1')}"
        self.back.connect(endpoint)
        self.recorded: list[list[bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._relay, daemon=True)
        self._thread.start()

    def _relay(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        identity = b""
        while not self._stop.is_set():
            for sock, _ in poller.poll(20):
                if sock is self.front:
                    identity, *frames = self.front.recv_multipart()
                    self.recorded.append(frames)
                    self.back.send_multipart(frames)
                else:
                    self.front.send_multipart([identity, *self.back.recv_multipart()])

    def close(self) -> list[list[bytes]]:
        self._stop.set()
        self._thread.join(5)
        self.front.close(linger=0)
        self.back.close(linger=0)
        self.ctx.term()
        return self.recorded


def record_client_messages(plan: ShardPlan, endpoint: str) -> list[list[bytes]]:
    """What real ShardClients send (plain, compressed, pull-compressed), through a RecordingRelay."""
    relay = RecordingRelay(endpoint)
    g = torch.Generator().manual_seed(SEED)
    try:
        for n, (codec, pull_codec) in enumerate(
            [(None, "none"), ("int8", "none"), ("topk:0.5", "fp16"), ("qsgd:4", "none"), ("powersgd:2", "int8"),
             ("sign", "none")]
        ):
            compressor = ChunkCompressor(codec, plan, shapes=SHAPES) if codec else None
            with ShardClient(experiment=EXP, sender=f"rec{n}", plan=plan, endpoints={0: relay.endpoint},
                             timeout_s=10, compressor=compressor, pull_codec=pull_codec) as client:
                client.hello(fresh=True)
                versions = client.pull().versions
                grads = {c.index: torch.randint(-8, 8, (c.numel,), generator=g).float() / 8 for c in plan.chunks}
                client.push_pull(grads, clock=0, basis=versions)
                client.stats(0)
                if n == 0:
                    client.probe(nbytes=256)
                client.leave()
    finally:
        recorded = relay.close()
    ops = Counter(msgpack.unpackb(f[0], raw=False)["op"] for f in recorded)
    assert {"HELLO", "PULL", "PUSH", "STATS", "LEAVE"} <= set(ops), ops
    return recorded


class ShardReplies:
    """Everything the fuzzing sockets got back; an applied push is a PARAMS reply carrying "lead"."""

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.codes: Counter[str] = Counter()
        self.internal: list[str] = []
        self.applied_versions: set[int] = set()
        self.last = time.monotonic()

    def drain(self, socks: list[zmq.Socket]) -> int:
        got = 0
        for s in socks:
            while True:
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                got += 1
                try:
                    reply = decode(frames)
                except ProtocolError as e:
                    self.internal.append(f"undecodable reply: {e}")
                    continue
                self.ops[reply.op] += 1
                if reply.op == "ERROR":
                    self.codes[str(reply.meta.get("code"))] += 1
                    if reply.meta.get("code") == "INTERNAL":
                        self.internal.append(str(reply.meta.get("error")))
                elif reply.op == "PARAMS" and "lead" in reply.meta:
                    self.applied_versions.add(reply.version)
        if got:
            self.last = time.monotonic()
        return got


def _zmtp_greeting(mechanism: bytes = b"NULL", major: int = 3) -> bytes:
    return b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([major, 0]) + mechanism.ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def _zmtp_ready(socket_type: bytes = b"DEALER") -> bytes:
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return bytes([0x04, len(body)]) + body


def _zmtp_frame(body: bytes, more: bool = False, declared: int | None = None) -> bytes:
    n = len(body) if declared is None else declared
    flags = 0x01 if more else 0x00
    if n > 255:
        return bytes([flags | 0x02]) + struct.pack(">Q", n) + body
    return bytes([flags, n]) + body


def raw_tcp(port: int, chunks: list[bytes], *, reset: bool = False, read: bool = False) -> bytes:
    """Send `chunks` on a fresh TCP connection, then close it (with RST when `reset`); returns what came back."""
    got = b""
    for _ in range(100):  # the coordinator's port is down for a moment while its gRPC server restarts
        try:
            conn = socket.create_connection(("127.0.0.1", port), timeout=2)
            break
        except (ConnectionRefusedError, ConnectionResetError):
            time.sleep(0.02)
    else:
        raise AssertionError(f"port {port} refused connections for 2 s")
    with conn as s:
        if reset:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        try:
            for c in chunks:
                s.sendall(c)
            if read:
                s.settimeout(0.5)
                while len(got) < 1 << 16:
                    part = s.recv(4096)
                    if not part:
                        break
                    got += part
        except (TimeoutError, ConnectionError):
            pass
    return got


def zmtp_storm(rng: random.Random, port: int, valid: list[list[bytes]]) -> int:
    """One raw connection that speaks some ZMTP and breaks off (mid-frame, lying sizes, wrong greeting)."""
    kind = rng.randrange(6)
    # Never a push: a message that does get through has nobody reading its reply, and an
    # applied update must be seen by the test (the other ops cannot be mutated into one).
    base = rng.choice([f for f in valid if msgpack.unpackb(f[0], raw=False)["op"] != "PUSH"])
    msg = mutate_frames(rng, base) if rng.random() < 0.5 else base
    head = _zmtp_greeting() + _zmtp_ready()
    wire = b"".join(_zmtp_frame(f, more=i < len(msg) - 1) for i, f in enumerate(msg))
    if kind == 0:  # not ZMTP at all
        chunks = [_rand_bytes(rng, rng.randint(1, 2000))]
    elif kind == 1:  # a whole message cut short: the peer vanishes mid-message
        chunks = [head, wire[: rng.randint(1, max(1, len(wire) - 1))]]
    elif kind == 2:  # a frame declaring far more than MAXMSGSIZE
        chunks = [head, _zmtp_frame(b"", more=True, declared=rng.choice([2**62, 2**40, 300 << 20])) + b"x" * 100]
    elif kind == 3:  # wrong greeting: version, mechanism, signature
        chunks = [rng.choice([_zmtp_greeting(major=rng.choice([1, 2, 9])), _zmtp_greeting(b"CURVE"),
                              _zmtp_greeting(b"PLAIN"), _flip(rng, _zmtp_greeting(), 3)]), _zmtp_ready(), wire]
    elif kind == 4:  # an incompatible peer type in READY, then a message
        chunks = [_zmtp_greeting(), _zmtp_ready(rng.choice([b"PUB", b"ROUTER", b"XSUB", b"BOGUS"])), wire]
    else:  # a valid-looking stream with a byte flipped somewhere
        chunks = [_flip(rng, head + wire, rng.randint(1, 3))]
    raw_tcp(port, chunks, reset=rng.random() < 0.5)
    return 1


def storm_shard(srv: ShardServer, endpoint: str, recorded: list[list[bytes]], rng: random.Random) -> tuple[ShardReplies, int]:
    ctx = zmq.Context()
    replies = ShardReplies()
    dealers = [ctx.socket(zmq.DEALER) for _ in range(6)]
    reqs = [ctx.socket(zmq.REQ) for _ in range(2)]
    for s in reqs:  # REQ may send again without waiting: its replies are never well-formed REQ replies
        s.setsockopt(zmq.REQ_RELAXED, 1)
        s.setsockopt(zmq.REQ_CORRELATE, 1)
    wrong = [ctx.socket(zmq.PUB), ctx.socket(zmq.PUSH)]  # socket types a ROUTER refuses at the handshake
    for s in dealers + reqs + wrong:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
    port = int(endpoint.rsplit(":", 1)[1])
    sent = 0
    try:
        while sent < SHARD_MESSAGES:
            r = rng.random()
            if r < 0.55:
                frames = mutate_frames(rng, rng.choice(recorded))
            elif r < 0.63:
                frames = random_header_message(rng)
            elif r < 0.70:
                frames = [_rand_bytes(rng, rng.choice([0, 1, 7, 64, 900]))]
            elif r < 0.76:
                frames = [_rand_bytes(rng, rng.randint(0, 200)) for _ in range(rng.randint(2, 6))]
            elif r < 0.80:
                sent += zmtp_storm(rng, port, recorded)
                continue
            elif r < 0.84:  # a DEALER that sends junk and vanishes at once, its message possibly half-written
                eph = ctx.socket(zmq.DEALER)
                eph.setsockopt(zmq.LINGER, 0)
                eph.connect(endpoint)
                for _ in range(rng.randint(1, 3)):
                    eph.send_multipart([_rand_bytes(rng, rng.randint(0, 3000)) for _ in range(rng.randint(1, 3))])
                    sent += 1
                eph.close(linger=0)
                continue
            else:
                frames = rng.choice([mutate_frames(rng, rng.choice(recorded)), [_rand_bytes(rng, 40)]])
                target = rng.choice(reqs + wrong)
                try:
                    target.send_multipart(frames, zmq.NOBLOCK)
                except zmq.Again:
                    pass
                sent += 1
                continue
            rng.choice(dealers).send_multipart(frames)
            sent += 1
            if sent % 200 == 0:
                replies.drain(dealers)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and time.monotonic() - replies.last < 1.0:
            if not replies.drain(dealers):
                time.sleep(0.02)
    finally:
        for s in dealers + reqs + wrong:
            s.close(linger=0)
        ctx.term()
    return replies, sent


# -- the coordinator ------------------------------------------------------------------------


@pytest.fixture
def live_coordinator(start_coordinator: StartCoordinator) -> InProcessCoordinator:
    """The real grpc.aio coordinator and its HTTP side on their own event loop thread, on free ports."""
    # rate_limit=0: every fuzzed call must reach the servicers, not the per-host limiter.
    # check_imports=False: mutated model paths would each import in a subprocess.
    return start_coordinator(http=True, check_imports=False, rate_limit=0)


def scrape(http: str) -> dict[str, float]:
    """The unlabelled samples on `http`/metrics, by name."""
    with urllib.request.urlopen(f"{http}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


class CoordinatorProcess:
    """`gossamer coordinator serve` as its own process (LocalCluster), its HTTP side on, logs as JSON lines.

    For tests that make the coordinator restart its gRPC server: with the grpc.aio server in
    pytest's own process, a sync client's call in flight while it restarted segfaulted the
    whole pytest process about one run in five (the two share grpc core). What the test used
    to read off the server object now comes over /metrics and the process's log.
    """

    def __init__(self, make_cluster: MakeCluster, state_dir: Path) -> None:
        # --rate-limit 0: every fuzzed call must reach the servicers, not the per-host limiter.
        # --no-import-check: mutated model paths would each import in a subprocess.
        self.cluster = make_cluster(
            state_dir=state_dir, heartbeat_interval=0.2, lease_timeout=1.0, env={"PYTHONFAULTHANDLER": "1"},
            coordinator_args=["--http-port", "0", "--no-import-check", "--rate-limit", "0", "--log-format", "json"])
        self.address = self.cluster.start_coordinator(port=0)
        self.http = f"http://127.0.0.1:{int((state_dir / 'http.port').read_text())}"
        assert self.cluster.coordinator is not None
        self.proc = self.cluster.coordinator
        self.port = self.cluster.port
        self.log_file = self.cluster.log_dir / "coordinator.log"

    def metrics(self) -> dict[str, float]:
        return scrape(self.http)

    def restarts(self) -> int:
        return int(self.metrics()["gossamer_grpc_server_restarts_total"])

    def errors(self) -> ErrorLog:
        """The ERROR records in the process's log so far (and anything it printed that says it crashed)."""
        errors = ErrorLog()
        for line in self.log_file.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            if isinstance(rec, dict) and "level" in rec:
                if rec["level"] in ("ERROR", "CRITICAL"):
                    exc = str(rec.get("exc", "")).strip().splitlines()
                    errors.note(str(rec.get("logger", "")), str(rec.get("msg", "")) + (f" [{exc[-1]}]" if exc else ""))
            elif line.startswith(("Traceback", "Fatal Python error", "Segmentation fault")):
                errors.records.append(f"stderr: {line}"[:500])  # not from logging: an exception nobody caught
        return errors

    def settle(self, quiet_s: float = 1.0, timeout: float = 30.0) -> None:
        """Wait until each gRPC server crash in the log has been followed by a restart, no new crash
        for `quiet_s` (the server notices one within 0.25 s), and the port answers a health check."""
        deadline = time.monotonic() + timeout
        last, since = (-1, -1), time.monotonic()
        while True:
            now = (self.errors().crashes, self.restarts())
            if now != last:
                last, since = now, time.monotonic()
            elif now[1] >= now[0] and time.monotonic() - since >= quiet_s:
                break
            assert time.monotonic() < deadline, f"(crashes, restarts) {now}: the gRPC server did not settle"
            time.sleep(0.05)
        with grpc.insecure_channel(self.address) as channel:
            check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                        response_deserializer=health_pb2.HealthCheckResponse.FromString)
            reply = check(health_pb2.HealthCheckRequest(service=""), timeout=10, wait_for_ready=True)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

    def stop(self) -> int | None:
        """SIGTERM, as an operator stops it; its exit status (None: still running after 30 s)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        return self.proc.poll()


@pytest.fixture
def coordinator_process(tmp_path: Path, make_cluster: MakeCluster) -> CoordinatorProcess:
    return CoordinatorProcess(make_cluster, tmp_path / "coordinator")


class ErrorLog(logging.Handler):
    """ERROR records of gossamer, grpc and asyncio: an exception a servicer or the reaper did not expect.

    Set apart: grpc.aio's own crash on a non-UTF-8 :path (`crashes`; CoordinatorServer serves
    again after each), and grpc's log of metadata it could only read as latin-1 (handled).
    """

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []
        self.crashes = 0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f" [{type(record.exc_info[1]).__name__}: {record.exc_info[1]}]"
        self.note(record.name, text)

    def note(self, logger: str, message: str) -> None:
        """Sort one ERROR record of `logger` (its message and exception text)."""
        if not logger.startswith(("gossamer", "grpc", "asyncio")):
            return
        text = f"{logger}: {message}"
        if logger.startswith("grpc") and "Invalid encoding on" in text:
            return
        if "UnicodeDecodeError" in text or (logger.startswith("grpc") and "can't decode" in text):
            self.crashes += logger.startswith("grpc")
            return
        self.records.append(text[:500])


#: The experiment every fuzz test submits (under its own name).
FUZZED = {"mode": "async", "num_ps_shards": 1, "ps_backup": False, "min_workers": 1, "max_workers": 2,
          "total_steps": 100}


def real_requests(stub: Any, exps: Any, heartbeat_ids: list[str]) -> dict[str, list[Proto]]:
    """Requests as the node agent, workers and the Client send them, with ids of real nodes and experiments."""
    nodes = [stub.Join(pb.JoinRequest(name=f"n{i}", address="127.0.0.1", hostname="h", cpus=4, nproc_per_node=1,
                                      labels={"zone": "a"}), timeout=10).node_id for i in range(3)]
    heartbeat_ids.extend(nodes)
    eid = exps.Submit(pb.SubmitRequest(experiment_json=experiment(FUZZED, name="setup").to_json()), timeout=10).experiment_id
    other = exps.Submit(pb.SubmitRequest(experiment_json=experiment(FUZZED, name="queued").to_json()), timeout=10).experiment_id
    roles = list(exps.Get(pb.GetExperimentRequest(experiment_id=eid), timeout=10).roles)
    assert roles, "the setup experiment was not scheduled"
    report = [pb.ReportRoleRequest(experiment_id=eid, node_id=r.node_id, role=r.role, index=r.index,
                                   state=pb.ROLE_STATE_SERVING, endpoint=f"tcp://127.0.0.1:{5000 + i}", version=3)
              for i, r in enumerate(roles)]
    for req in report:
        stub.ReportRole(req, timeout=10)
    point = pb.MetricPoint(time_unix=time.time(), step=5, source=f"{nodes[0]}/w0",
                           values={"loss": 0.5, "discarded_rejected": 2.0, "versions_lost": 1.0})
    ckpt = pb.CheckpointInfo(experiment_id=eid, step=10, path="/tmp/ck/step-10", kind="sharded")
    return {
        "/gossamer.v1.NodeService/Join": [pb.JoinRequest(name="n", address="127.0.0.1", hostname="h", spot=True,
                                                         labels={"zone": "a"}, cpus=8, gpus=1, nproc_per_node=2,
                                                         node_id=nodes[0])],
        "/gossamer.v1.NodeService/Heartbeat": [pb.HeartbeatRequest(node_id=n) for n in nodes],
        "/gossamer.v1.NodeService/Leave": [pb.LeaveRequest(node_id=nodes[2], reason="spot notice")],
        "/gossamer.v1.NodeService/WatchAssignments": [pb.WatchAssignmentsRequest(node_id=n) for n in nodes],
        "/gossamer.v1.NodeService/ReportRole": report,
        "/gossamer.v1.NodeService/ListNodes": [pb.ListNodesRequest()],
        "/gossamer.v1.ExperimentService/Submit": [pb.SubmitRequest(experiment_json=experiment(FUZZED, name="m").to_json())],
        "/gossamer.v1.ExperimentService/Get": [pb.GetExperimentRequest(experiment_id=eid)],
        "/gossamer.v1.ExperimentService/List": [pb.ListExperimentsRequest()],
        "/gossamer.v1.ExperimentService/Watch": [pb.WatchExperimentRequest(experiment_id=eid)],
        "/gossamer.v1.ExperimentService/Cancel": [pb.CancelExperimentRequest(experiment_id=other)],
        "/gossamer.v1.ExperimentService/ReportMetrics": [pb.ReportMetricsRequest(experiment_id=eid, points=[point])],
        "/gossamer.v1.ExperimentService/GetMetrics": [pb.GetMetricsRequest(experiment_id=eid)],
        "/gossamer.v1.ExperimentService/Complete": [pb.CompleteExperimentRequest(
            experiment_id=other, final_metrics={"steps": 10.0, "eval_accuracy": 0.9}, checkpoint="/tmp/ck")],
        "/gossamer.v1.ExperimentService/ListEvents": [pb.ListEventsRequest(experiment_id=eid)],
        "/gossamer.v1.CheckpointService/Register": [pb.RegisterCheckpointRequest(checkpoint=ckpt)],
        "/gossamer.v1.CheckpointService/Latest": [pb.LatestCheckpointRequest(experiment_id=eid)],
        "/grpc.health.v1.Health/Check": [health_pb2.HealthCheckRequest(service="gossamer.v1.NodeService")],
        "/grpc.health.v1.Health/Watch": [health_pb2.HealthCheckRequest(service="")],
    }


STREAMING = {"/gossamer.v1.NodeService/WatchAssignments", "/gossamer.v1.ExperimentService/Watch",
             "/grpc.health.v1.Health/Watch"}
_INTS = {
    FieldDescriptor.CPPTYPE_INT32: [0, -1, 1, 7, 2**31 - 1, -(2**31)],
    FieldDescriptor.CPPTYPE_INT64: [0, -1, 2**63 - 1, -(2**63), 2**53 + 1],
    FieldDescriptor.CPPTYPE_UINT32: [0, 1, 2**32 - 1],
    FieldDescriptor.CPPTYPE_UINT64: [0, 1, 2**64 - 1],
}


def _scalar(rng: random.Random, f: FieldDescriptor, known: list[str]) -> Any:
    t = f.cpp_type
    if t in _INTS:
        return rng.choice(_INTS[t])
    if t in (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT):
        return rng.choice([0.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e308, -0.0, 1e-320])
    if t == FieldDescriptor.CPPTYPE_BOOL:
        return rng.random() < 0.5
    if t == FieldDescriptor.CPPTYPE_ENUM:
        return rng.choice([v.number for v in f.enum_type.values] + [99, -1, 2**31 - 1])
    if t == FieldDescriptor.CPPTYPE_STRING:
        if f.type == FieldDescriptor.TYPE_BYTES:
            return _rand_bytes(rng, rng.randint(0, 64))
        return rng.choice(["", "x" * 20_000, "\x00", "é\u2028", "../../etc/passwd", "tcp://[::1]:0", "{}", "[]",
                           '{"name": 1}', "\ud7ff", "-1", "NaN", *known])
    raise AssertionError(t)


def mutate_proto(rng: random.Random, msg: Proto, known: list[str], depth: int = 0) -> None:
    """Set one to three fields (anywhere in the message tree) to hostile values of their own type."""
    fields = msg.DESCRIPTOR.fields
    for _ in range(rng.randint(1, 3) if depth == 0 else 1):
        if not fields:
            return
        f = rng.choice(fields)
        try:
            if f.message_type is not None and f.message_type.GetOptions().map_entry:
                key_f, val_f = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
                m = getattr(msg, f.name)
                key = _scalar(rng, key_f, known)
                if val_f.message_type is not None:
                    mutate_proto(rng, m[key], known, depth + 1)
                else:
                    m[key] = _scalar(rng, val_f, known)
            elif f.is_repeated:
                rep = getattr(msg, f.name)
                if f.message_type is not None:
                    for _ in range(rng.choice([1, 1, 50])):
                        mutate_proto(rng, rep.add(), known, depth + 1)
                else:
                    many = 1000 if f.cpp_type != FieldDescriptor.CPPTYPE_STRING else 3
                    rep.extend(_scalar(rng, f, known) for _ in range(rng.choice([1, 3, many])))
            elif f.message_type is not None:
                if depth < 4:
                    mutate_proto(rng, getattr(msg, f.name), known, depth + 1)
            else:
                setattr(msg, f.name, _scalar(rng, f, known))
        except (ValueError, TypeError):
            pass  # a value this field's type cannot hold (e.g. invalid UTF-8): raw mutations cover it


def fuzz_body(rng: random.Random, examples: list[Proto], known: list[str]) -> bytes:
    base = rng.choice(examples)
    r = rng.random()
    if r < 0.4:
        msg = type(base)()
        msg.CopyFrom(base)
        mutate_proto(rng, msg, known)
        return msg.SerializeToString()
    data = base.SerializeToString()
    if r < 0.75:
        return _flip(rng, data)
    if r < 0.85:
        return data[: rng.randint(0, max(0, len(data) - 1))]
    if r < 0.92:
        return data + _rand_bytes(rng, rng.randint(1, 30))
    return _rand_bytes(rng, rng.randint(0, 300))


def submit_json_body(rng: random.Random) -> bytes:
    """A SubmitRequest whose experiment JSON has one hostile field (the validator's property, through RPC)."""
    data = experiment(FUZZED, name="fz").to_dict()
    key = rng.choice([*data, "unknown_field"])
    data[key] = rng.choice(NASTY[:-8] + [10**30, "\ud800", {"k": [1, {"x": None}]}])
    text = json.dumps(data, default=lambda o: o.decode("latin-1") if isinstance(o, bytes) else str(o))
    if rng.random() < 0.2:
        text = text[: rng.randint(0, len(text))]
    return pb.SubmitRequest(experiment_json=text).SerializeToString()


def grpc_storm(address: str, examples: dict[str, list[Proto]], known: list[str], rng: random.Random,
               details: dict[str, list[str]]) -> Counter[str]:
    codes: Counter[str] = Counter()
    channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
    unary = {p: channel.unary_unary(p) for p in examples if p not in STREAMING}
    stream = {p: channel.unary_stream(p) for p in STREAMING}
    pending: list[Any] = []

    def settle(keep: int) -> None:
        while len(pending) > keep:
            path, call = pending.pop(0)
            try:
                code, detail = call.code(), call.details()
            except grpc.RpcError as e:
                code, detail = e.code(), e.details()
            name = code.name if code is not None else "NONE"
            codes[name] += 1
            if name not in ("OK", "CANCELLED", "DEADLINE_EXCEEDED") and len(details.setdefault(name, [])) < 5:
                details[name].append(f"{path}: {detail}"[:300])

    try:
        for i in range(GRPC_CALLS):
            path = rng.choice(sorted(examples))
            body = submit_json_body(rng) if path.endswith("/Submit") and rng.random() < 0.5 else \
                fuzz_body(rng, examples[path], known)
            if path in STREAMING:
                call = stream[path](body, timeout=rng.choice([0.05, 0.3]))
            else:
                call = unary[path].future(body, timeout=10)
            if i % 17 == 0:
                call.cancel()  # the client goes away mid-call
            pending.append((path, call))
            settle(48)
        settle(0)
    finally:
        channel.close()
    return codes


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def h2(ftype: int, flags: int, stream: int, payload: bytes, declared: int | None = None) -> bytes:
    n = len(payload) if declared is None else declared
    return struct.pack(">I", n)[1:] + bytes([ftype, flags]) + struct.pack(">I", stream & 0x7FFFFFFF) + payload


def _hpack(name: str, value: str | bytes) -> bytes:
    """A literal header field without indexing, no Huffman coding (names and values < 127 bytes)."""
    n, v = name.encode(), value.encode() if isinstance(value, str) else value
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


def grpc_over_h2(path: str | bytes, body: bytes, stream: int = 1) -> list[bytes]:
    headers = b"".join(_hpack(k, v) for k, v in [
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "127.0.0.1"),
        ("content-type", "application/grpc"), ("te", "trailers")])
    return [h2(4, 0, 0, b""), h2(1, 0x4, stream, headers), h2(0, 0x1, stream, b"\x00" + struct.pack(">I", len(body)) + body)]


def h2_frames(data: bytes) -> list[tuple[int, int, int]]:
    """(type, flags, stream) of each whole frame in `data`."""
    out = []
    while len(data) >= 9:
        n = int.from_bytes(data[:3], "big")
        out.append((data[3], data[4], int.from_bytes(data[5:9], "big") & 0x7FFFFFFF))
        data = data[9 + n:]
    return out


def h2_storm(rng: random.Random, port: int, examples: dict[str, list[Proto]]) -> int:
    """One raw connection to the gRPC port: garbage, HTTP/1.1, or HTTP/2 broken in one of many ways."""
    path = rng.choice(sorted(p for p in examples if p not in STREAMING))
    valid = grpc_over_h2(path, rng.choice(examples[path]).SerializeToString(), stream=rng.choice([1, 3, 5]))
    kind = rng.randrange(8)
    if kind == 0:
        chunks = [_rand_bytes(rng, rng.randint(1, 3000))]
    elif kind == 1:
        chunks = [rng.choice([b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                              f"POST {path} HTTP/1.1\r\nContent-Length: 99999999\r\n\r\nabc".encode(),
                              b"PRI * HTTP/2.0\r\n\r\n", b"\r\n" * 500, b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n"])]
    elif kind == 2:  # random frames: any type (unknown ones too), flags, stream ids, lying lengths
        chunks = [PREFACE] + [h2(rng.randrange(16), rng.randrange(256), rng.choice([0, 1, 2, 3, 2**31 - 1]),
                                 _rand_bytes(rng, rng.randint(0, 64)),
                                 declared=rng.choice([None, None, 0, 5, 2**24 - 1, 16385]))
                              for _ in range(rng.randint(1, 8))]
    elif kind == 3:  # a valid gRPC call with bytes flipped anywhere after the preface
        chunks = [PREFACE, _flip(rng, b"".join(valid), rng.randint(1, 4))]
    elif kind == 4:  # a valid call with its frames dropped, doubled or reordered
        frames = list(valid)
        for _ in range(rng.randint(1, 3)):
            i, what = rng.randrange(len(frames)), rng.randrange(3)
            if what == 0 and len(frames) > 1:
                del frames[i]
            elif what == 1:
                frames.insert(i, frames[i])
            else:
                rng.shuffle(frames)
        chunks = [PREFACE, *frames]
    elif kind == 5:  # protocol violations a client must not commit
        chunks = [PREFACE, rng.choice([
            h2(4, 0, 0, b"\x00\x04\xff\xff\xff\xff"),  # INITIAL_WINDOW_SIZE over 2^31-1
            h2(4, 0, 0, b"\x00\x05\x00\x00\x00\x01"),  # MAX_FRAME_SIZE below 16384
            h2(4, 0, 0, b"\x00\x01\x00"),  # SETTINGS length not a multiple of 6
            h2(8, 0, 0, b"\x00\x00\x00\x00"),  # WINDOW_UPDATE of 0
            h2(9, 0, 1, b"\x00"),  # CONTINUATION without HEADERS
            h2(5, 0x4, 1, b"\x00\x00\x00\x02" + _hpack(":path", "/x")),  # PUSH_PROMISE from a client
            h2(6, 0, 0, b"\x00" * 7),  # PING of the wrong length
            h2(3, 0, 1, b"\x00\x00\x00\x08"),  # RST_STREAM on an idle stream
            h2(2, 0, 1, b"\x00\x00\x00\x01\x10"),  # PRIORITY: a stream depending on itself
            h2(1, 0x4, 2, b"\x82"),  # HEADERS on an even (server) stream id
            h2(1, 0x4, 1, b"\xff\xff\xff\xff\xff"),  # an HPACK integer that overflows
            h2(7, 0, 0, b"\x00\x00\x00\x00\x00\x00\x00\x02"),  # GOAWAY from the client
        ]), *valid]
    elif kind == 6:  # the call stops mid-frame: the peer vanishes
        blob = b"".join(valid)
        chunks = [PREFACE, blob[: rng.randint(1, len(blob) - 1)]]
    else:  # gRPC framing lies inside well-formed HTTP/2: compressed flag, length prefix
        prefix = rng.choice([b"\x01\x00\x00\x00\x05", b"\x00\xff\xff\xff\xff", b"\x00\x00\x00\x00\x09", b"\x07"])
        chunks = [PREFACE, valid[0], valid[1], h2(0, 0x1, h2_frames(valid[1])[0][2], prefix + b"abcde")]
    raw_tcp(port, chunks, reset=rng.random() < 0.3, read=rng.random() < 0.05)
    return sum(max(1, len(h2_frames(c))) for c in chunks if c != PREFACE)


# -- the test -------------------------------------------------------------------------------


def test_10000_random_and_mutated_frames_leave_shard_and_coordinator_serving_correctly(
    shard: tuple[ShardServer, ShardPlan, str, dict[int, dict[int, torch.Tensor]]],
    coordinator_process: CoordinatorProcess,
) -> None:
    coordinator = coordinator_process
    srv, plan, endpoint, history = shard
    rng = random.Random(SEED)
    errors = ErrorLog()
    logging.getLogger().addHandler(errors)
    started = time.monotonic()
    try:
        # -- shard: record real clients, then the storm -----------------------------------------
        recorded = record_client_messages(plan, endpoint)
        v0, errors0 = srv.version, srv.stats()["errors"]
        assert v0 == 6, "each recorded client's push applies once"
        replies, shard_sent = storm_shard(srv, endpoint, recorded, rng)

        # -- coordinator: real state, then the storm --------------------------------------------
        channel = grpc.insecure_channel(coordinator.address)
        nodes, exps = pb_grpc.NodeServiceStub(channel), pb_grpc.ExperimentServiceStub(channel)
        alive: list[str] = []
        examples = real_requests(nodes, exps, alive)
        known = [*alive, *(r.id for r in exps.List(pb.ListExperimentsRequest(), timeout=10).experiments)]
        stop = threading.Event()

        def heartbeats() -> None:  # the setup nodes stay alive through the storm
            while not stop.wait(0.15):
                for n in alive:
                    try:
                        nodes.Heartbeat(pb.HeartbeatRequest(node_id=n), timeout=2)
                    except grpc.RpcError:
                        pass

        beat = threading.Thread(target=heartbeats, daemon=True)
        beat.start()
        try:
            # The unmutated raw HTTP/2 call is understood (a response HEADERS frame on its
            # stream), so the mutations below start from something valid.
            answer = raw_tcp(coordinator.port,
                             [PREFACE, *grpc_over_h2("/gossamer.v1.ExperimentService/List", b"")], read=True)
            assert any(t == 1 and sid == 1 for t, _, sid in h2_frames(answer)), h2_frames(answer)
            raw_sent = sum(h2_storm(rng, coordinator.port, examples) for _ in range(RAW_CONNECTIONS))
            # A crash at the raw storm's end restarts the server just as the gRPC storm begins; its
            # channel would then spend the reconnect backoff failing fast (UNAVAILABLE), not fuzzing.
            coordinator.settle()
            details: dict[str, list[str]] = {}
            codes = grpc_storm(coordinator.address, examples, known, rng, details)
        finally:
            stop.set()
            beat.join(5)
        storm_s = time.monotonic() - started
    finally:
        logging.getLogger().removeHandler(errors)

    assert coordinator.proc.poll() is None, f"the coordinator exited (status {coordinator.proc.returncode})"
    served = coordinator.metrics()
    restarts, refused = served["gossamer_grpc_server_restarts_total"], served["gossamer_grpc_malformed_refused_total"]
    total = shard_sent + raw_sent + sum(codes.values())
    summary = (f"seed {SEED}: {total} frames in {storm_s:.1f}s; shard: {shard_sent} sent, replies {dict(replies.ops)}, "
               f"error codes {dict(replies.codes)}, {len(replies.applied_versions)} applied; coordinator: "
               f"{raw_sent} raw frames, gRPC codes {dict(codes)}, {restarts:.0f} gRPC restarts, "
               f"{refused:.0f} unparsable bodies refused; details {details}")
    print(summary)
    assert total >= 10_000, summary

    # -- the shard never failed inside, and its state moved only by pushes it acknowledged -----
    assert not replies.internal, f"{summary}\nINTERNAL replies: {replies.internal[:5]}"
    assert replies.codes["INVALID_ARGUMENT"] > 1000, summary
    assert srv.stats()["errors"] - errors0 >= sum(replies.codes.values()), summary
    v1 = srv.version
    assert v1 - v0 == len(replies.applied_versions), f"{summary}: version {v0} -> {v1}"
    assert replies.applied_versions == set(range(v0 + 1, v1 + 1)), summary
    expected = torch.zeros(plan.total_numel)
    plan.scatter(expected, history[v1])
    got = torch.zeros(plan.total_numel)
    plan.scatter(got, srv.values())
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), "parameters changed without an update"

    # -- a real client still gets exactly the right values ----------------------------------
    with ShardClient(experiment=EXP, sender="verifier", plan=plan, endpoints={0: endpoint}, timeout_s=10) as client:
        client.hello(fresh=True)
        res = client.pull()
        assert res.versions == {0: v1}
        pulled = torch.zeros(plan.total_numel)
        plan.scatter(pulled, res.values)
        assert torch.equal(pulled.view(torch.int32), expected.view(torch.int32))
        g = torch.randint(-8, 8, (plan.total_numel,), generator=torch.Generator().manual_seed(SEED)).float() / 8
        res = client.push_pull(plan.gather(g), clock=0, basis=res.versions)
        assert res.versions == {0: v1 + 1}
        after = torch.zeros(plan.total_numel)
        plan.scatter(after, res.values)
        assert torch.equal(after.view(torch.int32), expected.add(g, alpha=-LR).view(torch.int32))
        client.leave()

    # -- the coordinator never failed inside and still serves --------------------------------
    assert "UNKNOWN" not in codes, f"{summary}: a servicer raised an unhandled exception"
    assert not errors.records, f"{summary}\nerror log: {errors.records[:8]}"  # the shard's and the test's own
    served_errors = coordinator.errors()
    assert not served_errors.records, f"{summary}\ncoordinator's error log: {served_errors.records[:8]}"
    deadline = time.monotonic() + 10  # a crash logged just now: its server is started again within 0.25 s
    while restarts < served_errors.crashes and time.monotonic() < deadline:
        time.sleep(0.05)
        restarts = coordinator.metrics()["gossamer_grpc_server_restarts_total"]
    assert restarts >= served_errors.crashes, f"a crashed gRPC server was not brought back: {summary}"
    assert codes["OK"] > 100 and codes["INVALID_ARGUMENT"] + codes["NOT_FOUND"] > 100, summary
    assert refused > 100, summary  # the coordinator's count of refused bodies
    health = channel.unary_unary("/grpc.health.v1.Health/Check",
                                 request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                 response_deserializer=health_pb2.HealthCheckResponse.FromString)
    assert health(health_pb2.HealthCheckRequest(service=""), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    sid = exps.Submit(pb.SubmitRequest(experiment_json=experiment(FUZZED, name="after-the-storm").to_json()),
                      timeout=10).experiment_id
    status = exps.Get(pb.GetExperimentRequest(experiment_id=sid), timeout=10)
    assert (status.id, status.name) == (sid, "after-the-storm")
    assert Experiment.from_json(status.experiment_json) == experiment(FUZZED, name="after-the-storm")
    assert sid in [e.id for e in exps.List(pb.ListExperimentsRequest(), timeout=10).experiments]
    joined = nodes.Join(pb.JoinRequest(name="late", address="127.0.0.1"), timeout=10).node_id
    assert nodes.Heartbeat(pb.HeartbeatRequest(node_id=joined), timeout=10).known
    assert joined in [n.id for n in nodes.ListNodes(pb.ListNodesRequest(), timeout=10).nodes]
    with urllib.request.urlopen(f"{coordinator.http}/api/status", timeout=10) as resp:
        assert sid in json.dumps(json.load(resp))
    with urllib.request.urlopen(f"{coordinator.http}/metrics", timeout=10) as resp:
        assert b"gossamer_nodes" in resp.read()
    channel.close()
    assert coordinator.proc.poll() is None, f"the coordinator exited (status {coordinator.proc.returncode})"
    assert not coordinator.errors().records, "ERROR records in the coordinator's log after the storm"
    assert coordinator.stop() == 0, f"the coordinator did not exit cleanly on SIGTERM: see {coordinator.log_file}"


# -- regressions: one test per bug the storm found ------------------------------------------------


@pytest.fixture
def stubs(live_coordinator: InProcessCoordinator) -> Iterator[tuple[Any, Any, grpc.Channel]]:
    channel = grpc.insecure_channel(live_coordinator.address)
    yield pb_grpc.NodeServiceStub(channel), pb_grpc.ExperimentServiceStub(channel), channel
    channel.close()


def _code(fn: Any, *args: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        fn(*args, timeout=10)
    return err.value.code()


def test_a_request_with_a_non_utf8_path_does_not_take_the_coordinator_down(
    coordinator_process: CoordinatorProcess,
) -> None:
    """grpc.aio stopped its whole server on such a :path; the coordinator now serves again at once."""
    coordinator = coordinator_process
    assert coordinator.restarts() == 0
    with grpc.insecure_channel(coordinator.address) as channel:
        exps = pb_grpc.ExperimentServiceStub(channel)
        sid = exps.Submit(pb.SubmitRequest(experiment_json=experiment(FUZZED, name="kept").to_json()), timeout=10).experiment_id
        frames = grpc_over_h2(b"/gossamer.v1.\xd6/List", b"")  # 0xd6 alone is not UTF-8
        raw_tcp(coordinator.port, [PREFACE, *frames], read=True)
        deadline = time.monotonic() + 10
        while coordinator.restarts() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert coordinator.restarts() == 1
        listed = exps.List(pb.ListExperimentsRequest(), timeout=10, wait_for_ready=True).experiments
        assert [e.id for e in listed] == [sid]  # same port, same state
    assert coordinator.proc.poll() is None
    errors = coordinator.errors()
    assert not errors.records, errors.records[:8]
    assert coordinator.stop() == 0, f"the coordinator did not exit cleanly on SIGTERM: see {coordinator.log_file}"


def test_an_unparsable_body_is_invalid_argument_on_every_method(
    live_coordinator: InProcessCoordinator, stubs: tuple[Any, Any, grpc.Channel]
) -> None:
    """It was UNKNOWN ("Unexpected DecodeError raised by servicer") with an ERROR traceback each time."""
    _, _, channel = stubs
    errors = ErrorLog()
    logging.getLogger().addHandler(errors)
    try:
        for path in ["/gossamer.v1.NodeService/Join", "/gossamer.v1.ExperimentService/Submit",
                     "/gossamer.v1.CheckpointService/Latest", "/grpc.health.v1.Health/Check"]:
            assert _code(channel.unary_unary(path), b"\xff\xff\xff") == grpc.StatusCode.INVALID_ARGUMENT, path
        for path in sorted(STREAMING):
            call = channel.unary_stream(path)(b"\x0a\xff", timeout=10)
            with pytest.raises(grpc.RpcError) as err:
                next(call)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, path
    finally:
        logging.getLogger().removeHandler(errors)
    assert live_coordinator.server.malformed.refused == 7
    served = scrape(f"http://127.0.0.1:{live_coordinator.server.http_port}")
    assert (served["gossamer_grpc_malformed_refused_total"], served["gossamer_grpc_server_restarts_total"]) == (7, 0)
    assert not errors.records


@pytest.mark.parametrize("steps", [math.nan, math.inf, 1e300, -1.0])
def test_complete_with_an_impossible_step_count_is_refused_and_list_still_works(
    stubs: tuple[Any, Any, grpc.Channel], steps: float
) -> None:
    """int(1e300) was stored as the experiment's steps, and every List/Get after failed to encode it."""
    _, exps, _ = stubs
    sid = exps.Submit(pb.SubmitRequest(experiment_json=experiment(FUZZED, name="c").to_json()), timeout=10).experiment_id
    req = pb.CompleteExperimentRequest(experiment_id=sid, final_metrics={"steps": steps})
    assert _code(exps.Complete, req) == grpc.StatusCode.INVALID_ARGUMENT
    assert exps.Get(pb.GetExperimentRequest(experiment_id=sid), timeout=10).state == pb.EXPERIMENT_STATE_QUEUED
    assert len(exps.List(pb.ListExperimentsRequest(), timeout=10).experiments) == 1


def test_a_metric_point_without_a_finite_time_is_refused_and_later_writes_still_land(
    live_coordinator: InProcessCoordinator, stubs: tuple[Any, Any, grpc.Channel]
) -> None:
    """A NaN time failed the metrics table's NOT NULL inside an open transaction that was never
    rolled back: every later metrics write failed, and every other write stayed uncommitted."""
    _, exps, _ = stubs
    sid = exps.Submit(pb.SubmitRequest(experiment_json=experiment(FUZZED, name="m").to_json()), timeout=10).experiment_id
    bad = pb.ReportMetricsRequest(experiment_id=sid, points=[pb.MetricPoint(time_unix=math.nan, step=1, source="a")])
    assert _code(exps.ReportMetrics, bad) == grpc.StatusCode.INVALID_ARGUMENT
    good = pb.ReportMetricsRequest(experiment_id=sid, points=[pb.MetricPoint(time_unix=time.time(), step=2, source="a",
                                                                              values={"loss": 1.5})])
    exps.ReportMetrics(good, timeout=10)
    points = exps.GetMetrics(pb.GetMetricsRequest(experiment_id=sid), timeout=10).points
    assert [(p.step, dict(p.values)) for p in points] == [(2, {"loss": 1.5})]


def test_store_rolls_back_a_failed_metrics_insert(tmp_path: Path) -> None:
    from gossamer.coordinator.records import NodeRec
    from gossamer.coordinator.store import Store

    async def run() -> None:
        store = Store(tmp_path)
        try:
            with pytest.raises(Exception, match="NOT NULL"):
                await store.add_metrics("e", [(math.nan, 1, "a", {})])
            await store.add_metrics("e", [(1.0, 2, "a", {"x": 1.0})])
            await store.save_node(NodeRec(id="n1", name="n1", address="127.0.0.1"))
        finally:
            store.close()
        reopened = Store(tmp_path)  # what was written after the failure is on disk
        try:
            assert [n.id for n in reopened.load()[0]] == ["n1"]
            assert [s for _, s, _, _ in await reopened.metrics("e")] == [2]
        finally:
            reopened.close()

    asyncio.run(run())


def test_an_error_about_a_huge_id_stays_a_clear_not_found(stubs: tuple[Any, Any, grpc.Channel]) -> None:
    """A 20,000-character id was echoed into the status message, over clients' 16 KiB metadata
    limit: they saw RESOURCE_EXHAUSTED instead of NOT_FOUND."""
    nodes, exps, _ = stubs
    huge = "x" * 20_000
    assert _code(exps.Get, pb.GetExperimentRequest(experiment_id=huge)) == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        next(nodes.WatchAssignments(pb.WatchAssignmentsRequest(node_id=huge), timeout=10))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and len(err.value.details()) <= 1024


def test_an_experiment_name_protobuf_cannot_carry_is_refused_at_submit(stubs: tuple[Any, Any, grpc.Channel]) -> None:
    """A lone surrogate (valid JSON escape) was accepted; every List after failed to encode the name."""
    _, exps, _ = stubs
    text = experiment(FUZZED, name="x").to_json().replace('"name": "x"', '"name": "\\ud800"')
    assert _code(exps.Submit, pb.SubmitRequest(experiment_json=text)) == grpc.StatusCode.INVALID_ARGUMENT
    assert list(exps.List(pb.ListExperimentsRequest(), timeout=10).experiments) == []


def test_a_role_report_with_an_unknown_enum_value_is_refused(stubs: tuple[Any, Any, grpc.Channel]) -> None:
    """protobuf enums are open: a fuzzed ReportRole with state 99 was stored, and every
    /api/status after failed with 500 ("Enum RoleState has no name defined for value 99")."""
    nodes, _, _ = stubs
    for req in (pb.ReportRoleRequest(experiment_id="e", node_id="n", role=pb.ROLE_WORKER, state=99),  # type: ignore[arg-type]
                pb.ReportRoleRequest(experiment_id="e", node_id="n", role=42, state=pb.ROLE_STATE_SERVING)):  # type: ignore[arg-type]
        with pytest.raises(grpc.RpcError) as err:
            nodes.ReportRole(req, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown" in err.value.details()


# -- a gossip peer ----------------------------------------------------------------------------

GOSSIP_MESSAGES = 3_000


def test_gossip_peer_survives_random_and_mutated_frames_and_still_reaches_consensus() -> None:
    """A push-sum peer's ROUTER gets the same kinds of storm (MASS/CANCEL/SNAP recorded from a real
    neighbour, mutated); it never fails inside, its (z, weight) stay finite, and it still
    averages exactly with its real neighbour afterwards."""
    from gossamer.training.gossip import PushSumPeer

    numel = 64
    rng = random.Random(SEED)
    a = PushSumPeer(experiment=EXP, peer_id="a", numel=numel, ack_timeout_s=0.5)
    b = PushSumPeer(experiment=EXP, peer_id="b", numel=numel, ack_timeout_s=0.5)
    errors = ErrorLog()
    logging.getLogger().addHandler(errors)
    ctx = zmq.Context()
    dealers: list[zmq.Socket] = []
    try:
        g = torch.Generator().manual_seed(SEED)
        za, zb = torch.randn(numel, generator=g), torch.randn(numel, generator=g) + 3
        relay = RecordingRelay(a.endpoint)
        a.set_membership({"b": b.endpoint}, 1)
        b.set_membership({"a": relay.endpoint}, 1)
        for step in range(4):  # b's real MASS messages (and CANCELs if a reply is slow), then a SNAP
            b.send(zb, "a", step=step)
            assert b.wait_settled(10)
            a.mix(za)
            b.mix(zb)
        snaps: list[Any] = []
        asker = threading.Thread(target=lambda: snaps.append(b.request_snapshot("a", timeout=10)))
        asker.start()
        while asker.is_alive():  # a's trainer answers snapshot requests between its steps
            a.serve(za, 3)
            time.sleep(0.01)
        assert snaps and snaps[0] is not None
        recorded = relay.close()
        assert {msgpack.unpackb(f[0], raw=False)["op"] for f in recorded} >= {"MASS", "SNAP"}

        dealers.extend(ctx.socket(zmq.DEALER) for _ in range(4))
        for s in dealers:
            s.setsockopt(zmq.LINGER, 0)
            s.connect(a.endpoint)
        replies: Counter[str] = Counter()

        def drain() -> int:
            got = 0
            for s in dealers:
                while True:
                    try:
                        reply = decode(s.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    got += 1
                    replies[f"{reply.op}:{reply.meta.get('code', '')}"] += 1
            return got

        rejected0 = sum(a.rejected.values())
        for i in range(GOSSIP_MESSAGES):
            r = rng.random()
            if r < 0.7:
                frames = mutate_frames(rng, rng.choice(recorded))
            elif r < 0.8:
                frames = random_header_message(rng)
            else:
                frames = [_rand_bytes(rng, rng.randint(0, 300)) for _ in range(rng.randint(1, 4))]
            rng.choice(dealers).send_multipart(frames)
            if i % 200 == 0:
                drain()
                a.mix(za)  # the trainer keeps mixing and serving snapshots while the storm goes on
                a.serve(za, 4)
        quiet = time.monotonic()
        while time.monotonic() - quiet < 1.0:
            if drain():
                quiet = time.monotonic()
            time.sleep(0.02)
        a.mix(za)
        assert "internal" not in a.rejected, a.rejected  # no exception escaped the message handlers
        assert sum(a.rejected.values()) - rejected0 > GOSSIP_MESSAGES // 3, (a.rejected, replies)
        assert math.isfinite(a.weight) and 0 < a.weight <= 1 + (1 << 20) * replies["ACK:"], (a.weight, replies)

        # The peer still takes part: a real neighbour's mass is ACKed and folded, weight moves
        # exactly, and a snapshot request is answered. (Its z may hold whatever the forged but
        # well-formed mass carried: without CURVE, anyone who reaches the port is a neighbour.)
        b.set_membership({"a": a.endpoint}, 1)
        for step in range(4, 8):
            total = a.weight + b.weight
            b.send(zb, "a", step=step)
            assert b.wait_settled(10) and b.pending() == 0
            assert a.mix(za).received == 1
            b.mix(zb)
            assert a.weight + b.weight == pytest.approx(total, rel=1e-12)
        snaps.clear()
        asker = threading.Thread(target=lambda: snaps.append(b.request_snapshot("a", timeout=10, light=True)))
        asker.start()
        while asker.is_alive():
            a.serve(za, 8)
            time.sleep(0.01)
        assert snaps[0] is not None and snaps[0].weight == a.weight
    finally:
        logging.getLogger().removeHandler(errors)
        for s in dealers:
            s.close(linger=0)
        a.close()
        b.close()
        ctx.term()
    assert not errors.records, errors.records[:8]


def test_gossip_mass_with_an_impossible_weight_is_refused() -> None:
    """A MASS with weight 1e308 was accepted as finite; the receiver's next send then overflowed
    (z * weight is Inf) and raised on every step after."""
    from gossamer.training.gossip import PushSumPeer

    a = PushSumPeer(experiment=EXP, peer_id="a", numel=4)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(a.endpoint)
    try:
        a.set_membership({"b": "tcp://127.0.0.1:1"}, 1)
        for hid, weight in enumerate([1e308, float(1 << 21), 0.5]):
            meta = {"id": hid, "inc": 1, "gen": 1, "step": 0, "weight": weight, "codec": "none", "payload": {}}
            s.send_multipart(encode(Message(op="MASS", experiment=EXP, sender="b", meta=meta,
                                            tensors={"values": torch.full((4,), 0.25)})))
            assert s.poll(10_000)
            reply = decode(s.recv_multipart())
            assert (reply.op, reply.meta["id"]) == (("ACK" if weight == 0.5 else "NACK"), hid)
        z = torch.zeros(4)
        a.mix(z)
        assert a.weight == 1.5 and a.rejected.get("weight") == 2
        a.send(z, "b", step=1)  # still able to send
    finally:
        s.close(linger=0)
        a.close()
        ctx.term()
