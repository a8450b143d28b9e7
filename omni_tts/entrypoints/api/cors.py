"""CORS: browsers on the origins `--allowed-origins` names may call the API; none may by default.

vLLM allows every origin unless told otherwise; a TTS server that spends compute on every call (and may hold an API
key) should not be callable from any page a user happens to open, so here the list starts empty. Preflights are
answered before the API key is checked (a browser never sends credentials on one); the answer names the origin, not
`*`, so an `Authorization` header may follow.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection

from aiohttp import web

ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
# what a page may read of an answer beyond the CORS-safelisted headers
EXPOSED_HEADERS = ("X-Request-Id, x-omni-tts-audio-seconds, x-omni-tts-finish-reason, x-omni-tts-input-tokens, "
                   "x-omni-tts-output-tokens, x-omni-tts-voice-ignored, Retry-After")
PREFLIGHT_MAX_AGE = "600"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Cors:
    """`middleware()` answers preflights; `add_headers` (an on_response_prepare hook, so streamed answers get them
    too) marks every answer to an allowed origin."""

    def __init__(self, allowed_origins: Collection[str]) -> None:
        self.any_origin = "*" in allowed_origins
        self.origins = frozenset(o.rstrip("/") for o in allowed_origins)

    def allows(self, origin: str | None) -> bool:
        return origin is not None and (self.any_origin or origin in self.origins)

    def middleware(self) -> Callable:
        @web.middleware
        async def answer_preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
            if (request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers
                    and self.allows(request.headers.get("Origin"))):
                return web.Response(status=204, headers={
                    "Access-Control-Allow-Methods": ALLOWED_METHODS,
                    "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", ""),
                    "Access-Control-Max-Age": PREFLIGHT_MAX_AGE})
            return await handler(request)
        return answer_preflight

    async def add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if self.allows(origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
            response.headers.add("Vary", "Origin")
