"""The coordinator's HTTP side asks for its viewer token (or the join token) and gives browsers a viewer cookie."""

from __future__ import annotations

import dataclasses
import hmac
import logging
from http.cookies import CookieError, SimpleCookie
from urllib.parse import quote, unquote

from gossamer.transport.httpserver import Handler, Request, Response

log = logging.getLogger(__name__)

COOKIE = "gossamer_token"
#: Answered without the token: what load balancers and orchestrators probe.
OPEN_PATHS = ("/healthz",)
#: Where a browser may present `?token=` once to be given the cookie.
PAGE_PATHS = ("/", "/index.html")
REFUSED = ("token required: send `Authorization: Bearer <viewer token>` (curl -H \"Authorization: Bearer "
           "$(cat STATE_DIR/viewer.token)\"), or open /?token=<viewer token> once in a browser (it sets a cookie)\n")


class TokenGate:
    """Wraps route handlers so that each asks for the viewer token, or the join token (constant-time).

    Every route it guards only reads, so the join token is accepted too (scrapers and scripts set up
    with it keep working). The browser's cookie only ever holds the viewer token, whichever token
    `?token=` presented: the page stores nothing that could join a node or submit code.
    """

    def __init__(self, viewer: str, join: str | None = None) -> None:
        self._viewer = viewer.encode()
        self._join = join.encode() if join else None
        self._set_cookie = f"{COOKIE}={quote(viewer, safe='')}; Path=/; HttpOnly; SameSite=Strict"
        self.refused = 0

    def _is_viewer(self, presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(presented.encode(), self._viewer)

    def _is_join(self, presented: str | None) -> bool:
        return presented is not None and self._join is not None and hmac.compare_digest(presented.encode(), self._join)

    def _accepted(self, presented: str | None) -> bool:
        # Both compared every time: which one matched takes no measurably different time.
        viewer, join = self._is_viewer(presented), self._is_join(presented)
        return viewer or join

    @staticmethod
    def bearer(req: Request) -> str | None:
        """The token of `req`'s `Authorization: Bearer` header."""
        scheme, _, value = req.headers.get("authorization", "").partition(" ")
        return value.strip() if scheme.lower() == "bearer" and value.strip() else None

    @staticmethod
    def cookie(req: Request) -> str | None:
        """The value of `req`'s gossamer cookie."""
        try:
            jar = SimpleCookie(req.headers.get("cookie", ""))
        except CookieError:
            return None
        morsel = jar.get(COOKIE)
        return unquote(morsel.value) if morsel is not None else None

    def guard(self, path: str, handler: Handler) -> Handler:
        if path in OPEN_PATHS:
            return handler

        async def guarded(req: Request) -> Response:
            bearer, cookie = self.bearer(req), self.cookie(req)
            if bearer is not None and self._accepted(bearer):
                return await handler(req)
            if bearer is None and self._is_viewer(cookie):
                return await handler(req)
            if bearer is None and self._is_join(cookie):
                # A cookie set when the page stored the join token: served once more, and replaced.
                resp = await handler(req)
                return dataclasses.replace(resp, headers=(*resp.headers, ("Set-Cookie", self._set_cookie)))
            if path in PAGE_PATHS and self._accepted(req.query.get("token")):
                # The token leaves the address bar (and history) at once; the cookie carries the viewer token on.
                return Response(b"", 303, headers=(("Location", path), ("Set-Cookie", self._set_cookie)))
            self.refused += 1
            log.warning("HTTP %s refused: %s token", req.path, "wrong" if bearer or cookie else "missing")
            return Response.text(REFUSED, 401)

        return guarded
