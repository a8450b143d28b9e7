"""The requests a server is answering, counted until their answer is written (`middleware`), so that a stopping
server can refuse new ones (`close`: 503), wait for these (`wait_idle`) or end them now (`end`)."""
from __future__ import annotations

import asyncio

from aiohttp import web

from omni_tts.entrypoints.api.schema import ApiError

from .errors import error_response

STOPPING = "the server is shutting down; retry shortly"


class InFlight:
    def __init__(self) -> None:
        self.count = 0
        self.closed = False
        self.ending = False   # the server ends what is in flight now
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return self.count

    def close(self) -> None:
        """From now on requests are refused (503)."""
        self.closed = True

    def end(self) -> None:
        """From now on what is in flight is ended by the server: a handler cancelled now was cut by its stop."""
        self.ending = True

    def why_cut(self) -> str:
        """Why a handler was cancelled: `shutdown` (the server's stop ended it, `end`), else `disconnect` (its client
        went away: aiohttp cancels the handler of a lost connection)."""
        return "shutdown" if self.ending else "disconnect"

    async def wait_idle(self) -> None:
        """Returns once no request is in flight."""
        await self._idle.wait()

    def _enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        if self.closed:
            response = error_response(ApiError(503, STOPPING))
            response.force_close()  # a keep-alive connection would only bring the next request here
            return response
        self._enter()
        try:
            response = await handler(request)
            if not response.prepared:  # written here rather than after the handler returns: it counts until sent
                await response.prepare(request)
                await response.write_eof()
            return response
        finally:
            self._leave()
