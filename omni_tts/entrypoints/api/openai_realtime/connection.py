"""GET /v1/realtime?model=…: the OpenAI Realtime API (GA) over a WebSocket, the subset that reads text aloud.

A connection is one session: `session.created` first, then the client's events one at a time (`events.py`), each
answered at once; a response's audio goes out from a task of its own (`response.py`), so `response.cancel` is read
while it streams. One response runs at a time. An error about one event is an `error` event and the session goes on,
as OpenAI's; an oversized message or MAX_IDLE without an event while nothing is spoken ends it: the error event, then
a clean close. Whatever ends the connection, the response in progress is cut and its slot freed.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
from aiohttp import WSMessage, WSMsgType, web

from omni_tts.entrypoints.api.schema import MAX_NAME_CHARS, ApiError, SpeechOptions, describe_fields

from ..access_log import SessionLog
from ..auth import REALTIME_PATH, REALTIME_PROTOCOL
from ..client_messages import CLOSE_TYPES
from ..errors import REQUEST_ERRORS, api_error
from ..speech_turn import TurnVoice, check_text_length, prepare_voice
from ..state import STATE, ServerState
from .conversation import Conversation
from .events import (ItemCreate, ItemDelete, ItemRetrieve, ResponseCancel, ResponseCreate, SessionFields,
                     SessionUpdate, decode_event, decode_head, error_event, new_id, session_keys)
from .response import RealtimeResponse
from .session import RealtimeSession

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 2**10   # a text item is at most MAX_TEXT_CHARS: room for its JSON escapes


class SessionEnded(Exception):
    """An error that ends the session: its event is sent, then the connection closes."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


async def realtime(request: web.Request) -> web.WebSocketResponse:
    model = request.query.get("model")
    if model is not None and len(model) > MAX_NAME_CHARS:
        raise ApiError(400, f"model may have at most {MAX_NAME_CHARS} characters", "model")
    # beyond twice the limit aiohttp closes with 1009 itself; `realtime` is answered to a browser that offered it
    # beside its key (auth.presented_api_key)
    ws = web.WebSocketResponse(max_msg_size=2 * MAX_MESSAGE_BYTES, protocols=(REALTIME_PROTOCOL,))
    await ws.prepare(request)
    state = request.app[STATE]
    with SessionLog(request, ws, state.in_flight.why_cut) as log:
        await RealtimeConnection(state, ws, log, model or state.config.served_model_names[0]).run()
    return ws


class RealtimeConnection:
    """One session: its configuration, conversation and response in progress."""

    def __init__(self, state: ServerState, ws: web.WebSocketResponse, log: SessionLog, model: str) -> None:
        self.state, self.ws, self.log = state, ws, log
        self.session = RealtimeSession(model)
        self.conversation = Conversation()
        self.voice: tuple[SpeechOptions, TurnVoice] | None = None   # the last prepared, reused while options match
        self.response: RealtimeResponse | None = None
        self.responding: asyncio.Task | None = None

    async def run(self) -> None:
        try:
            await self.send({"type": "session.created", "session": self.session.echo(self.state)})
            while (message := await self._receive()) is not None:
                await self._handle(message)
        except SessionEnded as e:
            await self._end(e.error)
        except ConnectionError:
            pass   # the connection closed while the session wrote to it: there is no one to tell
        except Exception:
            logger.exception("realtime session %s failed", self.session.id)
            await self._end(ApiError(500, "internal error; see the server log"))
        finally:
            # shielded: a client that goes away cancels the handler, and the response must still be cut
            await asyncio.shield(self._close())

    async def _end(self, error: ApiError) -> None:
        """The error event that ends the session (the close follows)."""
        self.log.failed(error.status)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.send(error_event(error, None))

    async def _close(self) -> None:
        if self.responding is not None:
            self.responding.cancel()
            await asyncio.gather(self.responding, return_exceptions=True)
        await self.ws.close()

    async def send(self, event: dict) -> None:
        await self.ws.send_str(msgspec.json.encode({"event_id": new_id("event")} | event).decode())

    async def _receive(self) -> WSMessage | None:
        """The next message, None once the connection closes; SessionEnded after the idle limit."""
        idle = self.state.config.stream_idle_timeout
        while True:
            try:
                message = await self.ws.receive(timeout=idle)
            except asyncio.TimeoutError:
                if self._responding():
                    continue
                raise SessionEnded(ApiError(408, f"no event for {idle:g} s; the session ends", None,
                                            "session_idle_timeout")) from None
            return None if message.type in CLOSE_TYPES else message

    async def _handle(self, message: WSMessage) -> None:
        if message.type != WSMsgType.TEXT:
            await self.send(error_event(ApiError(400, "events must be JSON text frames", None,
                                                 "binary_not_supported"), None))
            return
        size = len(message.data.encode("utf-8", "surrogatepass"))
        if size > MAX_MESSAGE_BYTES:
            raise SessionEnded(ApiError(413, f"event too large ({size} bytes; the limit is {MAX_MESSAGE_BYTES})",
                                        None, "message_too_large"))
        event_id = None
        try:
            head = decode_head(message.data)
            event_id = head.event_id
            event = decode_event(message.data, head)
            if isinstance(event, SessionUpdate):
                await self._update_session(event, session_keys(message.data))
            elif isinstance(event, ItemCreate):
                item, previous = self.conversation.add(event.item, event.previous_item_id)
                for type_ in ("conversation.item.added", "conversation.item.done"):
                    await self.send({"type": type_, "previous_item_id": previous, "item": item.json()})
            elif isinstance(event, ItemDelete):
                self.conversation.delete(event.item_id)
                await self.send({"type": "conversation.item.deleted", "item_id": event.item_id})
            elif isinstance(event, ItemRetrieve):
                item = self.conversation.items[self.conversation.index(event.item_id, "item_id")]
                await self.send({"type": "conversation.item.retrieved", "item": item.json()})
            elif isinstance(event, ResponseCreate):
                await self._create_response(event)
            elif isinstance(event, ResponseCancel):
                self._cancel_response(event)
        except REQUEST_ERRORS as e:
            await self.send(error_event(api_error(e), event_id))

    async def _update_session(self, event: SessionUpdate, keys: list[str]) -> None:
        unknown = [key for key in keys if key not in SessionFields.__struct_fields__]
        if unknown and self.state.config.strict_fields:
            name = describe_fields(unknown[:1])
            raise ApiError(400, f"unknown field 'session.{name}' (the server runs with --strict-fields)", name)
        session = self.session.updated(event.session, unknown)
        options, ignored = session.speech_options(self.state, None)
        await self._voice(options)   # an unknown voice is refused here, the session left as it was
        self.session = session
        if ignored:
            logger.warning("realtime session %s: ignored field(s): %s", session.id, describe_fields(ignored))
        await self.send({"type": "session.updated", "session": session.echo(self.state)})

    async def _voice(self, options: SpeechOptions) -> TurnVoice:
        if self.voice is None or self.voice[0] != options:
            self.voice = options, await prepare_voice(self.state, options)
        return self.voice[1]

    def _responding(self) -> bool:
        return self.response is not None and not self.response.done

    async def _create_response(self, event: ResponseCreate) -> None:
        if self._responding():
            raise ApiError(400, f"response {self.response.id} is in progress; cancel it or wait for its "
                                "response.done", None, "conversation_already_has_active_response")
        fields = event.response
        in_band = fields is None or fields.conversation == "auto"
        own_input = fields is not None and fields.input is not None
        text = (self.conversation.input_text(fields.input) if own_input else
                self.conversation.new_text(take=False))
        if not text.strip():
            raise ApiError(400, "nothing to speak: add a user message with input_text (conversation.item.create), "
                                "or give response.input", "response.input", "no_text_to_speak")
        check_text_length(text)
        options, _ = self.session.speech_options(self.state, fields)
        voice = await self._voice(options)
        response = RealtimeResponse(self.state, voice, text, self.session.output(fields),
                                    self.conversation if in_band else None, fields.metadata if fields else None,
                                    self.send, self.log)
        await response.start()
        if in_band and not own_input:
            self.conversation.new_text(take=True)
        self.response, self.responding = response, asyncio.create_task(self._respond(response))

    async def _respond(self, response: RealtimeResponse) -> None:
        try:
            await response.run()
        except ConnectionError:
            pass   # the client went away; the session ends with the connection
        except Exception:
            logger.exception("realtime response %s failed", response.id)

    def _cancel_response(self, event: ResponseCancel) -> None:
        if not self._responding() or event.response_id not in (None, self.response.id):
            raise ApiError(400, "there is no response in progress to cancel" if event.response_id is None else
                           f"response '{event.response_id}' is not in progress", "response_id",
                           "response_cancel_not_active")
        self.response.cancel()


REALTIME_ROUTES = [web.get(REALTIME_PATH, realtime)]
