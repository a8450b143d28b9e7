"""POST /v1/text-to-speech/{voice_id} (+ /stream, /with-timestamps, /stream/with-timestamps): the body read into our
SpeechRequest (schema.py), then answered as POST /v1/audio/speech answers one (speech.answer_speech): a whole file,
a raw audio stream, or the two timestamped answers here, ElevenLabs' JSON and its newline-delimited JSON."""
from __future__ import annotations

import base64
import functools
import json
import logging
import time
from typing import AsyncIterator

from aiohttp import web

from omni_tts.audio.encoding import create_stream_encoder, encode_audio
from omni_tts.entrypoints.api.access_log import SPEECH_LOG, SpeechLog, request_id
from omni_tts.entrypoints.api.errors import REQUEST_ERRORS
from omni_tts.entrypoints.api.narrated_file import respond_narrated_file
from omni_tts.entrypoints.api.responders import (collect, cut_stream, delivered_audio, encode_chunk,
                                                 record_request_usage, respond_whole, whole_file_headers, with_first)
from omni_tts.entrypoints.api.schema import IGNORED_FIELDS_HEADER, ApiError, SpeechRequest, describe_fields
from omni_tts.entrypoints.api.speech import answer_speech, read_body
from omni_tts.entrypoints.api.state import STATE, ServerState
from omni_tts.entrypoints.api.word_times import NarrationWords, SentenceTimestamps, align_span
from omni_tts.models.qwen3_tts.audio import SAMPLE_RATE
from omni_tts.orchestrator.types import SegmentEnd, SpeechChunk

from .alignment import TextAlignment, joined
from .tts_request import query_value, renamed, speech_request

logger = logging.getLogger(__name__)
NDJSON = "application/x-ndjson"


async def _text_to_speech(request: web.Request, streaming: bool, timestamps: bool) -> web.StreamResponse:
    state = request.app[STATE]
    arrived = time.monotonic()
    request[SPEECH_LOG] = SpeechLog()
    raw = await read_body(request, state.config.body_read_timeout)
    speech, ignored = speech_request(raw, request.match_info["voice_id"], query_value(request.query, "output_format"),
                                     streaming, state.config.strict_fields)
    ignored += [name for name in ("enable_logging", "optimize_streaming_latency") if name in request.query]
    headers = {}
    if ignored:
        logger.info("request %s: ignored field(s): %s", request_id(request), describe_fields(ignored))
        headers[IGNORED_FIELDS_HEADER] = describe_fields(ignored)
    if timestamps:
        responder = respond_ndjson if streaming else respond_timestamped
        respond, narrated = functools.partial(responder, narrated=False), functools.partial(responder, narrated=True)
    elif streaming:
        respond = narrated = None   # the raw audio stream
    else:
        respond, narrated = respond_whole, respond_narrated_file
    try:
        return await answer_speech(request, speech, arrived, headers, respond, narrated)
    except ApiError as e:
        raise renamed(e) from None


async def convert(request: web.Request) -> web.StreamResponse:
    return await _text_to_speech(request, streaming=False, timestamps=False)


async def stream(request: web.Request) -> web.StreamResponse:
    return await _text_to_speech(request, streaming=True, timestamps=False)


async def convert_with_timestamps(request: web.Request) -> web.StreamResponse:
    return await _text_to_speech(request, streaming=False, timestamps=True)


async def stream_with_timestamps(request: web.Request) -> web.StreamResponse:
    return await _text_to_speech(request, streaming=True, timestamps=True)


def _line(audio: str, alignment: dict | None) -> dict:
    """One answer of the timestamped routes; no text normalization here, so the normalized alignment is the same."""
    return {"audio_base64": audio, "alignment": alignment, "normalized_alignment": alignment}


async def respond_timestamped(request: web.Request, state: ServerState, speech: SpeechRequest, first: SpeechChunk,
                              stream: AsyncIterator[SpeechChunk], arrived: float, headers: dict[str, str],
                              narrated: bool) -> web.Response:
    """/with-timestamps: the whole file in base64 and its characters' times (null without an aligner, or when it
    gave none). A narration's segments are aligned as each ends (NarrationWords); one request's audio at once."""
    words = NarrationWords(state, request_id(request), speech.language) if narrated and state.aligner else None
    ends: list[SegmentEnd] = []
    try:
        if narrated:
            parts, last = [], first
            async for chunk in with_first(first, stream):
                if isinstance(chunk.segment, SegmentEnd):
                    ends.append(chunk.segment)
                if words is not None:
                    await words.take(chunk)
                parts.append(chunk.audio)
                last = chunk
        else:
            parts, last = await collect(first, stream)
        record_request_usage(request, state, last, arrived)
        samples = await state.run(delivered_audio, speech, parts)
        data = await state.run(encode_audio, samples, SAMPLE_RATE, speech.response_format, speech.sample_rate)
        result = None
        if words is not None:
            result = await words.result()
        elif state.aligner is not None:
            result = await align_span(state, request_id(request), 0, samples, speech.input, speech.language)
    finally:
        if words is not None:
            words.close()
    alignment = None
    if result is not None and result.words is not None:
        text = TextAlignment(speech.input)
        alignment = joined(text.span((w, start / 1000, end / 1000) for w, start, end in result.words), text.rest())
    audio = (await state.run(base64.b64encode, data)).decode("ascii")
    return web.json_response(_line(audio, alignment),
                             headers=headers | whole_file_headers(last, samples.shape[0] / SAMPLE_RATE, ends))


async def respond_ndjson(request: web.Request, state: ServerState, speech: SpeechRequest, first: SpeechChunk,
                         stream: AsyncIterator[SpeechChunk], arrived: float, headers: dict[str, str],
                         narrated: bool) -> web.StreamResponse:
    """/stream/with-timestamps: a line per audio chunk, and a line with the characters of each sentence once the
    aligner timed it (SentenceTimestamps: the audio never waits for it), times absolute from the audio's start. A
    failure after the first line cuts the connection (no terminating chunk), as a raw stream's does."""
    response = web.StreamResponse(headers=headers | {"Content-Type": NDJSON})
    await response.prepare(request)
    encoder = create_stream_encoder(speech.response_format, SAMPLE_RATE, speech.sample_rate)
    text = TextAlignment(speech.input)

    async def send(audio: bytes, alignment: dict | None) -> None:
        encoded = (await state.run(base64.b64encode, audio)).decode("ascii") if audio else ""
        await response.write(json.dumps(_line(encoded, alignment)).encode() + b"\n")

    async def send_words(event: dict) -> None:   # a sentence's words, from SentenceTimestamps
        if event["words"]:
            await send(b"", text.span((w["word"], w["start"], w["end"]) for w in event["words"]))

    timestamps = (SentenceTimestamps(state, request_id(request), speech.language, send_words)
                  if state.aligner is not None else None)
    try:
        pending = encoder.start()
        try:
            async for chunk in with_first(first, stream):
                if isinstance(chunk.segment, SegmentEnd):   # its audio is the pause after the segment
                    if timestamps is not None:
                        await timestamps.end(chunk.segment.text, chunk.segment.audio_offset)
                elif chunk.audio.size and timestamps is not None:
                    timestamps.feed(chunk.audio)
                if chunk.audio.size:
                    await send(pending + await encode_chunk(state, encoder, chunk.audio), None)
                    pending = b""
                if chunk.usage is not None:
                    tail = encoder.finish()
                    if tail:
                        await send(tail, None)
                    record_request_usage(request, state, chunk, arrived)
                    if timestamps is not None:
                        if not narrated:   # one request: its whole text
                            await timestamps.end(speech.input, 0.0)
                        await timestamps.flush()
                        if text.position:
                            rest = text.rest()
                            if rest is not None:
                                await send(b"", rest)
        except REQUEST_ERRORS as e:
            cut_stream(request, state, e)
            return response
        await response.write_eof()
        return response
    finally:
        encoder.close()
        if timestamps is not None:
            await timestamps.close()


TEXT_TO_SPEECH_ROUTES = [
    web.post("/v1/text-to-speech/{voice_id}", convert),
    web.post("/v1/text-to-speech/{voice_id}/stream", stream),
    web.post("/v1/text-to-speech/{voice_id}/with-timestamps", convert_with_timestamps),
    web.post("/v1/text-to-speech/{voice_id}/stream/with-timestamps", stream_with_timestamps),
]
