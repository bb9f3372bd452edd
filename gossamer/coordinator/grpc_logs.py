"""Keeps grpc.aio's ERROR for an answer to a client that already left out of the coordinator's error log."""

from __future__ import annotations

import logging

#: What grpc.aio logs (at ERROR, from `grpc._cython.cygrpc`) when it cannot send a reply or the
#: final status because the call is already dead: the client cancelled, timed out or dropped
#: the connection first (grpc/grpc#32551). A stranger does that at will, and a loaded machine
#: does it to honest clients; the server is unharmed and nothing is lost.
_CLIENT_GONE = "ExecuteBatchError raised in core by servicer method"


class ClientGone(logging.Filter):
    """Lowers that record to DEBUG (kept, not dropped): an error line must mean a fault of ours."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and _CLIENT_GONE in record.getMessage():
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def install() -> None:
    """Install `ClientGone` on grpc.aio's logger (once per process)."""
    logger = logging.getLogger("grpc._cython.cygrpc")
    if not any(isinstance(f, ClientGone) for f in logger.filters):
        logger.addFilter(ClientGone())
