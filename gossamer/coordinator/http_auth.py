"""The coordinator's HTTP side asks for its token: `Authorization: Bearer`, or a cookie a browser gets from `/?token=` once."""

from __future__ import annotations

import hmac
import logging
from http.cookies import CookieError, SimpleCookie
from urllib.parse import quote

from gossamer.httpserver import Handler, Request, Response

log = logging.getLogger(__name__)

COOKIE = "gossamer_token"
#: Answered without the token: what load balancers and orchestrators probe.
OPEN_PATHS = ("/healthz",)
REFUSED = ("token required: send `Authorization: Bearer <token>` (curl -H \"Authorization: Bearer $(cat TOKEN)\"), "
           "or open /?token=<token> once in a browser (it sets a cookie)\n")


class TokenGate:
    """Wraps route handlers so that each asks for `token` (constant-time comparison)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        self.refused = 0

    def _matches(self, presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(presented.encode(), self._token)

    def presented(self, req: Request) -> str | None:
        """The token `req` carries: its Authorization header, else its cookie."""
        auth = req.headers.get("authorization", "")
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        try:
            jar = SimpleCookie(req.headers.get("cookie", ""))
        except CookieError:
            return None
        morsel = jar.get(COOKIE)
        return morsel.value if morsel is not None else None

    def guard(self, path: str, handler: Handler) -> Handler:
        if path in OPEN_PATHS:
            return handler

        async def guarded(req: Request) -> Response:
            if self._matches(self.presented(req)):
                return await handler(req)
            if path in ("/", "/index.html") and self._matches(req.query.get("token")):
                # The token leaves the address bar (and history) at once; the cookie carries it on.
                cookie = f"{COOKIE}={quote(req.query['token'])}; Path=/; HttpOnly; SameSite=Strict"
                return Response(b"", 303, headers=(("Location", path), ("Set-Cookie", cookie)))
            self.refused += 1
            log.warning("HTTP %s refused: %s token", req.path, "wrong" if self.presented(req) else "missing")
            return Response.text(REFUSED, 401)

        return guarded
