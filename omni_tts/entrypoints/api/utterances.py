"""WS /v1/audio/speech/stream: an utterance by its split_granularity — `token`, one request whose text grows as it
arrives (its audio sent from a task of its own), `sentence` / `clause`, a request per unit in turn (`none`, a narration
at input.done, is narrated_utterance.py). Each speaks through its session (speech_stream.SpeechSession)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from omni_tts.entrypoints.api.schema import SessionConfig
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.orchestrator.text_splitter import TextSplitter
from omni_tts.orchestrator.types import SpeechChunk

from .admission import Admission
from .errors import REQUEST_ERRORS, api_error
from .speech_turn import TEXT_IDLE_MARGIN_S, check_text_length
from .state import ServerState
from .word_times import ProgressiveTimestamps, TrailingTimestamps


class Session(Protocol):
    """What an utterance needs of its WebSocket session."""
    state: ServerState
    config: SessionConfig
    utterance_index: int
    timestamps: TrailingTimestamps | None

    def synthesis(self, text: str) -> SynthesisRequest: ...

    def generation_args(self) -> dict: ...

    async def send_audio(self, chunks: AsyncIterator[SpeechChunk], sentence_index: int,
                         sentence_text: Callable[[], str], admission: Admission,
                         progressive: ProgressiveTimestamps | None = None) -> None: ...

    async def fail(self, message: str, status: int = 400) -> None: ...


class TokenUtterance:
    """split_granularity token: the utterance is one request whose text grows as it arrives; its audio goes out
    from a task of its own while the text keeps coming."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.text = ""
        self.admission: Admission | None = None
        self.stream = None
        self.sender: asyncio.Task | None = None

    async def add(self, text: str) -> None:
        self.text += text
        check_text_length(self.text)
        if self.stream is None:
            if not self.text.strip():
                return  # whitespace before the first word tokenizes with it: it waits
            session = self.session
            self.admission = Admission(session.state).__enter__()
            self.stream = await session.tts.open_text_stream(
                session.synthesis(""), idle_timeout=session.state.config.stream_idle_timeout + TEXT_IDLE_MARGIN_S,
                **session.generation_args())
            self.sender = asyncio.create_task(self._send_audio(self.admission))
            text = self.text
        await self.stream.append(text)

    async def _send_audio(self, admission: Admission) -> None:
        session = self.session
        progressive = (ProgressiveTimestamps(session.timestamps, session.utterance_index)
                       if session.timestamps is not None else None)
        try:
            await session.send_audio(self.stream, 0, lambda: self.text, admission, progressive)
        except REQUEST_ERRORS as e:
            error = api_error(e)
            await self.session.fail(error.message, error.status)
            raise
        except ConnectionError:
            pass  # the client went away; the session ends with the connection

    async def finish(self) -> int:
        """The number of requests it made (0 for nothing but whitespace)."""
        if self.stream is None:
            await self.close()
            return 0
        await self.stream.finish()
        await self.sender
        await self.close()
        return 1

    async def close(self) -> None:
        """Abort the request, then free its slot: a slot freed first would admit another request while this one
        still runs in the stages."""
        if self.sender is not None:
            self.sender.cancel()
            await asyncio.gather(self.sender, return_exceptions=True)
        if self.stream is not None:
            await self.stream.aclose()
        if self.admission is not None:
            self.admission.__exit__()
            self.admission = None


class SplitUtterance:
    """split_granularity sentence / clause: each complete unit of text is a request of its own, spoken before the
    next message is read."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.splitter = TextSplitter(session.config.split_granularity)
        self.num_requests = 0

    async def add(self, text: str) -> None:
        for unit in self.splitter.feed(text):
            await self._speak(unit)
        check_text_length(self.splitter.buffer)

    async def finish(self) -> int:
        for unit in self.splitter.flush():
            await self._speak(unit)
        return self.num_requests

    async def _speak(self, text: str) -> None:
        check_text_length(text)
        session = self.session
        with Admission(session.state) as admission:
            chunks = session.tts.generate(session.synthesis(text), **session.generation_args())
            try:
                await session.send_audio(chunks, self.num_requests, lambda: text, admission)
            finally:
                await chunks.aclose()
        self.num_requests += 1

    async def close(self) -> None:
        pass
