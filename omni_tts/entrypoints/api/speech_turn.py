"""One spoken response of a realtime protocol (ElevenLabs' WebSockets, Qwen-TTS Realtime, OpenAI Realtime): a
synthesis request whose text is given whole or arrives in pieces, holding one admission slot from its start to its
end, its audio encoded as the session asked, and stopped at once by `cancel` (barge-in).

    turn = SpeechTurn(state, voice, request_id)        # voice: a TurnVoice, prepared once per session config
    await turn.start()                                  # the slot: ApiError 429 / 503 when there is none
    await turn.append("Hello, wor"); await turn.append("ld!"); await turn.finish()
    async for piece in turn.audio(): ...                # TurnAudio: encoded bytes, the samples, the usage at the end
    await turn.cancel()                                 # or close(): aborts the request in every stage, frees the slot

The text streams through the pipeline's `open_text_stream`, so a turn's audio equals `/v1/audio/speech`'s for the
same text, voice and format (whitespace before the first word waits for it: it tokenizes with it).
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from omni_tts.audio.encoding import create_stream_encoder
from omni_tts.entrypoints.api.schema import MAX_TEXT_CHARS, ApiError, SpeechOptions
from omni_tts.models.qwen3_tts.audio import SAMPLE_RATE
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.orchestrator.types import Usage

from .admission import Admission
from .responders import encode_chunk, record_usage
from .state import ServerState
from .synthesis import build_synthesis_request, check_output, check_speech_request

# the pipeline's wait for more text outlasts the protocol's own idle limit, so an idle client is told so by its
# session (the pipeline's deadline is a backstop)
TEXT_IDLE_MARGIN_S = 1.0


@dataclass(frozen=True)
class TurnVoice:
    """What a session's turns share: its options (format, sample rate, voice, language, ...) and the synthesis
    request they make, its text left empty (a clone's reference audio fetched and decoded once)."""
    options: SpeechOptions
    template: SynthesisRequest
    voice_version: str | None


async def prepare_voice(state: ServerState, options: SpeechOptions) -> TurnVoice:
    """Check `options` as a streamed /v1/audio/speech request's are checked (ApiError naming the field) and build
    the template. Reference audio is fetched inside an admission slot, as an HTTP request's would be."""
    check_output(options, streaming=True)
    voice = await check_speech_request(state, options)
    if options.ref_audio is None and voice.uploaded is None:
        template, voice_version = await build_synthesis_request(state, options, voice, "")
    else:
        with Admission(state):
            template, voice_version = await build_synthesis_request(state, options, voice, "")
    return TurnVoice(options, template, voice_version)


@dataclass(frozen=True)
class TurnAudio:
    data: bytes                # encoded in the options' format and rate; the first piece carries a container header
    samples: np.ndarray        # the same audio, float32 at the model's rate (empty for a codec's tail)
    usage: Usage | None = None  # on the last piece


class SpeechTurn:
    """Not for concurrent appends; `audio` is iterated once, by one task, while another may append."""

    def __init__(self, state: ServerState, voice: TurnVoice, request_id: str) -> None:
        self.state, self.voice, self.request_id = state, voice, request_id
        self.text = ""          # what was appended so far
        self.admission: Admission | None = None
        self.stream = None      # the pipeline's TextStream, opened at the first word
        self.opened = asyncio.Event()   # set once the stream is open, or once it is known there will be none
        self.finished = False
        self.cancelled = False

    async def start(self) -> None:
        """Take the admission slot (ApiError 429 at capacity, 503 while the pipeline is down or draining)."""
        self.admission = Admission(self.state).__enter__()

    async def append(self, text: str) -> None:
        if self.finished or self.cancelled:
            raise RuntimeError("the turn's text has been finished")
        self.text += text
        check_text_length(self.text)
        if self.stream is None:
            if not self.text.strip():
                return
            text = self.text
            options, server = self.voice.options, self.state.config
            self.stream = await self.state.served_model(options.model).tts.open_text_stream(
                dataclasses.replace(self.voice.template, text=""), request_id=self.request_id,
                initial_codec_chunk_frames=options.initial_codec_chunk_frames, voice_version=self.voice.voice_version,
                first_audio_timeout=server.first_audio_timeout, timeout=server.request_timeout,
                idle_timeout=server.stream_idle_timeout + TEXT_IDLE_MARGIN_S)
            self.opened.set()
        await self.stream.append(text)

    async def finish(self) -> None:
        """No more text: the turn speaks what it has (nothing if it had no word)."""
        if self.finished:
            return
        self.finished = True
        if self.stream is not None:
            await self.stream.finish()
        self.opened.set()

    async def audio(self) -> AsyncIterator[TurnAudio]:
        """The turn's audio as it is made, ending after the piece with the usage (at once if the turn had no
        word). Pipeline errors (api_error maps them) propagate."""
        await self.opened.wait()
        if self.stream is None:
            return
        options, started = self.voice.options, asyncio.get_running_loop().time()
        encoder = create_stream_encoder(options.response_format, SAMPLE_RATE, options.sample_rate)
        try:
            pending = encoder.start()
            async for chunk in self.stream:
                data = b""
                if chunk.audio.size:
                    self.admission.first_audio()
                    data = pending + await encode_chunk(self.state, encoder, chunk.audio)
                    pending = b""
                if chunk.usage is not None:
                    data += pending + encoder.finish()
                    record_usage(self.state, chunk, started)
                if data or chunk.usage is not None:
                    yield TurnAudio(data, chunk.audio, chunk.usage)
        finally:
            encoder.close()

    async def cancel(self) -> None:
        """Stop the turn: the request is aborted in every stage, then its slot is freed (freed first, it would admit
        another request while this one still runs). Cancel the task that iterates `audio` first. Idempotent; `close`
        is the same for a turn that ended."""
        self.cancelled = True
        self.opened.set()
        if self.stream is not None:
            await self.stream.aclose()
        if self.admission is not None:
            self.admission.__exit__()
            self.admission = None

    close = cancel


def check_text_length(text: str) -> None:
    """One request's text within MAX_TEXT_CHARS (ApiError 400)."""
    if len(text) > MAX_TEXT_CHARS:
        raise ApiError(400, f"the text of one request may have at most {MAX_TEXT_CHARS} characters", "input")
