"""WS /v1/audio/speech/stream: text that streams in, in vllm-omni's protocol (the messages and limits: README,
"Text that streams in").

A `Session` reads the client's messages as they come (client_messages.py: a close ends the session's requests at
once), takes each `session.config` as a SpeechOptions (validated and admitted as an HTTP request is), and speaks each
utterance by its split_granularity: `token` (the default) as one request whose text grows while it runs (the
pipeline's `open_text_stream`: its audio equals the whole text's), `sentence` and `clause` as a request per piece in
turn (orchestrator/text_splitter.py), `none` as a narration at input.done (narrated_utterance.py). vllm-omni's
`streaming_mode` maps onto token mode (`sentence_commit` holds text until `input.commit`). A request's audio goes out
as binary frames or as `audio.chunk` events (audio_frames.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import AsyncIterator, Callable

from aiohttp import WSMsgType, web

from omni_tts.audio.encoding import create_stream_encoder, output_sample_rate
from omni_tts.entrypoints.api.schema import (ApiError, ClientMessage, InputCommit, InputDone, InputText,
                                           MessageType, SessionClose, SessionConfig, decode_json,
                                           decode_speech_options, describe_fields)
from omni_tts.models.qwen3_tts.audio import SAMPLE_RATE
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.orchestrator.tts_client import TTSClient
from omni_tts.orchestrator.types import SegmentEnd, SegmentStart, SpeechChunk

from .access_log import SessionLog
from .admission import Admission
from .audio_frames import AudioFrames
from .auth import WS_PROTOCOL
from .client_messages import ClientMessages, session_ending
from .narrated_utterance import NarratedUtterance
from .responders import delivered_audio, encode_chunk, encode_whole, record_usage
from .speech_turn import check_text_length
from .state import STATE, ServerState
from .synthesis import build_synthesis_request, check_output, check_speech_request
from .utterances import SplitUtterance, TokenUtterance
from .word_times import ProgressiveTimestamps, TrailingTimestamps, align_span, check_word_timestamps

logger = logging.getLogger(__name__)

MAX_CONFIG_BYTES = 4 * 2**20
MAX_MESSAGE_BYTES = 128 * 2**10
CONFIG_TIMEOUT = 10.0
MAX_CONFIGS = 16   # session.config messages per connection: each may fetch and decode a reference clip


class SessionError(Exception):
    """A protocol error: the client gets an error event with this message, then the connection closes."""


async def speech_stream(request: web.Request) -> web.WebSocketResponse:
    # beyond max_msg_size aiohttp closes with 1009; WS_PROTOCOL is answered to a browser that sent its key as a
    # subprotocol (auth.presented_api_key); a client's close is answered by the session as it ends (_close), not by
    # the reading task while the session may still be writing
    ws = web.WebSocketResponse(max_msg_size=2 * MAX_CONFIG_BYTES, protocols=(WS_PROTOCOL,), autoclose=False)
    await ws.prepare(request)
    state = request.app[STATE]
    with SessionLog(request, ws, state.in_flight.why_cut) as log:
        await SpeechSession(state, ws, log).run()
    return ws


class SpeechSession:
    """One connection: its config, the utterance in progress, the events it sends."""

    def __init__(self, state: ServerState, ws: web.WebSocketResponse, log: SessionLog) -> None:
        self.state, self.ws, self.log = state, ws, log
        self.config: SessionConfig | None = None
        self.template: SynthesisRequest | None = None   # what the config asks for, its text left empty
        self.voice_version: str | None = None
        self.utterance: TokenUtterance | SplitUtterance | None = None
        self.uncommitted = ""   # streaming_mode sentence_commit: the text sent since the last input.commit
        self.num_commits = 0    # in this utterance
        self.utterance_index = 0
        self.num_configs = 0
        self.failed = False
        self.timestamps: TrailingTimestamps | None = None   # word_timestamps: the trailing audio.chunk events
        self.messages = ClientMessages(ws, ending=lambda: self.failed, cancel_type="input.cancel")

    async def run(self) -> None:
        self.messages.start()   # a client's close (or input.cancel) cancels this task at once, whatever it is doing
        async with session_ending(self.messages, lambda error: self.fail(error.message, error.status), self._close,
                                  "speech stream"):
            try:
                while True:
                    try:
                        message = await self._receive()
                        if message is None or isinstance(message, SessionClose):
                            break
                        await self._handle(message)
                    except asyncio.CancelledError:
                        if not self.messages.take_cancel():
                            raise
                        await self._cancel_utterance()
            except SessionError as e:
                await self.fail(str(e))

    async def _cancel_utterance(self) -> None:
        """input.cancel: the utterance in progress stops (its sender cancelled, its requests aborted, its slot
        freed) before input.cancelled goes out, so no audio of it follows."""
        cancelled = self.utterance is not None
        if cancelled:
            await self.utterance.close()
            self.log.utterance_ended("cancelled")
        self.utterance, self.uncommitted, self.num_commits = None, "", 0
        await self.ws.send_json({"type": "input.cancelled", "utterance_index": self.utterance_index,
                                 "cancelled": cancelled})
        if cancelled:
            self.utterance_index += 1

    async def _close(self) -> None:
        if self.utterance is not None:
            await self.utterance.close()
        if self.timestamps is not None:
            await self.timestamps.close()
        await self.messages.stop()
        await self.ws.close()

    async def fail(self, message: str, status: int = 400) -> None:
        """The error event (once), then the connection closes; `status`: the error's, for the access log."""
        if self.failed:
            return
        self.failed = True
        self.log.failed(status)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.ws.send_json({"type": "error", "message": message})
        await self.messages.stop()
        await self.ws.close()
        self.messages.end()   # the session's loop may be waiting for a message (an utterance's task failed)

    async def _receive(self) -> ClientMessage | None:
        """The next message, None once the connection is closing."""
        idle = self.state.config.stream_idle_timeout
        timeout = min(CONFIG_TIMEOUT, idle) if self.config is None else idle
        try:
            message = await self.messages.next(timeout)
        except asyncio.TimeoutError:
            raise SessionError(f"no session.config within {timeout:g} s" if self.config is None
                               else f"no message for {timeout:g} s") from None
        if message is None or self.failed:
            return None
        if message.type != WSMsgType.TEXT:
            raise SessionError("messages must be JSON text")
        size = len(message.data.encode("utf-8", "surrogatepass"))
        if size > MAX_CONFIG_BYTES:
            raise SessionError(f"message too large ({size} bytes; session.config may have {MAX_CONFIG_BYTES})")
        decoded = self._decode(message.data)
        if not isinstance(decoded, SessionConfig) and size > MAX_MESSAGE_BYTES:
            raise SessionError(f"message too large ({size} bytes; the limit is {MAX_MESSAGE_BYTES})")
        return decoded

    def _decode(self, text: str) -> ClientMessage:
        """A session.config is read as an HTTP request's fields are (aliases, unknown fields ignored and logged
        unless --strict-fields); the other messages strictly."""
        if decode_json(text, MessageType, "the message").type != "session.config":
            return decode_json(text, ClientMessage, "the message")
        config, ignored = decode_speech_options(text, SessionConfig, self.state.config.strict_fields, "the message")
        if ignored:
            logger.warning("speech stream: session.config: ignored unknown field(s): %s", describe_fields(ignored))
        return config

    async def _handle(self, message: ClientMessage) -> None:
        if isinstance(message, SessionConfig):
            if self.utterance is not None:
                raise SessionError("session.config cannot change an utterance in progress; send input.done first")
            await self._configure(message)
        elif self.config is None:
            raise SessionError("the first message must be session.config")
        elif isinstance(message, InputText):
            if self.config.streaming_mode == "sentence_commit":
                self.uncommitted += message.text
                check_text_length(self.uncommitted)
            else:
                await self._add(message.text)
        elif isinstance(message, InputCommit):
            text, self.uncommitted = self.uncommitted, ""
            await self._add(text)
            await self.ws.send_json({"type": "input.committed", "utterance_index": self.utterance_index,
                                     "commit_index": self.num_commits, "text": text,
                                     # vllm-omni's names: its client reads commit_id and sentence_index
                                     "commit_id": message.commit_id, "sentence_index": self.num_commits,
                                     "chars_committed": len(text)})
            self.num_commits += 1
        elif isinstance(message, InputDone):
            text, self.uncommitted = self.uncommitted, ""  # what was never committed is spoken too
            await self._add(text)
            total = await self.utterance.finish() if self.utterance is not None else 0
            if self.timestamps is not None:
                await self.timestamps.flush()
            self.utterance, self.num_commits = None, 0
            await self.ws.send_json({"type": "session.done", "utterance_index": self.utterance_index,
                                     "total_sentences": total})
            self.log.utterance_ended(200)
            self.utterance_index += 1

    async def _add(self, text: str) -> None:
        """Text to the utterance in progress (started by its first text)."""
        if not text:
            return
        if self.utterance is None:
            self.log.utterance_began()
            granularity = self.config.split_granularity
            self.utterance = (TokenUtterance(self) if granularity == "token" else
                              NarratedUtterance(self) if granularity == "none" else SplitUtterance(self))
        await self.utterance.add(text)

    async def _configure(self, config: SessionConfig) -> None:
        self.num_configs += 1
        if self.num_configs > MAX_CONFIGS:
            raise SessionError(f"at most {MAX_CONFIGS} session.config messages per connection; open a new one")
        check_output(config, config.stream_audio)
        if config.streaming_mode is not None and config.split_granularity != "token":
            raise ApiError(400, f"streaming_mode {config.streaming_mode} makes one request of an utterance: "
                                f"split_granularity must be token (the default)", "streaming_mode")
        voice = await check_speech_request(self.state, config)
        check_word_timestamps(self.state, config, raw_audio_stream=False)
        if config.ref_audio is None and voice.uploaded is None:
            self.template, self.voice_version = await build_synthesis_request(self.state, config, voice, "")
        else:  # reference audio to fetch, decode or load: admitted first, as an HTTP request's would be
            with Admission(self.state):
                self.template, self.voice_version = await build_synthesis_request(self.state, config, voice, "")
        self.config = config
        self.timestamps = (TrailingTimestamps(self.state, self.ws, f"ws-{id(self):x}", config.language)
                           if config.word_timestamps and not config.audio_in_json else None)

    def synthesis(self, text: str) -> SynthesisRequest:
        return dataclasses.replace(self.template, text=text)

    @property
    def tts(self) -> TTSClient:
        """The client of the model the session's config names."""
        return self.state.served_model(self.config.model).tts

    def generation_args(self) -> dict:
        config, server = self.config, self.state.config
        return dict(initial_codec_chunk_frames=config.initial_codec_chunk_frames, voice_version=self.voice_version,
                    first_audio_timeout=server.first_audio_timeout, timeout=server.request_timeout)

    async def send_audio(self, chunks: AsyncIterator[SpeechChunk], sentence_index: int,
                         sentence_text: Callable[[], str], admission: Admission,
                         progressive: ProgressiveTimestamps | None = None) -> None:
        """One request's audio.start, audio (binary frames or audio.chunk events) and audio.done; with
        word_timestamps, its words: in audio.chunk events its last one, else after audio.done (a token-mode
        request's sentence by sentence while it runs: `progressive`)."""
        config, started = self.config, time.monotonic()
        frames = AudioFrames(self.state, self.ws, config, self.utterance_index, sentence_index)
        start = {"type": "audio.start", "utterance_index": self.utterance_index, "sentence_index": sentence_index,
                 "format": config.response_format}
        if config.response_format == "pcm":
            start |= {"sample_rate": output_sample_rate("pcm", config.sample_rate), "channels": 1}
        done = {"type": "audio.done", "utterance_index": self.utterance_index, "sentence_index": sentence_index}
        encoder = (create_stream_encoder(config.response_format, SAMPLE_RATE, config.sample_rate)
                   if config.stream_audio else None)
        spoken: list = []   # with word_timestamps: the request's audio, aligned once it is whole
        try:
            parts, pending = [], encoder.start() if encoder else b""
            async for chunk in chunks:
                if isinstance(chunk.segment, SegmentStart):   # a narrated utterance's segment
                    start |= {"audio_offset": round(chunk.segment.audio_offset, 6), "total": chunk.segment.total}
                elif isinstance(chunk.segment, SegmentEnd):
                    done |= {"audio_offset": round(chunk.segment.audio_offset, 6),
                             "duration": round(chunk.segment.duration, 6),
                             "finish_reason": chunk.segment.usage.finish_reason}
                if chunk.audio.size:
                    admission.first_audio()
                    self.log.audio(chunk.audio.shape[0] / SAMPLE_RATE)
                    if progressive is not None:
                        progressive.feed(chunk.audio, sentence_text())
                    elif config.word_timestamps:
                        spoken.append(chunk.audio)
                    if encoder is None:
                        parts.append(chunk.audio)
                        continue
                    if frames.total_bytes == 0:
                        await self.ws.send_json(start | {"sentence_text": sentence_text()})
                    data = pending + await encode_chunk(self.state, encoder, chunk.audio)
                    pending = b""
                    await frames.send(data)
                if chunk.usage is not None:
                    record_usage(self.state, chunk, started)
            data = pending + encoder.finish() if encoder else (await encode_whole(self.state, config, parts))[0]
        finally:
            if encoder is not None:
                encoder.close()  # a cancelled or failed request's codec context is freed now, not by the GC
        if frames.total_bytes == 0:
            await self.ws.send_json(start | {"sentence_text": sentence_text()})
        if data:
            await frames.send(data)
        if config.word_timestamps and frames.in_json:
            audio = await self.state.run(delivered_audio, config, spoken)
            await frames.send_words(await align_span(self.state, f"ws-{id(self):x}-{self.utterance_index}",
                                                     sentence_index, audio, sentence_text(), config.language))
        await self.ws.send_json(done | {"total_bytes": frames.total_bytes, "error": False})
        if progressive is not None:
            self.timestamps.add_progressive(progressive, sentence_text())
        elif self.timestamps is not None:
            self.timestamps.add(self.utterance_index, sentence_index,
                                await self.state.run(delivered_audio, config, spoken), sentence_text())
