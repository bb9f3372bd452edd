"""A node's checkpoint file server: lends the shard checkpoint files on its disk to a restoring shard that holds a fetch token."""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq

from gossamer.checkpoint.manifest import MANIFEST
from gossamer.security.sender_tokens import fetch_subject, verify

__all__ = ["CHUNK", "MAX_MANIFEST", "CheckpointFileServer", "shard_path"]

log = logging.getLogger(__name__)

#: Bytes of a file one READ answers: what one reply holds in memory.
CHUNK = 1 << 20
#: A manifest larger than this is refused (it lists a handful of files).
MAX_MANIFEST = 16 << 20
#: Replies queued per connection before libzmq drops more: a client that never reads costs the
#: server at most SNDHWM x CHUNK bytes per connection.
SNDHWM = 4
_EXPERIMENT = re.compile(r"[^./\\\0][^/\\\0]{0,127}")  # a bare directory name
_STEP_DIR = re.compile(r"step-(\d{8,})")
_SHARD_DIR = re.compile(r"shard-(\d{3,})")
_MAX_LISTED = 64  # shard directories one LIST names (newest steps first)


def shard_path(root: Path, experiment: str, step: int, shard: int) -> Path:
    """Where shard `shard` of checkpoint `step` of `experiment` lies under a checkpoint root."""
    return root / experiment / "shards" / f"step-{step:08d}" / f"shard-{shard:03d}"


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


class CheckpointFileServer:
    """Answers LIST and READ for the shard checkpoints under this node's checkpoint roots.

    Every request carries a token (`sender_tokens.fetch_token` of the experiment under this node's secret,
    which only the coordinator hands out, to a restoring shard); a request without a valid one
    is refused and counted. READ serves only `manifest.json` or a bare file name that manifest
    lists, each a regular file, one `CHUNK` at a time. With a CURVE key pair the socket is a
    CURVE server (encrypted; who may read is the token's say, so no ZAP handler). The socket is
    created, used and closed by the server's own thread.
    """

    def __init__(self, secret: str, curve: tuple[str, str] | None = None) -> None:
        self.secret = secret
        self.curve = curve  # (public, secret) z85
        self.refused = 0
        self.served_bytes = 0
        self._roots: list[Path] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._endpoint = ""
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._ops: dict[str, tuple[Callable[[str], str], Callable[[str, dict[str, Any]], list[bytes]]]] = {}

    def add_op(self, op: str, subject: Callable[[str], str],
               answer: Callable[[str, dict[str, Any]], list[bytes]]) -> None:
        """Answer `op` too, for a holder of a token of `subject(experiment)` (not a fetch token): `answer(experiment,
        request)` gives the reply's frames (a packed header map first). Called before `start`; it runs on the
        server's thread, so it must be quick and bounded (the node's role logs: `node/role_log_files.py`)."""
        self._ops[op] = (subject, answer)

    @property
    def endpoint(self) -> str:
        """Where it serves ("" until started)."""
        return self._endpoint

    def add_root(self, root: str | os.PathLike[str]) -> None:
        """Serve the checkpoints under `root` too (a checkpoint_dir this node's roles write to)."""
        path = Path(root).resolve()
        with self._lock:
            if path not in self._roots:
                self._roots.append(path)

    def start(self, host: str, timeout: float = 10.0) -> str:
        """Bind on `host` (a free port) and serve on a thread; the endpoint."""
        self._thread = threading.Thread(target=self._serve, args=(host,), name="checkpoint-files", daemon=True)
        self._thread.start()
        if not self._bound.wait(timeout) or self._error is not None:
            raise RuntimeError(f"the checkpoint file server did not start: {self._error}")
        return self._endpoint

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _serve(self, host: str) -> None:
        ctx = zmq.Context()  # its own: no ZAP handler of the process applies to it
        sock = ctx.socket(zmq.ROUTER)
        try:
            sock.linger = 0
            sock.sndhwm, sock.rcvhwm = SNDHWM, 64
            sock.maxmsgsize = 64 << 10  # requests are small
            if self.curve is not None:
                sock.curve_publickey = self.curve[0].encode("ascii")
                sock.curve_secretkey = self.curve[1].encode("ascii")
                sock.curve_server = True
            port = sock.bind_to_random_port(f"tcp://{host}")
            self._endpoint = f"tcp://{host}:{port}"
        except BaseException as e:  # noqa: BLE001 — handed to start()
            self._error = e
            sock.close()
            ctx.term()
            self._bound.set()
            return
        self._bound.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(200):
                    continue
                frames = sock.recv_multipart(zmq.NOBLOCK)
                reply = self._answer(frames[1:])
                try:
                    sock.send_multipart([frames[0], *reply], zmq.NOBLOCK)
                except zmq.Again:
                    pass  # its queue is full: it does not read, and the reply is dropped
        finally:
            sock.close()
            ctx.term()

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        try:
            req = msgpack.unpackb(frames[0], raw=False, strict_map_key=True) if len(frames) == 1 else None
        except Exception:  # noqa: BLE001 — any malformed bytes
            req = None
        if not isinstance(req, dict):
            return [_error("malformed request")]
        experiment = req.get("experiment")
        extra = self._ops.get(req["op"]) if isinstance(req.get("op"), str) else None
        subject = extra[0] if extra is not None else fetch_subject
        if not isinstance(experiment, str) or not _EXPERIMENT.fullmatch(experiment) \
                or not verify(self.secret, subject(experiment), req.get("token")):
            self.refused += 1
            return [_error("refused: no valid token for this experiment")]
        try:
            if extra is not None:
                return extra[1](experiment, req)
            if req.get("op") == "list":
                return [msgpack.packb({"ok": True, "shards": self._list(experiment)})]
            if req.get("op") == "read":
                return self._read(experiment, req)
        except (OSError, ValueError) as e:
            return [_error(f"{type(e).__name__}: {e}")]
        return [_error("unknown op")]

    def _list(self, experiment: str) -> list[list[int]]:
        """[step, shard, num_shards] of every shard directory with a manifest, newest steps first."""
        with self._lock:
            roots = list(self._roots)
        found: dict[tuple[int, int], int] = {}
        for root in roots:
            base = root / experiment / "shards"
            if not base.is_dir():
                continue
            for step_dir in base.iterdir():
                m = _STEP_DIR.fullmatch(step_dir.name)
                if not m or not step_dir.is_dir():
                    continue
                for shard_dir in step_dir.iterdir():
                    s = _SHARD_DIR.fullmatch(shard_dir.name)
                    if s and _regular(shard_dir / MANIFEST):
                        num = _num_shards(shard_dir / MANIFEST)
                        if num:
                            found.setdefault((int(m.group(1)), int(s.group(1))), num)
        rows = sorted(found.items(), key=lambda kv: (-kv[0][0], kv[0][1]))[:_MAX_LISTED]
        return [[step, shard, num] for (step, shard), num in rows]

    def _read(self, experiment: str, req: dict[str, Any]) -> list[bytes]:
        step, shard, offset, name = req.get("step"), req.get("shard"), req.get("offset"), req.get("file")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (step, shard, offset)) \
                or not isinstance(name, str):
            return [_error("read needs step, shard, offset (ints >= 0) and file")]
        with self._lock:
            roots = list(self._roots)
        for root in roots:
            d = shard_path(root, experiment, step, shard)  # type: ignore[arg-type]
            if _regular(d / MANIFEST):
                break
        else:
            return [_error(f"no shard {shard} of step {step} here")]
        if name != MANIFEST and name not in _listed(d / MANIFEST):
            return [_error(f"{name!r} is not a file the manifest lists")]
        path = d / name
        if not _regular(path):
            return [_error(f"{name!r} is not a regular file")]
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(offset)  # type: ignore[arg-type]
            blob = f.read(CHUNK)
        self.served_bytes += len(blob)
        return [msgpack.packb({"ok": True, "size": size, "eof": offset + len(blob) >= size}), blob]  # type: ignore[operator]


def _error(why: str) -> bytes:
    return msgpack.packb({"ok": False, "error": why})  # type: ignore[no-any-return]


def _manifest(path: Path) -> dict[str, Any]:
    if os.lstat(path).st_size > MAX_MANIFEST:
        raise ValueError(f"{path.name} is larger than {MAX_MANIFEST} bytes")
    m = json.loads(path.read_text())
    if not isinstance(m, dict):
        raise ValueError(f"{path} holds no map")
    return m


def _num_shards(path: Path) -> int:
    try:
        n = _manifest(path).get("num_shards")
    except (OSError, ValueError):
        return 0
    return n if isinstance(n, int) and n > 0 else 0


def _listed(path: Path) -> set[str]:
    """The bare file names a shard manifest lists."""
    files = _manifest(path).get("files")
    if not isinstance(files, dict):
        return set()
    return {n for n in files if isinstance(n, str) and n and "/" not in n and "\\" not in n and "\0" not in n
            and n not in (".", "..", MANIFEST)}
