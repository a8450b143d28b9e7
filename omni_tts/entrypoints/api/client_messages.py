"""A WebSocket session's client messages (WS /v1/audio/speech/stream, Qwen-TTS Realtime), read as they arrive
rather than when the session asks for the next, so that a close is seen while the session is busy (a sentence or a
narration is spoken before the next message is handled) and not only once the whole utterance was spoken.

At most MAX_BYTES_AHEAD of messages are held ahead of the session; beyond, the reading waits and the socket holds the
client back, as before. A close (the client's close frame, or the connection lost) cancels what the session is doing
at once: its requests end and its slot is freed as it unwinds, as when aiohttp cancels a handler whose connection
dropped. Where the session asks for it (`cancel_type`: our WebSocket's `input.cancel`), that message (barge-in) does
the same to the utterance alone: the messages held before it are dropped and the session's task is cancelled, to be
resumed by the session (`take_cancel`); elsewhere it is a message like any other.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Callable

import msgspec
from aiohttp import WSMessage, WSMsgType, web

from omni_tts.entrypoints.api.schema import ApiError, MessageType

from .errors import REQUEST_ERRORS, api_error

logger = logging.getLogger(__name__)

MAX_BYTES_AHEAD = 2**20
MESSAGE_OVERHEAD = 256   # what a held message costs beside its data: a text of one token is a few bytes
CLOSE_TYPES = (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR)


class ClientMessages:
    """The reading of one connection, a task of its own from `start` (in the session's task) to `stop` (before the
    session closes the connection)."""

    def __init__(self, ws: web.WebSocketResponse, ending: Callable[[], bool], cancel_type: str | None = None) -> None:
        """ending: whether the session is closing the connection itself (a close it caused cancels nothing);
        cancel_type: the type of the message that cancels the session's task (None: none does)."""
        self.ws, self.ending, self.cancel_type = ws, ending, cancel_type
        self.held: asyncio.Queue[WSMessage | None] = asyncio.Queue()   # None: the connection is closing
        self.held_bytes = 0
        self.room = asyncio.Event()
        self.session: asyncio.Task | None = None
        self.reader: asyncio.Task | None = None
        self.cancelled_session = False
        self.cancels = 0   # input.cancel messages read whose cancellation the session has not taken yet

    def start(self) -> None:
        self.session = asyncio.current_task()
        self.reader = asyncio.create_task(self._read())

    async def stop(self) -> None:
        """Reading stops. Called before the session closes the connection: aiohttp's close then completes the
        handshake, reading what the client still sends up to its close frame, where a close during a read would
        drop the connection at once, and data left unread would reset it (the client losing the events sent last,
        an error's among them)."""
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)

    def end(self) -> None:
        """The session closed the connection: `next` answers None."""
        self.held.put_nowait(None)

    def closed_by_client(self) -> bool:
        """In the session, on a CancelledError: whether the client's close alone caused it (the session then ends
        as if it had read the close); False when aiohttp cancelled the handler too."""
        return self.cancelled_session and self.session.uncancel() == 0

    def take_cancel(self) -> bool:
        """In the session, on a CancelledError: whether an input.cancel caused it (the session's task is then
        uncancelled, to go on with its next message); False for a close or aiohttp's cancellation."""
        if not self.cancels or self.cancelled_session:
            return False
        self.cancels -= 1
        self.session.uncancel()
        return True

    async def next(self, timeout: float) -> WSMessage | None:
        """The next message, None once the connection is closing; TimeoutError after `timeout` s without one."""
        message = await asyncio.wait_for(self.held.get(), timeout)
        if message is None:
            self.held.put_nowait(None)   # for a later call too
            return None
        self.held_bytes -= _cost(message)
        self.room.set()
        return message

    async def _read(self) -> None:
        while True:
            while self.held_bytes >= MAX_BYTES_AHEAD:
                self.room.clear()
                await self.room.wait()
            message = await self.ws.receive()
            if message.type in CLOSE_TYPES:
                self.held.put_nowait(None)
                if not self.ending():
                    self.cancelled_session = True
                    self.session.cancel()
                return
            if self.cancel_type is not None and _is_cancel(message, self.cancel_type):
                while not self.held.empty():   # sent before the cancel: not to be spoken
                    self.held.get_nowait()
                self.held_bytes = 0
                self.room.set()
                self.cancels += 1
                self.session.cancel()
                continue
            self.held_bytes += _cost(message)
            self.held.put_nowait(message)


def _is_cancel(message: WSMessage, cancel_type: str) -> bool:
    """A message of `cancel_type` (the substring first: most messages are text pieces, never decoded here)."""
    if message.type != WSMsgType.TEXT or cancel_type not in message.data:
        return False
    try:
        return msgspec.json.decode(message.data, type=MessageType).type == cancel_type
    except msgspec.DecodeError:
        return False


def _cost(message: WSMessage) -> int:
    return len(message.data) + MESSAGE_OVERHEAD


@contextlib.asynccontextmanager
async def session_ending(messages: ClientMessages, fail: Callable[[ApiError], Awaitable[None]],
                         close: Callable[[], Awaitable[None]], name: str) -> AsyncIterator[None]:
    """Around a WebSocket session's run, whatever its protocol: an error that ends a request is the protocol's error
    (`fail`), an unexpected one is logged and failed as a 500; the client's close (which cancels the session's task)
    or a connection lost while writing ends it quietly. However it ends, `close` runs shielded: a client that goes
    away cancels the handler, and the session's requests and slots must still be let go of."""
    try:
        yield
    except REQUEST_ERRORS as e:
        await fail(api_error(e))
    except asyncio.CancelledError:
        if not messages.closed_by_client():
            raise
    except ConnectionError:
        pass  # the connection closed while the session wrote to it: there is no one to tell
    except Exception:
        logger.exception("%s session failed", name)
        await fail(ApiError(500, "internal error; see the server log"))
    finally:
        await asyncio.shield(close())
