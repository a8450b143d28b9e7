"""The three answers of POST /v1/audio/speech once its first audio is there: the whole file, a raw audio stream,
or server-sent events. Each owns its stream encoder and closes it however the answer ends."""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from typing import AsyncIterator, Awaitable, Callable

import numpy as np
from aiohttp import web

from omni_tts.audio.encoding import content_type, create_stream_encoder, encode_audio, output_sample_rate
from omni_tts.audio.pcm import UNCOMPRESSED, StreamEncoder
from omni_tts.audio.speed import change_speed
from omni_tts.entrypoints.api.schema import SpeechOptions, SpeechRequest
from omni_tts.models.qwen3_tts.audio import SAMPLE_RATE
from omni_tts.orchestrator.types import SegmentEnd, SegmentStart, SpeechChunk

from .access_log import SPEECH_LOG, request_id
from .errors import REQUEST_ERRORS, api_error
from .state import ServerState
from .word_times import SentenceTimestamps, SpanWords, align_span, header_fields

logger = logging.getLogger(__name__)

# (request, state, speech, first chunk, the rest, arrival time, headers) → the response, once the first audio is there
Responder = Callable[[web.Request, ServerState, SpeechRequest, SpeechChunk, AsyncIterator[SpeechChunk], float,
                      dict[str, str]], Awaitable[web.StreamResponse]]


async def with_first(first: SpeechChunk, stream: AsyncIterator[SpeechChunk]) -> AsyncIterator[SpeechChunk]:
    """A request's chunks from its first (already taken) to its last."""
    yield first
    if first.usage is None:
        async for chunk in stream:
            yield chunk


async def collect(first: SpeechChunk, stream: AsyncIterator[SpeechChunk]) -> tuple[list[np.ndarray], SpeechChunk]:
    """One request's audio, whole (bounded by the talker's length limit): its parts and its last chunk (which carries
    the usage)."""
    parts, last = [], first
    async for chunk in with_first(first, stream):
        parts.append(chunk.audio)
        last = chunk
    return parts, last


def segment_json(end: SegmentEnd) -> dict:
    """A narrated segment as the responses describe it (seconds)."""
    return {"index": end.index, "text": end.text, "audio_offset": round(end.audio_offset, 6),
            "duration": round(end.duration, 6), "finish_reason": end.usage.finish_reason, "attempts": end.attempts,
            "reference_frames": end.usage.reference_frames}


def usage_json(chunk: SpeechChunk) -> dict:
    """OpenAI's usage (input: the text's tokens and an ICL reference's frames), with vllm-omni's split of the input."""
    u = chunk.usage
    inputs = u.input_tokens + u.reference_frames
    return {"input_tokens": inputs, "output_tokens": u.output_frames, "total_tokens": inputs + u.output_frames,
            "input_token_details": {"text_tokens": u.input_tokens, "audio_tokens": u.reference_frames}}


def _usage_headers(usage: dict) -> dict[str, str]:
    """A whole file's usage in headers, ours and vllm-omni's names."""
    details = usage["input_token_details"]
    headers = {"x-omni-tts-input-tokens": str(usage["input_tokens"]),
               "x-omni-tts-output-tokens": str(usage["output_tokens"])}
    for name, value in (("input", usage["input_tokens"]), ("output", usage["output_tokens"]),
                        ("total", usage["total_tokens"]), ("input-text", details["text_tokens"]),
                        ("input-audio", details["audio_tokens"])):
        headers[f"x-vllm-omni-{name}-tokens"] = str(value)
    return headers


def record_request_usage(request: web.Request, state: ServerState, chunk: SpeechChunk, arrived: float) -> None:
    """An HTTP request's last audio: in its access-log line and the metrics."""
    request[SPEECH_LOG].audio_seconds = chunk.usage.audio_seconds
    record_usage(state, chunk, arrived)


def record_usage(state: ServerState, chunk: SpeechChunk, arrived: float) -> None:
    """At a request's last audio: its outcome, and its latency and real-time factor counted from its arrival."""
    state.metrics.finished.labels(chunk.usage.finish_reason).inc()
    state.metrics.audio_seconds.inc(chunk.usage.audio_seconds)
    latency = time.monotonic() - arrived
    state.metrics.e2e_latency.observe(latency)
    if chunk.usage.audio_seconds > 0:
        state.metrics.real_time_factor.observe(latency / chunk.usage.audio_seconds)


async def encode_chunk(state: ServerState, encoder: StreamEncoder, audio: np.ndarray) -> bytes:
    """Uncompressed chunks convert (and resample) in tens of microseconds; codecs take tens of ms per chunk: off the
    loop. Cancelled, it still waits for the pool's call to end, so the caller may close the encoder: never under a
    running call."""
    if encoder.fmt in UNCOMPRESSED:
        return encoder.encode(audio)
    call = asyncio.ensure_future(state.run(encoder.encode, audio))
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        await asyncio.wait([call])
        raise


def delivered_audio(options: SpeechOptions, parts: list[np.ndarray]) -> np.ndarray:
    """A request's whole audio as the listener gets it: at options.speed, at the model's rate."""
    audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    return change_speed(audio, options.speed, SAMPLE_RATE) if options.speed != 1.0 else audio


async def encode_whole(state: ServerState, options: SpeechOptions, parts: list[np.ndarray]) -> tuple[bytes, float]:
    """A request's whole audio as one file of options.response_format, at options.speed (in the pool), and its
    duration in seconds (after `speed`: what the file holds)."""
    def encode() -> tuple[bytes, float]:
        samples = delivered_audio(options, parts)
        return (encode_audio(samples, SAMPLE_RATE, options.response_format, options.sample_rate),
                samples.shape[0] / SAMPLE_RATE)
    return await state.run(encode)


async def respond_whole(request: web.Request, state: ServerState, speech: SpeechRequest, first: SpeechChunk,
                        stream: AsyncIterator[SpeechChunk], arrived: float, headers: dict[str, str],
                        json_body: bool = False) -> web.Response:
    """One request's whole file (a narration's: narrated_file.py). Nothing is sent before the last audio: an error
    meanwhile is the answer (error_middleware renders it). json_body: one JSON object with the file in base64 (and
    the word times, asked or not)."""
    parts, last = await collect(first, stream)
    record_request_usage(request, state, last, arrived)
    samples = await state.run(delivered_audio, speech, parts)
    data = await state.run(encode_audio, samples, SAMPLE_RATE, speech.response_format, speech.sample_rate)
    words = None
    if speech.word_timestamps:
        words = await align_span(state, request_id(request), 0, samples, speech.input, speech.language)
    headers = headers | whole_file_headers(last, samples.shape[0] / SAMPLE_RATE, [])
    if json_body:
        body = {"audio": (await state.run(base64.b64encode, data)).decode("ascii")}
        return web.json_response(body | whole_file_json(speech, last, [], words), headers=headers)
    if words is not None:
        headers |= header_fields(words)
    return web.Response(body=data, content_type=content_type(speech.response_format), headers=headers)


def whole_file_headers(last: SpeechChunk, audio_seconds: float, ends: list[SegmentEnd]) -> dict[str, str]:
    """A whole file's usage and outcome in headers (a narration's: its segments too)."""
    headers = _usage_headers(usage_json(last)) | {"x-omni-tts-finish-reason": last.usage.finish_reason,
                                                  "x-omni-tts-audio-seconds": f"{audio_seconds:.3f}"}
    if ends:
        headers["x-omni-tts-segments"] = str(len(ends))
    return headers


def whole_file_json(speech: SpeechRequest, last: SpeechChunk, ends: list[SegmentEnd], words: SpanWords | None) -> dict:
    """A JSON whole file's fields but its `audio`."""
    body = {"format": speech.response_format,
            "sample_rate": output_sample_rate(speech.response_format, speech.sample_rate), "usage": usage_json(last)}
    if ends:
        body["segments"] = [segment_json(end) for end in ends]
    if words is not None:
        body |= {"words": words.seconds_json(), "characters": words.characters_json()}
        if words.reason is not None:
            body["timestamps_unavailable"] = words.reason
    return body


def cut_stream(request: web.Request, state: ServerState, error: Exception) -> None:
    """A streamed answer ended by an error long after its status line went out: the connection closes without the
    chunked body's terminator, so the client sees a truncated response instead of audio that merely stops (or a
    second response inside it)."""
    logger.warning("streamed response cut: %s", error)
    state.metrics.count_error(api_error(error).status)
    if request.transport is not None:
        request.transport.close()


async def respond_audio_stream(request: web.Request, state: ServerState, speech: SpeechRequest,
                               first: SpeechChunk, stream: AsyncIterator[SpeechChunk], arrived: float,
                               headers: dict[str, str]) -> web.StreamResponse:
    response = web.StreamResponse(headers=headers | {"Content-Type": content_type(speech.response_format)})
    response.enable_chunked_encoding()
    await response.prepare(request)
    encoder = create_stream_encoder(speech.response_format, SAMPLE_RATE, speech.sample_rate)
    try:
        header = encoder.start()
        if header:
            await response.write(header)
        try:
            async for chunk in with_first(first, stream):
                if chunk.audio.size:
                    await response.write(await encode_chunk(state, encoder, chunk.audio))
                if chunk.usage is not None:
                    record_request_usage(request, state, chunk, arrived)
        except REQUEST_ERRORS as e:
            cut_stream(request, state, e)
            return response
        tail = encoder.finish()
        if tail:
            await response.write(tail)
        await response.write_eof()
        return response
    finally:
        encoder.close()  # a cancelled or cut stream's codec context is freed now, not by the GC


async def respond_sse(request: web.Request, state: ServerState, speech: SpeechRequest, first: SpeechChunk,
                      stream: AsyncIterator[SpeechChunk], arrived: float,
                      headers: dict[str, str]) -> web.StreamResponse:
    response = web.StreamResponse(headers=headers | {"Content-Type": "text/event-stream",
                                                     "Cache-Control": "no-cache"})
    await response.prepare(request)
    encoder = create_stream_encoder(speech.response_format, SAMPLE_RATE, speech.sample_rate)

    async def send(event: dict) -> None:
        await response.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())

    timestamps = (SentenceTimestamps(state, request_id(request), speech.language, send)
                  if speech.word_timestamps else None)
    try:
        pending = encoder.start()
        try:
            async for chunk in with_first(first, stream):
                if isinstance(chunk.segment, SegmentStart):
                    await send({"type": "speech.segment", "index": chunk.segment.index, "total": chunk.segment.total,
                                "text": chunk.segment.text, "audio_offset": round(chunk.segment.audio_offset, 6)})
                if isinstance(chunk.segment, SegmentEnd):   # its audio is the pause after the segment
                    await send({"type": "speech.segment.done"} | segment_json(chunk.segment))
                    if timestamps is not None:
                        await timestamps.end(chunk.segment.text, chunk.segment.audio_offset)
                elif chunk.audio.size and timestamps is not None:
                    timestamps.feed(chunk.audio)
                if chunk.audio.size:
                    data = pending + await encode_chunk(state, encoder, chunk.audio)
                    pending = b""
                    encoded = await state.run(base64.b64encode, data)
                    await send({"type": "speech.audio.delta", "audio": encoded.decode("ascii"),
                                "response_format": speech.response_format})
                if chunk.usage is not None:
                    tail = encoder.finish()
                    if tail:
                        await send({"type": "speech.audio.delta", "audio": base64.b64encode(tail).decode("ascii"),
                                    "response_format": speech.response_format})
                    record_request_usage(request, state, chunk, arrived)
                    if timestamps is not None:
                        if not timestamps.num_spans:   # one request: its whole text
                            await timestamps.end(speech.input, 0.0)
                        await timestamps.flush()
                    await send({"type": "speech.audio.done", "usage": usage_json(chunk)})
        except REQUEST_ERRORS as e:
            error = api_error(e)
            state.metrics.count_error(error.status)
            await send({"type": "speech.audio.error", "error": error.body()["error"]})
        await response.write_eof()
        return response
    finally:
        encoder.close()
        if timestamps is not None:
            await timestamps.close()
