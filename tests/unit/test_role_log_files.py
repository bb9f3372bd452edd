"""A node's role logs over its real file server: the coordinator's token reads them, bounded; a fetch token does not."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gossamer.checkpoint.fetch import FetchError, Source, ask
from gossamer.checkpoint.file_server import CheckpointFileServer
from gossamer.core.role_log_names import LOG_TAIL, log_stem, parse_stem
from gossamer.node.role_log_files import RoleLogs, record_to_files
from gossamer.security.sender_tokens import fetch_token, log_subject, log_token, new_key


def test_stems_name_each_role_and_nothing_else() -> None:
    for kw in ({"worker": True, "index": 3, "local_rank": 1}, {"worker": False, "index": 2, "replica": 1},
               {"worker": False, "index": 0}):
        stem = log_stem(**kw)  # type: ignore[arg-type]
        assert parse_stem(stem) is not None and parse_stem(stem).name == stem  # type: ignore[union-attr]
    for bad in ("../x", "worker-1", "ps-1.log", "worker-1.rank0/..", ""):
        assert parse_stem(bad) is None


def test_a_logged_failure_is_the_roles_last_traceback(tmp_path: Path) -> None:
    root = logging.getLogger()
    before = list(root.handlers)
    path = tmp_path / "exp" / "worker-0.rank0.log"
    try:
        record_to_files(str(path))
        logging.getLogger("user").warning("step 1")
        try:
            raise ValueError("bad width 7")
        except ValueError:
            logging.getLogger("user").exception("the role failed")
    finally:
        for h in root.handlers[len(before):]:
            h.close()
            root.removeHandler(h)
    assert "step 1" in path.read_text() and "bad width 7" in path.read_text()
    tb = path.with_suffix(".traceback").read_text()
    assert tb.startswith("Traceback (most recent call last)") and "ValueError: bad width 7" in tb


def test_the_file_server_answers_logs_to_a_log_token_only_and_bounded(tmp_path: Path) -> None:
    logs = RoleLogs(tmp_path)
    path = logs.path("exp", "ps-0")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"".join(b"line %06d\n" % i for i in range(30_000)))  # 330 kB
    secret = new_key()
    server = CheckpointFileServer(secret)
    server.add_op("logs", log_subject, logs.answer)
    endpoint = server.start("127.0.0.1")
    try:
        with pytest.raises(FetchError, match="refused"):
            ask(Source(endpoint, fetch_token(secret, "exp")), "exp", "logs")
        src = Source(endpoint, log_token(secret, "exp"))
        with pytest.raises(FetchError, match="refused"):  # the log token reads no checkpoint files either
            ask(src, "exp", "list")
        meta, _ = ask(src, "exp", "logs")
        assert [e["stem"] for e in meta["logs"]] == ["ps-0"]
        meta, blob = ask(src, "exp", "logs", stem="ps-0", max=10 << 20)
        size = path.stat().st_size
        assert len(blob) == LOG_TAIL and meta["end"] == size and blob == path.read_bytes()[-LOG_TAIL:]
        with open(path, "ab") as f:
            f.write(b"new line\n")
        meta, blob = ask(src, "exp", "logs", stem="ps-0", offset=size)  # a follower's next read
        assert blob == b"new line\n" and meta["start"] == size
        with pytest.raises(FetchError, match="not a role log"):
            ask(src, "exp", "logs", stem="../../etc/passwd")
    finally:
        server.stop()
