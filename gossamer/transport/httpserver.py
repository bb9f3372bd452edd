"""A small asyncio HTTP/1.1 server (GET/HEAD only, bounded) for /metrics, the status page and health checks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

log = logging.getLogger(__name__)

#: Request line plus headers; anything longer is refused with 431.
MAX_HEAD_BYTES = 16 * 1024
#: Seconds a client has to send its request head.
READ_TIMEOUT_S = 10.0
#: Connections served at once; more are answered 503 at once.
MAX_CONNECTIONS = 64

_REASONS = {200: "OK", 303: "See Other", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Response:
    body: bytes = b""
    status: int = 200
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()  # more response headers (Location, Set-Cookie, ...)

    @classmethod
    def text(cls, text: str, status: int = 200) -> Response:
        return cls(text.encode(), status)


Handler = Callable[[Request], Awaitable[Response]]


class HttpServer:
    """Serves `routes` ({path: handler}) on one asyncio loop; one request per connection.

    Bad requests get a 4xx and the connection closes; a handler that raises gets a 500 and
    is logged. Nothing a client sends can stop the server.
    """

    def __init__(self, routes: dict[str, Handler], *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.routes = routes
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._active = 0

    async def start(self) -> int:
        """Bind and serve; returns the bound port (a free one when `port` is 0)."""
        self._server = await asyncio.start_server(self._handle, self.host, self.port, limit=MAX_HEAD_BYTES)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._active += 1
        try:
            if self._active > MAX_CONNECTIONS:
                await self._send(writer, "GET", Response.text("too many connections\n", 503))
                return
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            except asyncio.TimeoutError:
                await self._send(writer, "GET", Response.text("request head not received in time\n", 408))
                return
            except asyncio.LimitOverrunError:
                await self._send(writer, "GET", Response.text("request head too large\n", 431))
                return
            except asyncio.IncompleteReadError:
                return  # the client went away
            req = _parse(head)
            if req is None:
                await self._send(writer, "GET", Response.text("malformed request\n", 400))
                return
            if req.method not in ("GET", "HEAD"):
                await self._send(writer, "GET", Response.text(f"method {req.method} not allowed\n", 405))
                return
            handler = self.routes.get(req.path)
            if handler is None:
                await self._send(writer, req.method, Response.text(f"no such page: {req.path}\n", 404))
                return
            try:
                resp = await handler(req)
            except Exception as e:  # noqa: BLE001 — a broken page must not take the server down
                log.exception("HTTP %s %s failed", req.method, req.path)
                resp = Response.text(f"internal error: {type(e).__name__}: {e}\n", 500)
            await self._send(writer, req.method, resp)
        except (ConnectionError, OSError):
            pass
        finally:
            self._active -= 1
            writer.close()

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, method: str, resp: Response) -> None:
        head = (
            f"HTTP/1.1 {resp.status} {_REASONS.get(resp.status, 'Unknown')}\r\n"
            f"Content-Type: {resp.content_type}\r\nContent-Length: {len(resp.body)}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in resp.headers if "\r" not in v and "\n" not in v)
            + "Cache-Control: no-store\r\nConnection: close\r\n\r\n"
        )
        writer.write(head.encode("latin-1") + (resp.body if method != "HEAD" else b""))
        await writer.drain()


def _parse(head: bytes) -> Request | None:
    try:
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        return None
    if not version.startswith("HTTP/1.") or not method.isalpha() or not target.startswith("/"):
        return None
    headers = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            return None
        headers[name.strip().lower()] = value.strip()
    parts = urlsplit(target)
    return Request(method=method.upper(), path=unquote(parts.path), query=dict(parse_qsl(parts.query)),
                   headers=headers)
