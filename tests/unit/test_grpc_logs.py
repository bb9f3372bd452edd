"""grpc.aio's ERROR for an answer to a client that already left is lowered to DEBUG; other errors stay."""

from __future__ import annotations

import logging

import pytest

from gossamer.coordinator import grpc_logs


def test_a_reply_to_a_gone_client_is_debug_and_other_errors_stay_errors(caplog: pytest.LogCaptureFixture) -> None:
    grpc_logs.install()
    grpc_logs.install()  # once per process, however often a server starts
    logger = logging.getLogger("grpc._cython.cygrpc")
    assert sum(isinstance(f, grpc_logs.ClientGone) for f in logger.filters) == 1
    with caplog.at_level(logging.DEBUG):
        logger.error("ExecuteBatchError raised in core by servicer method [/gossamer.v1.NodeService/WatchAssignments]")
        logger.error("Unexpected [ValueError] raised by servicer method [/x]")
    levels = [(r.levelname, r.getMessage()[:10]) for r in caplog.records]
    assert levels == [("DEBUG", "ExecuteBat"), ("ERROR", "Unexpected")]
