"""WS /api-ws/v1/realtime?model=...: Alibaba DashScope's Qwen-TTS Realtime protocol (protocols.md §1), as its
`dashscope` SDK's `QwenTtsRealtime(url=...)` speaks it.

`session.created` at connect; `session.update` configures the session (`session.updated` echoes the effective
config; refused once text has arrived, as DashScope refuses it); `input_text_buffer.append` / `commit` / `clear`
feed the text buffer (qwen_text_buffer.py: where responses end in each mode); each response is one SpeechTurn,
spoken one at a time, its events in a task of its own; `response.cancel` stops the response being spoken at once
(barge-in: aborted in every stage, its slot freed, `response.done` with status `incomplete`); `session.finish`
speaks what is left, then `session.finished` and a close (1000). Any error: the error event, then the close.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import logging

from aiohttp import WSMsgType, web

from omni_tts.entrypoints.api.schema import (MAX_NAME_CHARS, ApiError, MessageType, decode_json,
                                             decode_speech_options, describe_fields)
from omni_tts.models.qwen3_tts.audio import SAMPLE_RATE

from ..access_log import SessionLog, request_id
from ..auth import WS_PROTOCOL
from ..client_messages import ClientMessages, session_ending
from ..errors import REQUEST_ERRORS, api_error
from ..speech_turn import SpeechTurn, TurnVoice, prepare_voice
from ..state import STATE, ServerState
from .qwen_events import (EVENT_TYPES, MAX_MESSAGE_BYTES, ClientEvents, ResponseCancel, ResponseEvents, SessionFinish,
                          SessionUpdate, TextAppend, TextClear, TextCommit, error_event, event, new_id)
from .qwen_fields import QwenSession, billed_characters, given_ignored, speech_options
from .qwen_text_buffer import TextBuffer

logger = logging.getLogger(__name__)



async def qwen_realtime(request: web.Request) -> web.WebSocketResponse:
    model = request.query.get("model", "")
    if len(model) > MAX_NAME_CHARS:
        raise ApiError(400, f"model may have at most {MAX_NAME_CHARS} characters", "model")
    # beyond twice the limit aiohttp closes with 1009; up to it the session answers its error event
    ws = web.WebSocketResponse(max_msg_size=2 * MAX_MESSAGE_BYTES, protocols=(WS_PROTOCOL,), autoclose=False)
    await ws.prepare(request)
    state = request.app[STATE]
    with SessionLog(request, ws, state.in_flight.why_cut) as log:
        await RealtimeSession(state, ws, log, model, request_id(request)).run()
    return ws


class Response:
    """One response: its turn, the text it was given, the task that sends its events."""

    def __init__(self, turn: SpeechTurn, events: ResponseEvents) -> None:
        self.turn, self.events = turn, events
        self.text = ""
        self.accepting = True   # takes more text (server_commit) until its end is known
        self.task: asyncio.Task | None = None


class RealtimeSession:
    def __init__(self, state: ServerState, ws: web.WebSocketResponse, log: SessionLog, model: str,
                 request_id: str) -> None:
        self.state, self.ws, self.log, self.model, self.request_id = state, ws, log, model, request_id
        self.id = new_id("sess")
        self.fields = QwenSession()
        self.ignored: list[str] = []
        self.voice: TurnVoice | None = None    # prepared at session.update, or at the first response
        self.buffer = TextBuffer(self.fields.mode)
        self.response: Response | None = None   # the one being spoken
        self.num_responses = 0
        self.started = False    # text arrived: the config is fixed
        self.finishing = False
        self.all_spoken = asyncio.Event()   # after session.finish: nothing left to speak (or the session failed)
        self.lock = asyncio.Lock()          # the response's changes: opened, fed, ended, cancelled
        self.failed = False
        self.closed = False
        self.messages = ClientMessages(ws, ending=lambda: self.failed)

    @property
    def voice_name(self) -> str | None:
        return self.fields.voice or self.state.voice_names.default

    def _session_json(self) -> dict:
        f = self.fields
        session = {"id": self.id, "object": "realtime.session", "model": self.model,
                   "voice": self.voice_name, "mode": f.mode,
                   "response_format": f.response_format, "sample_rate": f.sample_rate,
                   "language_type": f.language_type or "Auto"}
        if f.instructions is not None:
            session["instructions"] = f.instructions
        if self.ignored:
            session["ignored_fields"] = self.ignored   # ours: accepted, without effect on the audio
        return session

    async def send(self, message: dict) -> None:
        await self.ws.send_json(message)

    async def run(self) -> None:
        self.messages.start()   # a client's close cancels this task at once, whatever it is doing
        async with session_ending(self.messages, self.fail, self._close, "qwen-tts realtime"):
            await self.send(event("session.created", session=self._session_json()))
            while not self.finishing and (message := await self._receive()) is not None:
                await self._handle(message)
            if self.finishing:
                await self.all_spoken.wait()
                if not self.failed:
                    await self.send(event("session.finished"))

    async def _close(self) -> None:
        self.closed = True
        async with self.lock:   # a response being opened meanwhile is opened first, then stopped
            if self.response is not None:
                await self._stop(self.response)
        await self.messages.stop()
        await self.ws.close()

    async def fail(self, error: ApiError) -> None:
        """The error event (once), the response stopped, then the connection closes: a client that sees the close
        finds nothing of its session left running."""
        if self.failed:
            return
        self.failed = True
        self.log.failed(error.status)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.send(error_event(error))
        async with self.lock:
            if self.response is not None:
                await self._stop(self.response)
        await self.messages.stop()
        await self.ws.close()
        self.messages.end()   # the session's loop may be waiting for a message
        self.all_spoken.set()

    async def _receive(self) -> ClientEvents | None:
        """The next event, None once the connection is closing. The idle limit applies while the session waits for
        its client, not while a response's text is complete and its audio is being made."""
        idle = self.state.config.stream_idle_timeout
        waiting_for_audio = self.response is not None and not self.response.accepting
        try:
            message = await self.messages.next(None if waiting_for_audio else idle)
        except asyncio.TimeoutError:
            raise ApiError(400, f"no event for {idle:g} s; the session is closed") from None
        if message is None or self.failed:
            return None
        if message.type != WSMsgType.TEXT:
            raise ApiError(400, "events must be JSON text frames")
        size = len(message.data.encode("utf-8", "surrogatepass"))
        if size > MAX_MESSAGE_BYTES:
            raise ApiError(400, f"event too large ({size} bytes; the limit is {MAX_MESSAGE_BYTES})")
        type_ = decode_json(message.data, MessageType, "the event").type
        if type_ not in EVENT_TYPES:
            raise ApiError(400, f"unknown event type '{type_[:64]}'; expected one of {', '.join(EVENT_TYPES)}",
                           "type")
        return decode_json(message.data, ClientEvents, "the event")

    async def _handle(self, message: ClientEvents) -> None:
        if isinstance(message, SessionUpdate):
            await self._configure(message)
        elif isinstance(message, TextAppend):
            self.started = True
            self.buffer.append(message.text)
            await self._feed()
        elif isinstance(message, TextCommit):
            self.buffer.commit(self.response is not None and self.response.accepting)
            await self.send(event("input_text_buffer.committed", item_id=""))
            await self._feed()
        elif isinstance(message, TextClear):
            self.buffer.clear()
            await self.send(event("input_text_buffer.cleared"))
        elif isinstance(message, ResponseCancel):
            await self._cancel()
        elif isinstance(message, SessionFinish):
            self.finishing = True
            self.buffer.flush(self.response is not None and self.response.accepting)
            await self._feed()

    async def _configure(self, message: SessionUpdate) -> None:
        if self.started:
            raise ApiError(400, "Session update error: session already started or finished or failed.", "session")
        fields, unknown = decode_speech_options(bytes(message.session), QwenSession, self.state.config.strict_fields,
                                                "session")
        ignored = given_ignored(fields) + (["speech_rate"] if fields.speech_rate not in (None, 1.0) else []) + unknown
        if ignored:
            logger.warning("qwen-tts realtime: session.update: ignored field(s): %s", describe_fields(ignored))
        self.voice = await prepare_voice(self.state, speech_options(self.state, fields, self.model or None))
        self.fields, self.ignored, self.buffer = fields, ignored, TextBuffer(fields.mode)
        await self.send(event("session.updated", session=self._session_json()))

    async def _feed(self) -> None:
        """Give waiting text to the response that takes it, or to a new one when none is being spoken."""
        async with self.lock:
            while True:
                response = self.response
                if response is None:
                    if self.closed or self.failed or not self.buffer.has_next():
                        break
                    response = await self._open()
                if not response.accepting or (piece := self.buffer.take(response.text)) is None:
                    break
                text, ends = piece
                if text:
                    await response.turn.append(text)
                    response.text += text
                if not ends:
                    break
                response.accepting = False
                await response.turn.finish()
            if self.finishing and self.response is None:
                self.all_spoken.set()

    async def _open(self) -> Response:
        if self.voice is None:
            self.voice = await prepare_voice(self.state, speech_options(self.state, self.fields, self.model or None))
        turn = SpeechTurn(self.state, self.voice, f"{self.request_id}-{self.num_responses}")
        await turn.start()   # ApiError 429 / 503: the session's error
        self.num_responses += 1
        self.log.utterance_began()
        self.response = response = Response(turn, ResponseEvents(self.voice_name))
        response.task = asyncio.create_task(self._speak(response))
        return response

    async def _speak(self, response: Response) -> None:
        """A response's events, its audio as it is made; then the next response starts."""
        try:
            for message in response.events.opening():
                await self.send(message)
            async for piece in response.turn.audio():
                if piece.data:
                    self.log.audio(piece.samples.shape[0] / SAMPLE_RATE)
                    encoded = await self.state.run(base64.b64encode, piece.data)
                    await self.send(response.events.delta(encoded.decode("ascii")))
            async with self.lock:
                self.response = None
                await response.turn.close()
                for message in response.events.closing(billed_characters(response.text)):
                    await self.send(message)
                self.log.utterance_ended(200)
            await self._feed()
        except ConnectionError:
            pass  # the client went away; the session ends with the connection
        except Exception as e:
            if not isinstance(e, REQUEST_ERRORS):
                logger.exception("qwen-tts realtime response failed")
            # shielded: fail stops this task's response (a cancel meanwhile must not cut the close short)
            await asyncio.shield(self.fail(api_error(e) if isinstance(e, REQUEST_ERRORS) else
                                           ApiError(500, "internal error; see the server log")))

    async def _stop(self, response: Response) -> None:
        """Barge-in: the response's task ends, its request is aborted in every stage and its slot freed."""
        if response.task is not None:
            response.task.cancel()
            await asyncio.gather(response.task, return_exceptions=True)
        await response.turn.cancel()
        if self.response is response:
            self.response = None

    async def _cancel(self) -> None:
        """response.cancel: the response being spoken stops (nothing to stop: nothing happens); text waiting for a
        response stays (input_text_buffer.clear drops it)."""
        async with self.lock:
            response = self.response
            if response is None:
                return
            await self._stop(response)
            for message in response.events.closing(billed_characters(response.text), cancelled=True):
                await self.send(message)
            self.log.utterance_ended(499)
        await self._feed()
