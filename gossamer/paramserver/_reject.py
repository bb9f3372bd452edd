"""`Reject`: a request the shard answers with an ERROR reply, applying nothing of it."""

from __future__ import annotations

from gossamer.transport.router import INVALID_ARGUMENT

__all__ = ["Reject"]


class Reject(Exception):
    """A request that gets an ERROR reply with `code`; nothing of it is applied.

    `cause`: the counter of discarded updates a refused PUSH is counted under.
    """

    def __init__(self, message: str, code: str = INVALID_ARGUMENT, cause: str = "rejected") -> None:
        super().__init__(message)
        self.code = code
        self.cause = cause
