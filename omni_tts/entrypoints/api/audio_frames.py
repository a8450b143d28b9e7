"""WS /v1/audio/speech/stream: how one request's audio travels (session.config `audio_frames`). Binary frames, or
vllm-omni's `audio.chunk` events, for a client that reads text frames only (its word-timestamps demo page plays
them): {utterance_index, sentence_index, chunk_id, sample_rate, channels, audio_b64, timestamps: null} per piece of
audio, and with word_timestamps one more before the request's audio.done, `audio_b64` empty and `timestamps` the
request's words, timed from its own start (null, with the reason, when the aligner gave none)."""
from __future__ import annotations

import base64

from aiohttp import web

from omni_tts.audio.encoding import output_sample_rate
from omni_tts.entrypoints.api.schema import SessionConfig

from .state import ServerState
from .word_times import SpanWords


class AudioFrames:
    """One request's audio on the WebSocket, sent and counted."""

    def __init__(self, state: ServerState, ws: web.WebSocketResponse, config: SessionConfig, utterance_index: int,
                 sentence_index: int) -> None:
        self.state, self.ws, self.in_json = state, ws, config.audio_in_json
        self.event = {"type": "audio.chunk", "utterance_index": utterance_index, "sentence_index": sentence_index,
                      "sample_rate": output_sample_rate(config.response_format, config.sample_rate), "channels": 1}
        self.total_bytes = 0
        self.num_chunks = 0

    async def send(self, data: bytes) -> None:
        self.total_bytes += len(data)
        if not self.in_json:
            await self.ws.send_bytes(data)
        elif data:
            encoded = await self.state.run(base64.b64encode, data)   # up to a whole file: off the loop
            await self._send_chunk({"audio_b64": encoded.decode("ascii"), "timestamps": None})

    async def send_words(self, words: SpanWords) -> None:
        """The request's last audio.chunk: no audio, its words."""
        reason = {"reason": words.reason} if words.reason is not None else {}
        await self._send_chunk({"audio_b64": "", "timestamps": words.ms_json()} | reason)

    async def _send_chunk(self, fields: dict) -> None:
        await self.ws.send_json(self.event | {"chunk_id": self.num_chunks} | fields)
        self.num_chunks += 1
