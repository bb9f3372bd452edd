"""Checkpoint files fetched from the node that holds them: a real file server on a real socket, real DCP checkpoints."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from gossamer.checkpoint.fetch import Source, fetch_newest
from gossamer.checkpoint.file_server import CHUNK, CheckpointFileServer
from gossamer.checkpoint.manifest import MANIFEST
from gossamer.checkpoint.sharded import ShardSnapshot, latest_good, load_flat, save_shard, step_dir
from gossamer.security.curve import CurveKeyPair
from gossamer.security.sender_tokens import fetch_token, new_key

EXP = "fetch-abc123"
NUMEL = 300_000  # 1.2 MB per shard's param: more than one CHUNK, so files stream in pieces


def _save(root: Path, step: int, shard: int, value: float) -> None:
    half = NUMEL // 2
    piece = {shard * half: {"param": torch.full((half,), value), "momentum_buffer": torch.full((half,), -value)}}
    save_shard(root, ShardSnapshot(EXP, step, shard, 2, NUMEL, step + shard, piece))


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[CheckpointFileServer, Path, str]]:
    """A node holding steps 10 and 20 of both shards, serving them with CURVE."""
    disk = tmp_path / "holder"
    root = disk / EXP / "shards"
    for step in (10, 20):
        for shard in (0, 1):
            _save(root, step, shard, step + shard / 10)
    keys = CurveKeyPair.generate()
    server = CheckpointFileServer(new_key(), (keys.public, keys.secret))
    server.add_root(disk)
    server.start("127.0.0.1")
    try:
        yield server, root, keys.public
    finally:
        server.stop()


def test_missing_shard_is_fetched_verified_and_restores_the_newest_step(
        tmp_path: Path, holder: tuple[CheckpointFileServer, Path, str]) -> None:
    server, held, key = holder
    here = tmp_path / "here" / EXP / "shards"
    _save(here, 10, 0, 10.0)  # this host wrote only its own shard: no step is complete here
    _save(here, 20, 0, 20.0)
    assert latest_good(here)[0] is None
    src = Source(server.endpoint, fetch_token(server.secret, EXP), key)
    note = fetch_newest(here, EXP, [src])
    assert note.startswith("fetched shard(s) [1] of checkpoint step 20"), note
    path, refused = latest_good(here)
    assert path == step_dir(here, 20) and not refused
    assert torch.equal(load_flat(path)["param"], load_flat(step_dir(held, 20))["param"])
    assert server.served_bytes > CHUNK  # streamed in more than one piece
    assert not list(step_dir(here, 20).glob(".shard-*"))  # no temporary directory left
    # Nothing newer to fetch the second time.
    assert fetch_newest(here, EXP, [src]).startswith("no checkpoint fetched"), note


def test_a_stranger_without_the_token_gets_nothing(tmp_path: Path, holder: tuple[CheckpointFileServer, Path, str]) -> None:
    server, _, key = holder
    here = tmp_path / "here" / EXP / "shards"
    wrong = Source(server.endpoint, fetch_token(new_key(), EXP), key)
    other_experiment = Source(server.endpoint, fetch_token(server.secret, "other-exp"), key)
    for src in (wrong, other_experiment):
        note = fetch_newest(here, EXP, [src])
        assert "refused" in note, note
    assert not here.exists() or not list(here.rglob("*.distcp"))
    assert server.refused >= 2 and server.served_bytes == 0


def test_only_files_the_manifest_lists_are_served(holder: tuple[CheckpointFileServer, Path, str]) -> None:
    server, held, key = holder
    (step_dir(held, 20) / "shard-001" / "secret.txt").write_text("not a checkpoint file")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    public, secret = zmq.curve_keypair()
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, key.encode()
    sock.connect(server.endpoint)
    try:
        for name in ("secret.txt", "../shard-000/.metadata", "/etc/passwd", ".."):
            sock.send(msgpack.packb({"op": "read", "experiment": EXP, "token": fetch_token(server.secret, EXP),
                                     "step": 20, "shard": 1, "file": name, "offset": 0}))
            assert sock.poll(10_000)
            answer = msgpack.unpackb(sock.recv_multipart()[0])
            assert answer["ok"] is False and "manifest" in answer["error"], (name, answer)
    finally:
        sock.close()
        ctx.term()


def test_a_file_that_does_not_match_the_manifest_is_not_placed(
        tmp_path: Path, holder: tuple[CheckpointFileServer, Path, str]) -> None:
    server, held, key = holder
    data = next((step_dir(held, 20) / "shard-001").glob("*.distcp"))
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0x10
    data.write_bytes(bytes(blob))
    here = tmp_path / "here" / EXP / "shards"
    _save(here, 10, 0, 10.0)
    _save(here, 20, 0, 20.0)
    note = fetch_newest(here, EXP, [Source(server.endpoint, fetch_token(server.secret, EXP), key)])
    # Step 20's shard 1 is refused (sha256), so step 10, the newest the holder completes, is fetched.
    assert note.startswith("fetched shard(s) [1] of checkpoint step 10") and "sha256" in note, note
    assert not (step_dir(here, 20) / "shard-001").exists()
    assert latest_good(here)[0] == step_dir(here, 10)
    assert not (step_dir(here, 20) / "shard-001" / MANIFEST).exists()


def test_a_holder_that_never_answers_costs_no_more_than_the_deadline(tmp_path: Path) -> None:
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # takes requests, answers none
    silent.linger = 0
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        t0 = time.monotonic()
        note = fetch_newest(tmp_path / EXP / "shards", EXP, [Source(f"tcp://127.0.0.1:{port}", "x" * 64)],
                            timeout_s=1.0)
        took = time.monotonic() - t0
    finally:
        silent.close()
        ctx.term()
    assert note.startswith("no checkpoint fetched") and "did not answer list" in note, note
    assert took < 10.0, took  # bounded by the deadline, not by the 10 s a request may wait


def test_a_malformed_source_is_skipped_and_the_others_still_serve(
        tmp_path: Path, holder: tuple[CheckpointFileServer, Path, str]) -> None:
    server, _, key = holder
    here = tmp_path / "here" / EXP / "shards"
    bad = Source("tcp://no-port-here", "x" * 64, "not a key")
    note = fetch_newest(here, EXP, [bad, Source(server.endpoint, fetch_token(server.secret, EXP), key)])
    assert note.startswith("fetched shard(s) [0, 1] of checkpoint step 20") and "no-port-here" in note, note
