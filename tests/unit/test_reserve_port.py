"""A reserved master port: nobody else gets it while it is held, and the process group's store still binds it."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

from gossamer.node.ports import reserve_port


def test_a_held_port_is_refused_to_others_and_taken_by_the_store() -> None:
    with reserve_port() as hold:
        port = hold.getsockname()[1]
        with socket.socket() as stranger, pytest.raises(OSError):
            stranger.bind(("127.0.0.1", port))  # the race the hold closes: another test's server taking it
        for _ in range(50):  # nor does the kernel hand it out as a fresh port
            with socket.socket() as other:
                other.bind(("127.0.0.1", 0))
                assert other.getsockname()[1] != port
        store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10))
        store.set("k", "v")
        assert store.get("k") == b"v"
        assert store.port == port
