"""Shared fixtures: an in-process coordinator on port 0, and a local cluster of real processes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gossamer.coordinator import CoordinatorConfig, CoordinatorServer
from gossamer.local_cluster import LocalCluster


class InProcessCoordinator:
    """A real grpc.aio coordinator on its own event loop thread, bound to a free port."""

    def __init__(self, state_dir: Path, **kw: object) -> None:
        self.config = CoordinatorConfig(host="127.0.0.1", port=0, state_dir=str(state_dir), **kw)  # type: ignore[arg-type]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = CoordinatorServer(self.config)
        self.port = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def call(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[InProcessCoordinator]:
    c = InProcessCoordinator(tmp_path / "state", heartbeat_interval_s=0.2, lease_timeout_s=1.0)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path / "cluster", heartbeat_interval=0.5, lease_timeout=5.0) as c:
        yield c
