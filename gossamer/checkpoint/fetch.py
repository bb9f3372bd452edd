"""Fetching the shard checkpoint files a restoring shard lacks from the nodes that hold them (`file_server`)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import zmq

from gossamer.checkpoint.file_server import CHUNK, MAX_MANIFEST
from gossamer.checkpoint.manifest import MANIFEST, fsync_dir, replace_dir, write_synced
from gossamer.checkpoint.sharded import FORMAT, step_dir

__all__ = ["FETCH_TIMEOUT_S", "FetchError", "Source", "ask", "fetch_newest"]

#: How long a restoring shard may spend fetching before it goes on without (then the workers' copies).
FETCH_TIMEOUT_S = 120.0
#: How long one request may wait for its answer.
REQUEST_TIMEOUT_S = 10.0
_STEP = re.compile(r"step-(\d+)")
_SHARD = re.compile(r"shard-(\d+)")


class FetchError(Exception):
    """A source did not answer, refused, or sent something that does not match the manifest."""


@dataclass(frozen=True)
class Source:
    """A node holding checkpoint files: its file server, the fetch token, its CURVE key ("": plaintext)."""

    endpoint: str
    token: str
    server_key: str = ""


class _Conn:
    """One request at a time to one file server, each answered within the deadline or FetchError."""

    def __init__(self, ctx: zmq.Context, src: Source, experiment: str, deadline: float) -> None:
        self.src, self.experiment, self.deadline = src, experiment, deadline
        self.broken = ""  # a request went unanswered: a late answer would be taken for the next one's
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        try:
            self.sock.maxmsgsize = CHUNK + (64 << 10)  # a server cannot make this side hold more than a chunk
            if src.server_key:
                public, secret = zmq.curve_keypair()  # a throwaway identity: the token is the authority
                self.sock.curve_publickey, self.sock.curve_secretkey = public, secret
                self.sock.curve_serverkey = src.server_key.encode("ascii")
            self.sock.connect(src.endpoint)
        except BaseException:
            self.sock.close()  # else the context's term() would wait for it for ever
            raise

    def ask(self, op: str, **fields: Any) -> tuple[dict[str, Any], bytes]:
        if self.broken:
            raise FetchError(self.broken)
        wait = min(REQUEST_TIMEOUT_S, self.deadline - time.monotonic())
        if wait <= 0:
            raise FetchError("the fetch deadline passed")
        self.sock.send(msgpack.packb({"op": op, "experiment": self.experiment, "token": self.src.token, **fields}))
        if not self.sock.poll(int(wait * 1000)):
            self.broken = f"{self.src.endpoint} did not answer {op} within {wait:.0f} s"
            raise FetchError(self.broken)
        frames = self.sock.recv_multipart()
        try:
            meta = msgpack.unpackb(frames[0], raw=False, strict_map_key=True)
        except Exception as e:  # noqa: BLE001 — any malformed bytes
            raise FetchError(f"{self.src.endpoint}: malformed answer") from e
        if not isinstance(meta, dict) or meta.get("ok") is not True:
            why = meta.get("error") if isinstance(meta, dict) else None
            raise FetchError(f"{self.src.endpoint} refused {op}: {why}")
        return meta, frames[1] if len(frames) > 1 else b""

    def close(self) -> None:
        self.sock.close()


def ask(src: Source, experiment: str, op: str, timeout_s: float = REQUEST_TIMEOUT_S,
        **fields: Any) -> tuple[dict[str, Any], bytes]:
    """One request to a node's file server on a socket of its own: the answer's header and its data frame.

    Raises:
        FetchError: no answer within `timeout_s`, a refusal (with the server's reason), or a malformed answer.
    """
    ctx = zmq.Context()
    try:
        conn = _Conn(ctx, src, experiment, time.monotonic() + timeout_s)
    except (zmq.ZMQError, ValueError) as e:
        ctx.term()
        raise FetchError(f"{src.endpoint}: {e}") from None
    try:
        return conn.ask(op, **fields)
    finally:
        conn.close()
        ctx.term()


def _local(root: Path) -> dict[int, set[int]]:
    """step -> the shards with a manifest under `root` (this host's copies)."""
    out: dict[int, set[int]] = {}
    if not root.is_dir():
        return out
    for d in root.iterdir():
        m = _STEP.fullmatch(d.name)
        if m and d.is_dir():
            out[int(m.group(1))] = {int(s.group(1)) for p in d.iterdir()
                                     if (s := _SHARD.fullmatch(p.name)) and (p / MANIFEST).is_file()}
    return out


def _listing(conns: dict[str, _Conn]) -> tuple[dict[int, dict[int, list[str]]], dict[int, int], list[str]]:
    """(step -> shard -> endpoints holding it, step -> num_shards, what failed) over every source."""
    held: dict[int, dict[int, list[str]]] = {}
    nums: dict[int, int] = {}
    notes = []
    for endpoint, conn in conns.items():
        try:
            rows = conn.ask("list")[0].get("shards")
        except FetchError as e:
            notes.append(str(e))
            continue
        for row in rows if isinstance(rows, list) else []:
            if isinstance(row, list) and len(row) == 3 and all(isinstance(x, int) and x >= 0 for x in row):
                step, shard, num = row
                held.setdefault(step, {}).setdefault(shard, []).append(endpoint)
                nums.setdefault(step, num)
    return held, nums, notes


def fetch_newest(root: str | os.PathLike[str], experiment: str, sources: Sequence[Source],
                 timeout_s: float = FETCH_TIMEOUT_S) -> str:
    """Bring the newest checkpoint step the sources can complete into `root`, if newer than a local one.

    `root` is this host's shard checkpoint directory of `experiment` (`.../EXPERIMENT/shards`).
    The shard directories of that step missing here are fetched (manifest first, then each file
    it lists, in `CHUNK` pieces, checked against its size and sha256) into a hidden directory and
    renamed into place. What happened, in words; failures are said there, never raised.
    """
    root = Path(root)
    deadline = time.monotonic() + timeout_s
    local = _local(root)
    ctx = zmq.Context()
    conns: dict[str, _Conn] = {}
    bad = []
    for src in sources:
        try:
            conns[src.endpoint] = _Conn(ctx, src, experiment, deadline)
        except (zmq.ZMQError, ValueError) as e:  # a malformed endpoint or key: that source is skipped
            bad.append(f"{src.endpoint}: {e}")
    try:
        held, nums, notes = _listing(conns)
        notes = bad + notes
        newest_here = max((s for s, shards in local.items() if nums.get(s) and len(shards) >= nums[s]), default=-1)
        for step in sorted((s for s in held if s > newest_here), reverse=True):
            num = nums[step]
            have = local.get(step, set())
            missing = [s for s in range(num) if s not in have]
            if any(s not in held[step] for s in missing):
                continue  # no source completes this step
            got = _fetch_step(conns, root, experiment, step, {s: held[step][s] for s in missing}, notes)
            if got is not None:
                return f"fetched shard(s) {missing} of checkpoint step {step} from {', '.join(sorted(got))}" + \
                    (f" (after: {'; '.join(notes)})" if notes else "")
        what = "no source held a newer complete checkpoint than this host's" if not notes else "; ".join(notes)
        return f"no checkpoint fetched ({what})"
    finally:
        for conn in conns.values():
            conn.close()
        ctx.term()


def _fetch_step(conns: dict[str, _Conn], root: Path, experiment: str, step: int,
                holders: dict[int, list[str]], notes: list[str]) -> set[str] | None:
    """Fetch each missing shard of `step` from the first holder that serves it whole; the endpoints used."""
    used = set()
    for shard, endpoints in holders.items():
        for endpoint in endpoints:
            try:
                _fetch_shard(conns[endpoint], step_dir(root, step) / f"shard-{shard:03d}", step, shard)
                used.add(endpoint)
                break
            except (FetchError, OSError, ValueError) as e:
                notes.append(f"shard {shard} of step {step} from {endpoint}: {e}")
        else:
            return None
    return used


def _fetch_shard(conn: _Conn, dest: Path, step: int, shard: int) -> None:
    """One shard directory: the manifest, then its files, verified, renamed into place complete."""
    raw = _read_manifest(conn, step, shard)
    files = _check_manifest(raw, conn.experiment, step, shard)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fsync_dir(dest.parent.parent)
    tmp = dest.parent / f".{dest.name}.fetch-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()
    try:
        for name, (size, digest) in files.items():
            _read_file(conn, tmp / name, step, shard, name, size, digest)
        write_synced(tmp / MANIFEST, raw)  # last, as a writer does: a directory with one is complete
        fsync_dir(tmp)
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _read_manifest(conn: _Conn, step: int, shard: int) -> bytes:
    out = bytearray()
    while True:
        meta, blob = conn.ask("read", step=step, shard=shard, file=MANIFEST, offset=len(out))
        out += blob
        if len(out) > MAX_MANIFEST:
            raise FetchError(f"{MANIFEST} of shard {shard} is larger than {MAX_MANIFEST} bytes")
        if meta.get("eof") is True:
            return bytes(out)
        if not blob:
            raise FetchError(f"{MANIFEST} of shard {shard}: an empty read before its end")


def _check_manifest(raw: bytes, experiment: str, step: int, shard: int) -> dict[str, tuple[int, str]]:
    """name -> (bytes, sha256) of the files a fetched manifest lists; FetchError unless it is a shard's of this step."""
    try:
        m = json.loads(raw)
    except ValueError as e:
        raise FetchError(f"the {MANIFEST} of shard {shard} is not JSON: {e}") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise FetchError(f"the {MANIFEST} of shard {shard} is not a {FORMAT} manifest")
    if (m.get("experiment"), m.get("step"), m.get("shard")) != (experiment, step, shard):
        raise FetchError(f"the {MANIFEST} fetched for shard {shard} of step {step} says shard {m.get('shard')!r} "
                         f"of step {m.get('step')!r} of {m.get('experiment')!r}")
    files = m.get("files")
    if not isinstance(files, dict):
        raise FetchError(f"the {MANIFEST} of shard {shard} lists no files")
    out = {}
    for name, entry in files.items():
        # Bare names only: the file lands beside the manifest, never elsewhere: a name from a stranger's manifest must not write outside the checkpoint.
        if not isinstance(name, str) or name in ("", ".", "..", MANIFEST) or any(c in name for c in "/\\\0"):
            raise FetchError(f"the {MANIFEST} of shard {shard} names {name!r}: only bare file names are allowed")
        size, digest = (entry.get("bytes"), entry.get("sha256")) if isinstance(entry, dict) else (None, None)
        if not isinstance(size, int) or size < 0 or not isinstance(digest, str):
            raise FetchError(f"the {MANIFEST} of shard {shard}: entry {name!r} has no size and sha256")
        out[name] = (size, digest)
    return out


def _read_file(conn: _Conn, path: Path, step: int, shard: int, name: str, size: int, digest: str) -> None:
    """Stream one file to `path` in chunks; FetchError unless it has exactly the manifest's size and sha256."""
    h, offset = hashlib.sha256(), 0
    with open(path, "xb") as f:
        while True:
            meta, blob = conn.ask("read", step=step, shard=shard, file=name, offset=offset)
            offset += len(blob)
            if offset > size:
                raise FetchError(f"{name} of shard {shard}: more than the manifest's {size} bytes")
            h.update(blob)
            f.write(blob)
            if meta.get("eof") is True:
                break
            if not blob:
                raise FetchError(f"{name} of shard {shard}: an empty read before its end")
        f.flush()
        os.fsync(f.fileno())
    if offset != size or h.hexdigest() != digest:
        raise FetchError(f"{name} of shard {shard}: {offset} bytes, sha256 {h.hexdigest()[:12]}..., not the "
                         f"manifest's {size} bytes, {digest[:12]}...")
