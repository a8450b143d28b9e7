"""WS /v1/audio/speech/stream, split_granularity `none`: an utterance of any length, spoken at input.done as a
narration (api/narrated_speech.py): each segment is the protocol's sentence (audio.start, its audio and the pause after
it, audio.done with its offset and duration), the segments pipelined as an HTTP narration's are."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from omni_tts.entrypoints.api.schema import ApiError, SessionConfig
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.orchestrator.types import SegmentEnd, SpeechChunk

from .admission import Admission
from .narrated_speech import narration_plan, open_narration
from .responders import record_usage, with_first
from .state import ServerState


class Session(Protocol):
    """What a narrated utterance needs of its WebSocket session (speech_stream.SpeechSession)."""
    state: ServerState
    config: SessionConfig
    template: SynthesisRequest
    voice_version: str | None
    utterance_index: int

    async def send_audio(self, chunks: AsyncIterator[SpeechChunk], sentence_index: int,
                         sentence_text: Callable[[], str], admission: Admission) -> None: ...


class NarratedUtterance:
    def __init__(self, session: Session) -> None:
        self.session = session
        self.pieces: list[str] = []   # joined once, at input.done: a string grown per message is quadratic
        self.num_chars = 0

    async def add(self, text: str) -> None:
        self.num_chars += len(text)
        limit = self.session.state.config.max_input_chars
        if self.num_chars > limit:
            raise ApiError(400, f"an utterance may have at most {limit} characters (--max-input-chars)", "input")
        self.pieces.append(text)

    async def finish(self) -> int:
        """Speak the utterance; the number of segments sent."""
        session, state, arrived = self.session, self.session.state, time.monotonic()
        text = "".join(self.pieces)
        if not text.strip():
            return 0
        segments = await narration_plan(state, session.config, text)
        sent = 0
        with Admission(state) as admission:
            async with open_narration(state, session.config, session.template, session.voice_version, segments,
                                      f"ws-{id(session):x}-{session.utterance_index}", admission) as (first, rest):
                chunks = with_first(first, rest)
                while (start := await anext(chunks, None)) is not None:
                    if start.usage is not None:
                        record_usage(state, start, arrived)
                        break
                    index, text = start.segment.index, start.segment.text
                    await session.send_audio(_segment(start, chunks), index, lambda: text, admission)
                    sent += 1
        return sent

    async def close(self) -> None:
        pass


async def _segment(start: SpeechChunk, chunks: AsyncIterator[SpeechChunk]) -> AsyncIterator[SpeechChunk]:
    """One segment's chunks, from its first audio to its end (the pause after it included)."""
    yield start
    if isinstance(start.segment, SegmentEnd):
        return
    async for chunk in chunks:
        yield chunk
        if isinstance(chunk.segment, SegmentEnd):
            return
