"""POST /api/v1/services/aigc/multimodal-generation/generation: DashScope's plain HTTP call to Qwen-TTS
(`dashscope.MultiModalConversation.call(model, text=, voice=, language_type=, stream=)`, protocols.md §1.8), one
synthesis request as /v1/audio/speech makes it.

Whole (JSON): the audio, a WAV file, by URL (`output.audio.url`, kept by audio_links.py), `data` empty as
DashScope sends it; `speech_rate` is our speed change. Streamed (`X-DashScope-SSE: enable`, `Accept:
text/event-stream` or `parameters.stream`: the SDK's `stream=True`): server-sent events, each `output.audio.data`
a base64 piece of 24 kHz 16-bit mono PCM, the last `finish_reason: "stop"` with the usage; a speech_rate other than
1 is named as ignored there. Errors are DashScope's `{"code", "message", "request_id"}` (errors.ERROR_BODIES), an
error after the stream started its `event:error` with the status.
"""
from __future__ import annotations

import base64
import json
import logging
import time
from typing import AsyncIterator

import msgspec
from aiohttp import web

from omni_tts.audio.encoding import create_stream_encoder
from omni_tts.entrypoints.api.names import VOICE_IGNORED_HEADER
from omni_tts.entrypoints.api.schema import (IGNORED_FIELDS_HEADER, SpeechRequest, decode_json,
                                             decode_speech_options, describe_fields)
from omni_tts.models.qwen3_tts.audio import SAMPLE_RATE
from omni_tts.models.qwen3_tts.sampling_params import SamplingParams
from omni_tts.orchestrator.types import SpeechChunk

from ..access_log import request_id
from ..admission import Admission
from ..errors import REQUEST_ERRORS, api_error, dashscope_body
from ..responders import collect, encode_chunk, encode_whole, record_usage, with_first
from ..speech import read_body
from ..state import STATE, ServerState
from ..synthesis import check_speech, open_speech
from .audio_links import AudioLinks
from .qwen_fields import GenerationParameters, GenerationRequest, billed_characters, given_ignored, language_of

logger = logging.getLogger(__name__)

GENERATION_PATH = "/api/v1/services/aigc/multimodal-generation/generation"


class QwenGeneration:
    """The route's handler, over the store its whole responses' audio is downloaded from."""

    def __init__(self, links: AudioLinks) -> None:
        self.links = links

    async def generate(self, request: web.Request) -> web.StreamResponse:
        state, arrived, rid = request.app[STATE], time.monotonic(), request_id(request)
        body = decode_json(await read_body(request, state.config.body_read_timeout), GenerationRequest)
        parameters, ignored = decode_speech_options(bytes(body.parameters), GenerationParameters,
                                                    state.config.strict_fields, "parameters")
        stream = (request.headers.get("X-DashScope-SSE", "").lower() == "enable" or bool(parameters.stream)
                  or "text/event-stream" in request.headers.get("Accept", ""))
        speed = parameters.speech_rate or 1.0
        ignored = given_ignored(body.input) + given_ignored(parameters) + ignored
        if stream and speed != 1.0:
            ignored, speed = ignored + ["speech_rate"], 1.0
        speech = SpeechRequest(
            model=body.model, input=body.input.text, voice=body.input.voice, speed=speed,
            language=language_of(state, body.input.language_type or parameters.language_type),
            instructions=body.input.instructions or parameters.instructions,
            response_format="pcm" if stream else "wav", **msgspec.structs.asdict(SamplingParams.of(parameters)))
        voice = await check_speech(state, speech)
        headers = {VOICE_IGNORED_HEADER: voice.ignored} if voice.ignored else {}
        if ignored:
            logger.warning("request %s: ignored field(s): %s", rid, describe_fields(ignored))
            headers[IGNORED_FIELDS_HEADER] = describe_fields(ignored)
        characters = billed_characters(speech.input)
        with Admission(state) as admission:
            async with open_speech(state, speech, voice, rid, admission) as (first, chunks):
                if stream:
                    return await stream_events(request, state, first, chunks, arrived, headers, characters)
                parts, last = await collect(first, chunks)
                record_usage(state, last, arrived)
                data, _ = await encode_whole(state, speech, parts)
        audio_id, expires_at = self.links.add(data)
        url = request.url.origin().with_path(f"/api/v1/audio/{audio_id}")
        return web.json_response({
            "request_id": rid, "usage": {"characters": characters},
            "output": {"finish_reason": "stop", "audio": {"url": str(url), "id": audio_id,
                                                          "expires_at": int(expires_at), "data": ""}}},
            headers=headers)


async def stream_events(request: web.Request, state: ServerState, first: SpeechChunk,
                        chunks: AsyncIterator[SpeechChunk], arrived: float, headers: dict[str, str],
                        characters: int) -> web.StreamResponse:
    """The SSE answer in DashScope's framing (`id:`, `event:`, the `:HTTP_STATUS/` comment, `data:`), read by the
    SDK's `_handle_stream`."""
    response = web.StreamResponse(headers=headers | {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    rid, audio_id, count = request_id(request), "audio_" + request_id(request), 0

    async def send(kind: str, body: dict, status: int = 200) -> None:
        nonlocal count
        count += 1
        error_status = f"status:{status}\n" if kind == "error" else ""
        await response.write(f"id:{count}\nevent:{kind}\n:HTTP_STATUS/{status}\n{error_status}"
                             f"data:{json.dumps(body)}\n\n".encode())

    def result(data: str, finish_reason: str) -> dict:
        return {"request_id": rid, "usage": {"characters": characters},
                "output": {"finish_reason": finish_reason, "audio": {"data": data, "id": audio_id}}}

    encoder = create_stream_encoder("pcm", SAMPLE_RATE, None)
    try:
        try:
            async for chunk in with_first(first, chunks):
                if chunk.audio.size:
                    encoded = await state.run(base64.b64encode, await encode_chunk(state, encoder, chunk.audio))
                    await send("result", result(encoded.decode("ascii"), "null"))
                if chunk.usage is not None:
                    record_usage(state, chunk, arrived)
                    await send("result", result("", "stop"))
        except REQUEST_ERRORS as e:
            error = api_error(e)
            state.metrics.count_error(error.status)
            await send("error", dashscope_body(error, rid), error.status)
        await response.write_eof()
        return response
    finally:
        encoder.close()
