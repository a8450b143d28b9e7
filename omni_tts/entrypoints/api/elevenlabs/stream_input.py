"""WS /v1/text-to-speech/{voice_id}/stream-input (one context) and /multi-stream-input (contexts): ElevenLabs'
streamed text to speech (the messages: ws_messages.py; what they mean here: README, "ElevenLabs → WebSockets").

A socket's options come from its path and query (checked as a streamed /v1/audio/speech request's are, once). Each
context speaks its text as SpeechTurns (speech_turn.py): the text streams straight into the turn taking it, so
audio starts while text arrives; `flush` finishes that turn (its last words are spoken) and later text starts the
next, whose audio follows in the context. Contexts run concurrently, each its own turns. `close_context` on a
context still taking text is a barge-in: its turns are cancelled at once (the requests aborted in every stage, the
slots freed) and isFinal follows; on a context whose text was all flushed its audio ends first, then isFinal.
With a forced aligner the characters' times follow the audio (alignment.py).
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import logging

import msgspec
from aiohttp import WSMsgType, web

from omni_tts.entrypoints.api.schema import ApiError, describe_fields
from omni_tts.models.qwen3_tts.audio import SAMPLE_RATE

from ..access_log import SessionLog, request_id
from ..auth import FIRST_MESSAGE_KEY, WS_PROTOCOL, check_first_message_key
from ..client_messages import ClientMessages, session_ending
from ..errors import REQUEST_ERRORS, api_error
from ..speech_turn import SpeechTurn, TurnVoice, prepare_voice
from ..state import STATE, ServerState
from ..word_times import ProgressiveTimestamps
from .context_alignment import ContextAlignment
from .tts_request import renamed
from .ws_messages import ClientMessage, StreamParams, decode_message, error_message, stream_params

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 128 * 2**10   # one message; aiohttp drops a connection past 4x without reading it (1009)
MAX_CONTEXTS = 5                  # on one socket at once, ElevenLabs' own limit (contexts finishing included)
MAX_TURNS_AHEAD = 4               # a context's flushed turns waiting behind the one speaking
FIRST_MESSAGE_TIMEOUT = 10.0      # for the first message of a socket opened without its key
# the close code after an error message, by its status (1008 policy violation otherwise)
CLOSE_CODES = {413: 1009, 415: 1003, 429: 1013, 503: 1013}


async def stream_input(request: web.Request) -> web.WebSocketResponse:
    return await _serve(request, multi=False)


async def multi_stream_input(request: web.Request) -> web.WebSocketResponse:
    return await _serve(request, multi=True)


async def _serve(request: web.Request, multi: bool) -> web.WebSocketResponse:
    # autoclose off: the session answers a client's close as it ends, not the reading task while it may still write;
    # WS_PROTOCOL is answered to a browser that sent its key as a subprotocol (auth.presented_api_key)
    ws = web.WebSocketResponse(max_msg_size=4 * MAX_MESSAGE_BYTES, protocols=(WS_PROTOCOL,), autoclose=False)
    await ws.prepare(request)
    state = request.app[STATE]
    with SessionLog(request, ws, state.in_flight.why_cut) as log:
        await StreamSession(request, ws, state, log, multi).run()
    return ws


class StreamSession:
    """One socket: its options, its contexts (stream-input: the one, id None), the messages it sends."""

    def __init__(self, request: web.Request, ws: web.WebSocketResponse, state: ServerState, log: SessionLog,
                 multi: bool) -> None:
        self.request, self.ws, self.state, self.log, self.multi = request, ws, state, log, multi
        self.params: StreamParams | None = None
        self.voice: TurnVoice | None = None
        self.contexts: dict[str | None, Context] = {}
        self.closing: list[Context] = []    # closed by the client, speaking what was flushed
        self.num_contexts = 0
        self.ending = False                 # the session closes the socket itself
        self.messages = ClientMessages(ws, ending=lambda: self.ending)

    async def run(self) -> None:
        self.messages.start()   # a client's close cancels this task at once, whatever it is doing
        async with session_ending(self.messages, self.fail, self._close, "elevenlabs websocket"):
            self.params = stream_params(self.request.query)
            if ignored := self.params.ignored():
                logger.info("elevenlabs websocket: ignored query parameter(s): %s", ", ".join(ignored))
            # a socket opened without its key is one message away from being refused: it may not idle long first
            first = await self._receive(min(FIRST_MESSAGE_TIMEOUT, self.params.inactivity_timeout)
                                        if FIRST_MESSAGE_KEY in self.request else None)
            if first is None:
                return
            check_first_message_key(self.request, first.api_key)
            # the socket's options; a multi-stream init's dictionaries are its context's alone (_context_voice)
            options = self.params.speech_options(self.request.match_info["voice_id"],
                                                 None if self.multi else first.pronunciation_dictionary_locators)
            self.voice = await prepare_voice(self.state, options)
            message = first
            while message is not None and not await self._handle(message, message is first):
                message = await self._receive()
            if message is not None:
                await self._finish()

    async def _receive(self, timeout: float | None = None) -> ClientMessage | None:
        """The next message, None once the socket is closing. No message for `timeout` seconds (inactivity_timeout)
        while no context speaks ends the session (ApiError 408)."""
        timeout = timeout or self.params.inactivity_timeout
        while True:
            try:
                message = await self.messages.next(timeout)
                break
            except asyncio.TimeoutError:
                if not any(context.speaking for context in self._all_contexts()):
                    raise ApiError(408, f"no message within {timeout:g} s (inactivity_timeout)") from None
        if message is None or self.ending:
            return None
        if message.type != WSMsgType.TEXT:
            raise ApiError(415, "messages must be JSON text, not binary frames")
        size = len(message.data.encode("utf-8", "surrogatepass"))
        if size > MAX_MESSAGE_BYTES:
            raise ApiError(413, f"message too large ({size} bytes; the limit is {MAX_MESSAGE_BYTES})")
        return decode_message(message.data)

    async def _handle(self, message: ClientMessage, first: bool) -> bool:
        """Whether the input ended (stream-input's empty text, close_socket)."""
        if ignored := message.ignored():
            logger.info("elevenlabs websocket: ignored field(s): %s", describe_fields(ignored))
        if not self.multi:
            return await self._handle_single(message, first)
        if message.close_socket:
            return True
        context = self.contexts.get(message.context_id)
        if message.text:
            opened = context is None
            if opened:
                context = self._open_context(message.context_id, await self._context_voice(message))
            if not (opened and message.text.isspace()):   # a context's init: its blank is no text
                await context.add_text(message.text)
        if context is not None and message.flush:
            await context.flush()
        if context is not None and message.close_context:
            del self.contexts[message.context_id]   # the id may name a new context at once
            self.closing.append(context)
            await context.close()
        return False   # an empty text is a keep-alive; a flush or close of no context was for one already gone

    async def _handle_single(self, message: ClientMessage, first: bool) -> bool:
        if message.context_id is not None or message.close_context or message.close_socket:
            raise ApiError(400, "context_id, close_context and close_socket belong to multi-stream-input")
        if first:
            if message.text is not None and not message.text.isspace():
                raise ApiError(400, 'the first message must initialize the stream: {"text": " "}, with its settings',
                               "text")
            self._open_context(None, self.voice)
            return False
        context = self.contexts[None]
        if message.text == "":   # the end of the input
            return True
        if message.text:
            await context.add_text(message.text)
        if message.flush:
            await context.flush()
        return False

    async def _context_voice(self, init: ClientMessage) -> TurnVoice:
        """The session's voice, or with the pronunciation dictionaries of a context's init, where they differ."""
        options = self.voice.options
        if init.pronunciation_dictionary_locators in (None, options.pronunciation_dictionary_locators):
            return self.voice
        return await prepare_voice(self.state, msgspec.structs.replace(
            options, pronunciation_dictionary_locators=init.pronunciation_dictionary_locators))

    def _open_context(self, context_id: str | None, voice: TurnVoice) -> Context:
        self.closing = [context for context in self.closing if not context.sender.done()]
        if len(self.contexts) + len(self.closing) >= MAX_CONTEXTS:
            for key in [key for key, context in self.contexts.items() if context.idle]:
                self.contexts.pop(key).forget()   # spoken and silent since: as if timed out
        if len(self.contexts) + len(self.closing) >= MAX_CONTEXTS:
            raise ApiError(400, f"at most {MAX_CONTEXTS} contexts at once on one socket; close_context one first",
                           "context_id")
        context = self.contexts[context_id] = Context(self, context_id, self.num_contexts, voice)
        self.num_contexts += 1
        return context

    async def _finish(self) -> None:
        """The input ended: each context speaks what it has (flushed; stream-input's last text too) or is cut (multi's
        text never flushed), sends isFinal, and the socket closes normally."""
        for context in self.contexts.values():
            if not self.multi:
                await context.flush()
            await context.close()
        await asyncio.gather(*(context.sender for context in self._all_contexts()), return_exceptions=True)
        if not self.ending:
            self.ending = True
            await self.messages.stop()
            await self.ws.close()

    async def send(self, context: Context, message: dict) -> None:
        await self.ws.send_json(message | context.ids)

    async def fail(self, error: ApiError, context_id: str | None = None) -> None:
        """The error message (once; `param` ElevenLabs' name for the field), then the close: a non-1000 code, which
        the SDK raises on; every context's audio stops."""
        if self.ending:
            return
        self.ending = True
        self.log.failed(error.status)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.ws.send_json(error_message(renamed(error), context_id))
        for context in self._all_contexts():
            if context.sender is not asyncio.current_task():
                context.sender.cancel()
        await self.messages.stop()
        code = CLOSE_CODES.get(error.status, 1011 if error.status >= 500 else 1008)
        await self.ws.close(code=code, message=error.message.encode()[:120])
        self.messages.end()   # the session's loop may be waiting for a message (a context's sender failed)

    def _all_contexts(self) -> list[Context]:
        return [*self.contexts.values(), *self.closing]

    async def _close(self) -> None:
        for context in self._all_contexts():
            await context.cancel()
        await self.messages.stop()
        await self.ws.close()


class Context:
    """One context's turns, in order: the one taking text (`open`), those flushed, and the task that sends their
    audio, one turn after another, then isFinal once the context is closed."""

    def __init__(self, session: StreamSession, context_id: str | None, index: int, voice: TurnVoice) -> None:
        self.session, self.id, self.voice = session, context_id, voice
        self.ids = {} if context_id is None else {"contextId": context_id, "context_id": context_id}
        self.request_id = f"{request_id(session.request)}-{index}"
        self.live: list[SpeechTurn] = []   # started and not yet ended, in order
        self.open: SpeechTurn | None = None
        self.queue: asyncio.Queue[SpeechTurn | None] = asyncio.Queue()   # None: closed, isFinal after the audio
        self.num_turns = 0
        self.num_spoken = 0
        self.offset = 0.0   # seconds of the context's audio sent
        state = session.state
        self.alignment = (ContextAlignment(state, self.request_id, voice.options.language, self._send)
                          if state.aligner is not None else None)
        self.sender = asyncio.create_task(self._send_audio())

    @property
    def speaking(self) -> bool:
        """Speaking text that was flushed (a turn still taking text waits for the client)."""
        return any(turn is not self.open for turn in self.live)

    @property
    def idle(self) -> bool:
        """Nothing to speak and not closed."""
        return not self.live and self.queue.empty()

    async def add_text(self, text: str) -> None:
        if self.open is None:
            if len(self.live) > MAX_TURNS_AHEAD:
                raise ApiError(400, f"at most {MAX_TURNS_AHEAD} flushed texts may wait for a context's audio",
                               "flush")
            turn = SpeechTurn(self.session.state, self.voice, f"{self.request_id}-{self.num_turns}")
            await turn.start()   # a slot: ApiError 429 / 503 ends the session
            self.num_turns += 1
            self.live.append(turn)
            self.queue.put_nowait(turn)
            self.open = turn
        await self.open.append(text)

    async def flush(self) -> None:
        """The text so far is spoken to its end; more text starts the next turn."""
        if self.open is not None:
            turn, self.open = self.open, None
            await turn.finish()

    async def close(self) -> None:
        """close_context: cut now if text is still coming (barge-in), else the flushed audio ends first."""
        if self.open is not None:
            await self.cancel()
            await self._send({"isFinal": True})
        else:
            self.queue.put_nowait(None)

    async def cancel(self) -> None:
        """Every turn stopped and its slot freed, the aligner's work dropped (idempotent)."""
        self.sender.cancel()
        await asyncio.gather(self.sender, return_exceptions=True)
        turns, self.live, self.open = self.live, [], None
        for turn in turns:
            await turn.cancel()
        if self.alignment is not None:
            await self.alignment.close()

    def forget(self) -> None:
        """An idle context let go of (its sender waits for nothing)."""
        self.sender.cancel()

    async def _send(self, message: dict) -> None:
        await self.session.send(self, message)

    async def _send_audio(self) -> None:
        try:
            while (turn := await self.queue.get()) is not None:
                await self._speak(turn)
                self.live.remove(turn)
            await self._send({"isFinal": True})
        except REQUEST_ERRORS as e:
            await self.session.fail(api_error(e), self.id)
        except ConnectionError:
            pass  # the client went away; the session ends with the connection
        except Exception:
            logger.exception("elevenlabs websocket: a context's audio failed")
            await self.session.fail(ApiError(500, "internal error; see the server log"), self.id)

    async def _speak(self, turn: SpeechTurn) -> None:
        """One turn's audio messages; with an aligner, its alignment messages as its sentences are aligned. Each turn
        is an utterance of the access log (which keeps one at a time: concurrent contexts' lines share their audio)."""
        state, log, progressive = self.session.state, self.session.log, None
        if self.alignment is not None:
            self.alignment.begin(turn, round(self.offset * 1000))
            progressive = ProgressiveTimestamps(self.alignment, self.num_spoken)
        self.num_spoken += 1
        log.utterance_began()
        try:
            async for piece in turn.audio():
                if piece.data:
                    encoded = await state.run(base64.b64encode, piece.data)
                    await self._send({"audio": encoded.decode("ascii"), "isFinal": None, "normalizedAlignment": None,
                                      "alignment": None})
                if progressive is not None and piece.samples.size:
                    progressive.feed(piece.samples, turn.text)
                log.audio(piece.samples.shape[0] / SAMPLE_RATE)
                self.offset += piece.samples.shape[0] / SAMPLE_RATE
        except asyncio.CancelledError:
            log.utterance_ended("cancelled")
            raise
        finally:
            await turn.close()
        log.utterance_ended(200)
        if progressive is not None:
            self.alignment.add_progressive(progressive, turn.text)
            await self.alignment.flush()
            await self.alignment.end(round(self.offset * 1000))


WEBSOCKET_ROUTES = [web.get("/v1/text-to-speech/{voice_id}/stream-input", stream_input),
                    web.get("/v1/text-to-speech/{voice_id}/multi-stream-input", multi_stream_input)]
