"""The server's life on one event loop, from its bound socket to its exit status.

Loading: the socket answers at once, every route 503 with the OpenAI envelope (so a probe sees a live server that
is not ready, instead of a connection that hangs), while the pipeline is built in a thread and its stages start.
Serving: the app (app.py). Stopping: the first SIGINT or SIGTERM drains (new requests, and new utterances of open
WebSocket sessions, are answered 503 while the listener stays open; the requests in flight finish; exit status 0);
a second one ends the requests in flight at once (each ends as a pipeline failure does, `api/responders.py`; one
still running END_GRACE later is cut, its access-log line saying `shutdown`; exit status 128 + its number: 130 for
Ctrl-C). A signal while loading stops at once, with that status too.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from typing import TYPE_CHECKING, Callable

from aiohttp import web

from omni_tts.entrypoints.api.schema import ApiError

if TYPE_CHECKING:  # imported where they are used: the loading server answers before these (and torch) are loaded
    from omni_tts.orchestrator.tts_client import TTSClient

    from .server_config import ServerConfig

    # what loading yields: the pipeline (not started), the app's config and the line to log once it serves
    Loaded = tuple[TTSClient, ServerConfig, str]

logger = logging.getLogger("omni_tts.serve")

LOADING = "the server is loading the model; retry shortly"
# seconds the handlers of ended requests get to write their ends (an error event, a cut stream) before they are
# cancelled; after a drain only refusals and idle connections are left, which take far less
END_GRACE = 2.0


def serve(listener: socket.socket, load: Callable[[], Loaded], keepalive_timeout: float) -> int:
    """Serve on `listener` what `load` (blocking; run in a thread) builds, until stopped. The exit status: 0 after a
    drain, 128 + the signal's number when a signal ended loading or a drain; StageDeadError when the stages did not
    start."""
    server = _Server(listener, load, keepalive_timeout)
    try:
        return asyncio.run(server.run())
    finally:
        # the loop and its handlers are gone; a Ctrl-C now would only interrupt the exit with a traceback
        signal.signal(signal.SIGINT, signal.SIG_IGN)


class _Server:
    def __init__(self, listener: socket.socket, load: Callable[[], Loaded], keepalive_timeout: float) -> None:
        self.listener, self.load, self.keepalive_timeout = listener, load, keepalive_timeout
        self.stop: asyncio.Future[int] | None = None    # the first signal
        self.abort: asyncio.Future[int] | None = None   # the second

    def _on_signal(self, signum: int) -> None:
        for future in (self.stop, self.abort):
            if not future.done():
                future.set_result(signum)
                return

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.stop, self.abort = loop.create_future(), loop.create_future()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._on_signal, signum)
        loading = await _loading_server(self.listener.dup())  # the dup is closed with it; the listener stays open
        try:
            starting = asyncio.ensure_future(self._start())
            await asyncio.wait([starting, self.stop], return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                starting.cancel()
                await asyncio.wait([starting])
                logger.warning("stopped while loading (%s)", signal.Signals(self.stop.result()).name)
                return 128 + self.stop.result()
            tts, config, ready = starting.result()
            from .access_log import ACCESS_LOG, AccessLogger
            from .app import build_app
            try:
                runner = web.AppRunner(build_app(tts, config), handler_cancellation=True,
                                       keepalive_timeout=self.keepalive_timeout, shutdown_timeout=END_GRACE,
                                       access_log_class=AccessLogger, access_log=ACCESS_LOG)
                await runner.setup()
            except BaseException:
                await tts.shutdown()
                raise
        finally:
            await loading.cleanup()
        return await self._serve(tts, runner, ready)

    async def _start(self) -> Loaded:
        tts, config, ready = await _in_thread(self.load)
        await tts.start()
        return tts, config, ready

    async def _serve(self, tts: TTSClient, runner: web.AppRunner, ready: str) -> int:
        from .state import STATE
        in_flight = runner.app[STATE].in_flight
        try:
            await web.SockSite(runner, self.listener).start()
            logger.info("%s", ready)
            await self.stop
            in_flight.close()
            if tts.fatal is None:  # else the pipeline gave up (its line said why) and failed what was in flight
                logger.warning("shutting down: finishing %d stream%s (Ctrl-C again to stop now)", len(in_flight),
                               "" if len(in_flight) == 1 else "s")
            drained = asyncio.ensure_future(in_flight.wait_idle())
            await asyncio.wait([drained, self.abort], return_when=asyncio.FIRST_COMPLETED)
            drained.cancel()
        finally:
            if self.abort.done():
                logger.warning("stopping now: ending %d stream%s", len(in_flight), "" if len(in_flight) == 1 else "s")
                in_flight.end()
                await tts.shutdown()  # fails what is in flight: each handler ends its answer
                await runner.cleanup()
            else:
                await runner.cleanup()
                await tts.shutdown()
        return 128 + self.abort.result() if self.abort.done() else 0


async def _loading_server(sock: socket.socket) -> web.AppRunner:
    """Answers every request 503 (and closes the connection: none outlives the loading) on `sock`."""
    async def loading(request: web.Request) -> web.Response:
        # loading takes seconds to minutes: a probe or client need not come back within the second
        response = web.json_response(ApiError(503, LOADING).body(), status=503, headers={"Retry-After": "5"})
        response.force_close()
        return response

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", loading)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=END_GRACE)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner


async def _in_thread(fn: Callable[[], Loaded]) -> Loaded:
    """`fn()` in a daemon thread: a signal while it runs (a download, torch's import) must not wait for it, and the
    process may exit under it."""
    loop = asyncio.get_running_loop()
    result: asyncio.Future[Loaded] = loop.create_future()

    def settle(value: Loaded | None, error: BaseException | None) -> None:
        if not result.done():
            result.set_exception(error) if error is not None else result.set_result(value)

    def work() -> None:
        try:
            value, error = fn(), None
        except BaseException as e:  # noqa: BLE001 — handed to the loop, which raises it
            value, error = None, e
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for it
            pass

    threading.Thread(target=work, name="omni-tts-load", daemon=True).start()
    return await result
