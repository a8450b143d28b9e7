"""One Realtime response: a `SpeechTurn` of its text, and the server events around its audio in the GA API's order
(response.created → output_item.added → [conversation.item.added] → content_part.added → the transcript, one delta
of the whole text → output_audio.delta … → output_audio.done → output_audio_transcript.done → content_part.done →
output_item.done → [conversation.item.done] → response.done with the usage).

`cancel` (response.cancel) stops the audio at once: the turn's request is aborted in every stage and its slot freed
before the closing events go out, `response.done` saying `cancelled` / `client_cancelled`.
"""
from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Awaitable, Callable

from omni_tts.models.qwen3_tts.audio import SAMPLE_RATE
from omni_tts.orchestrator.types import Usage

from ..access_log import SessionLog
from ..errors import REQUEST_ERRORS, api_error
from ..speech_turn import SpeechTurn, TurnVoice
from ..state import ServerState
from .conversation import Conversation, Item
from .events import AudioOutput, error_event, new_id
from .session import format_json, voice_json

logger = logging.getLogger(__name__)

Send = Callable[[dict], Awaitable[None]]


def usage_json(usage: Usage) -> dict:
    """Our usage in OpenAI's terms: input = text tokens and a clone's reference frames, output = audio frames."""
    input_tokens = usage.input_tokens + usage.reference_frames
    return {"total_tokens": input_tokens + usage.output_frames, "input_tokens": input_tokens,
            "output_tokens": usage.output_frames,
            "input_token_details": {"text_tokens": usage.input_tokens, "audio_tokens": usage.reference_frames,
                                    "cached_tokens": 0},
            "output_token_details": {"text_tokens": 0, "audio_tokens": usage.output_frames}}


class RealtimeResponse:
    """Owns its turn from `start` (the admission slot) to the end of `run` (the turn closed, however it ended)."""

    def __init__(self, state: ServerState, voice: TurnVoice, text: str, output: AudioOutput,
                 conversation: Conversation | None, metadata: dict | None, send: Send, log: SessionLog) -> None:
        """conversation: the one an in-band response adds its item to; None out of band."""
        self.id = new_id("resp")
        self.text, self.output, self.conversation, self.metadata = text, output, conversation, metadata
        self.send, self.log = send, log
        self.item = Item(new_id("item"), "assistant", [{"type": "output_audio", "transcript": text}], text)
        self.turn = SpeechTurn(state, voice, self.id)
        self.streaming: asyncio.Task | None = None
        self.usage: Usage | None = None
        self.cancelled = False
        self.done = False

    async def start(self) -> None:
        """Take the admission slot (ApiError 429 / 503)."""
        await self.turn.start()
        self.log.utterance_began()

    def cancel(self) -> None:
        """Stop the audio (before it began, too); `run` then closes the turn and sends the closing events."""
        self.cancelled = True
        if self.streaming is not None:
            self.streaming.cancel()

    def json(self, status: str, status_details: dict | None = None) -> dict:
        return {"id": self.id, "object": "realtime.response", "status": status, "status_details": status_details,
                "conversation_id": self.conversation.id if self.conversation else None,
                "output": [] if status == "in_progress" else [self.item.json(item_status(status))],
                "output_modalities": ["audio"], "metadata": self.metadata,
                "audio": {"output": {"format": format_json(self.output.format),
                                     "voice": voice_json(self.output.voice)}},
                "usage": usage_json(self.usage) if self.usage is not None else None}

    async def run(self) -> None:
        """The response from response.created to response.done (`done` once it is sent, or the response cut)."""
        try:
            try:
                await self._open()
                self.streaming = asyncio.create_task(self._stream())
                if self.cancelled:   # while the opening events went out
                    self.streaming.cancel()
                await asyncio.wait([self.streaming])
            finally:
                if self.streaming is not None and not self.streaming.done():   # the session ends: cut at once
                    self.streaming.cancel()
                    await asyncio.gather(self.streaming, return_exceptions=True)
                await self.turn.close()   # the request aborted in every stage, its slot freed
            await self._close()
        finally:
            self.done = True

    async def _open(self) -> None:
        item, send = self.item, self.send
        await send({"type": "response.created", "response": self.json("in_progress")})
        await send({"type": "response.output_item.added", "response_id": self.id, "output_index": 0,
                    "item": item.json("in_progress") | {"content": []}})
        if self.conversation is not None:
            previous = self.conversation.add_assistant(item)
            await send({"type": "conversation.item.added", "previous_item_id": previous,
                        "item": item.json("in_progress") | {"content": []}})
        await send(self._part("response.content_part.added") | {"part": {"type": "audio", "transcript": ""}})
        await send(self._part("response.output_audio_transcript.delta") | {"delta": self.text})

    async def _stream(self) -> None:
        await self.turn.append(self.text)
        await self.turn.finish()
        async for piece in self.turn.audio():
            if piece.data:
                self.log.audio(piece.samples.shape[0] / SAMPLE_RATE)
                await self.send(self._part("response.output_audio.delta") |
                                {"delta": base64.b64encode(piece.data).decode("ascii")})   # a chunk: microseconds
            self.usage = piece.usage or self.usage

    async def _close(self) -> None:
        status, details, log_status = "completed", None, 200
        if self.streaming.cancelled():
            status, details, log_status = "cancelled", {"type": "cancelled", "reason": "client_cancelled"}, "cancelled"
        elif (error := self.streaming.exception()) is not None:
            if not isinstance(error, REQUEST_ERRORS):
                raise error
            failure = api_error(error)
            status, log_status = "failed", failure.status
            details = {"type": "failed", "error": {"type": failure.type, "code": failure.code,
                                                   "message": failure.message}}
            await self.send(error_event(failure, None))
        elif self.usage is not None and self.usage.finish_reason == "length":
            status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        self.log.utterance_ended(log_status)
        send, item = self.send, self.item.json(item_status(status))
        await send(self._part("response.output_audio.done"))
        await send(self._part("response.output_audio_transcript.done") | {"transcript": self.text})
        await send(self._part("response.content_part.done") | {"part": {"type": "audio", "transcript": self.text}})
        await send({"type": "response.output_item.done", "response_id": self.id, "output_index": 0, "item": item})
        if self.conversation is not None:
            await send({"type": "conversation.item.done", "item": item})
        await send({"type": "response.done", "response": self.json(status, details)})

    def _part(self, type_: str) -> dict:
        return {"type": type_, "response_id": self.id, "item_id": self.item.id, "output_index": 0,
                "content_index": 0}


def item_status(response_status: str) -> str:
    return {"in_progress": "in_progress", "completed": "completed"}.get(response_status, "incomplete")
