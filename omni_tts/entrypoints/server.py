"""OpenAI-compatible HTTP server: one aiohttp app on one event loop over an engine (client_protocol.TTSClient): the
orchestrator in the same process (`omni-tts serve`), or Ray Serve replicas of it (`omni-tts serve-ray`).

Routes: POST /v1/audio/speech, WS /v1/audio/speech/stream (speech_stream.py), GET/POST /v1/audio/voices,
DELETE /v1/audio/voices/{name}, GET /v1/models, GET /health, GET /metrics, GET /version, GET /openapi.json and
GET /docs (openapi.py), GET / and GET /playground/{name} (playground.py). CPU work (tokenizer: single worker
inside the engine; reference audio, encoding, base64: a small bounded pool) never runs on the loop. Each request
gets an id (X-Request-Id, the engine's request id) and one access-log line (AccessLogger).
"""
from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import aiohttp
import numpy as np
from aiohttp import hdrs, web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import HttpProcessingError

from omni_tts import package_version
from omni_tts.audio.encoding import content_type, create_stream_encoder, encode_audio, streamable_formats
from omni_tts.audio.ref_audio import RefAudioError, RemoteAudioFetcher, UrlPolicy, fetch_ref_audio
from omni_tts.audio.speed import change_speed
from omni_tts.entrypoints.cors import Cors
from omni_tts.entrypoints.metrics import ServerMetrics
from omni_tts.entrypoints.names import (VOICE_IGNORED_HEADER, VoiceChoice, VoiceNames, accepted_model_names,
                                        unknown_uploaded_voice)
from omni_tts.entrypoints.openapi import is_open_route, openapi_routes
from omni_tts.entrypoints.playground import playground_routes
from omni_tts.entrypoints.protocol import (REPLICA_HEADER, VOICE_FORM_ALIASES, VOICE_FORM_FILES, ApiError,
                                           SpeechOptions, SpeechRequest, VoiceUpload,
                                           decode_speech_request, decode_voice_upload)
from omni_tts.entrypoints.voices import QUOTA_BYTES, VoiceError, VoiceStore, VoiceStoreBackend
from omni_tts.models.qwen3_tts.model import SAMPLE_RATE
from omni_tts.models.qwen3_tts.prompt import TASK_TYPES, RequestError, SynthesisRequest
from omni_tts.models.qwen3_tts.sampling import SamplingParams
from omni_tts.orchestrator.types import GenerationChunk, RequestFailed, RequestTimedOut, StageDeadError
from omni_tts.orchestrator.client_protocol import TTSClient
from omni_tts.stages.protocol import StageStats

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 32 * 1024 * 1024  # JSON with a base64 reference clip
TASK_TYPE_OF_MODEL = {model_type: task_type for task_type, model_type in TASK_TYPES.items()}


@dataclass
class ServerConfig:
    served_model_names: tuple[str, ...]        # the `model` values clients send; the first is the primary
    openai_model_aliases: bool = True          # also answer to OpenAI's TTS model names (names.OPENAI_TTS_MODELS)
    default_voice: str | None = None           # CustomVoice: the voice of a request that names none
    max_queue: int = 256                       # admitted requests (running + waiting); beyond → 429
    voices_dir: str | None = None
    allowed_local_media_path: str | None = None
    ref_audio_urls: UrlPolicy | None = None    # where http(s) ref_audio may lead; None: URLs are refused
    voices_quota_bytes: int = QUOTA_BYTES      # all uploaded clips together; beyond → 413
    api_key: str | None = None                 # when set, every route but openapi.OPEN_PATHS needs the key
    allowed_origins: tuple[str, ...] = ()      # CORS: browser origins that may call the API ("*": any)
    body_read_timeout: float = 30.0            # seconds for a request body to arrive; beyond → 408
    first_audio_timeout: float = 120.0         # seconds from admission to first audio; beyond → 503 (overloaded)
    request_timeout: float = 1800.0            # seconds from admission to the last audio; beyond → 504 / cut stream
    stream_idle_timeout: float = 30.0          # WS /v1/audio/speech/stream: seconds between messages, and of a
                                               # token-mode request without text, beyond which the session ends

    @property
    def model_names(self) -> tuple[str, ...]:
        return accepted_model_names(self.served_model_names, self.openai_model_aliases)


ENGINE = web.AppKey("engine", TTSClient)
CONFIG = web.AppKey("config", ServerConfig)
STATE = web.AppKey("state", "ServerState")


@dataclass
class SpeechLog:
    """What the access log tells of a speech request: never its text or audio."""
    ttfp: float | None = None            # seconds from arrival to the first audio
    audio_seconds: float | None = None   # of the whole answer, once it is finished


REQUEST_ID = web.RequestKey("request_id", str)
SPEECH_LOG = web.RequestKey("speech_log", SpeechLog)


def request_id(request: web.Request) -> str:
    """The request's id: in the X-Request-Id response header, the access log and the engine (its request id)."""
    if REQUEST_ID not in request:
        request[REQUEST_ID] = uuid.uuid4().hex
    return request[REQUEST_ID]


async def send_request_id(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["X-Request-Id"] = request_id(request)


class AccessLogger(AbstractAccessLogger):
    """One line per request: id, client, method and path (no query string), status, seconds, and for speech the
    audio's length and the time to its first audio."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, seconds: float) -> None:
        speech = request.get(SPEECH_LOG)
        details = "" if speech is None else f" audio={_seconds(speech.audio_seconds)} ttfp={_seconds(speech.ttfp)}"
        self.logger.info('%s %s "%s %s" %d %.3fs%s', request_id(request), request.remote, request.method,
                         request.path, response.status, seconds, details)

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


class ServerState:
    def __init__(self, engine: TTSClient, config: ServerConfig, voice_names: VoiceNames) -> None:
        self.engine, self.config, self.voice_names = engine, config, voice_names
        self.metrics = ServerMetrics()
        self.pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="omni-tts-audio-io")
        # another VoiceStoreBackend (voice_backend.py: an object store) would be built here
        self.voices: VoiceStoreBackend | None = (
            VoiceStore(config.voices_dir, quota_bytes=config.voices_quota_bytes) if config.voices_dir else None)
        self.fetcher = RemoteAudioFetcher(config.ref_audio_urls) if config.ref_audio_urls else None
        self.admitted = 0
        self._stage_stats: asyncio.Task | None = None

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def stage_stats(self) -> dict[str, StageStats]:
        """The stages' figures, {} if they cannot be had. Concurrent callers share one round trip: the engine
        keeps a single pending answer per stage, so overlapping calls would take each other's."""
        if not self.engine.is_healthy:
            return {}
        if self._stage_stats is None or self._stage_stats.done():
            self._stage_stats = asyncio.create_task(self.engine.stats(timeout=2.0))
        try:
            return await asyncio.shield(self._stage_stats)
        except Exception:
            return {}


def error_response(error: ApiError) -> web.Response:
    headers = {"Retry-After": "1"} if error.status in (429, 503) else None
    response = web.json_response(error.body(), status=error.status, headers=headers)
    if error.status in (408, 413):  # the body was not read to its end: the connection cannot carry another request
        response.force_close()
    return response


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Errors → the OpenAI envelope; and the one place speech requests are counted, by their response's status
    (validation errors included) or `abort` when the client went away."""
    status = "abort"
    try:
        response = await handler(request)
        status = str(response.status)
        return response
    except ApiError as e:
        status = str(e.status)
        return error_response(e)
    except web.HTTPException as e:
        status = str(e.status)
        if e.status >= 400 and e.content_type != "application/json":
            return error_response(ApiError(e.status, e.reason))
        raise
    except ConnectionResetError:
        raise
    except Exception:
        status = "500"
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ApiError(500, "internal server error; see the server log"))
    finally:
        if request.match_info.handler is create_speech:
            request.app[STATE].metrics.requests.labels(status).inc()


# --- /v1/audio/speech ----------------------------------------------------------------------------------------
async def read_body(request: web.Request, timeout: float) -> bytes:
    """The whole body: 413 beyond MAX_BODY_BYTES (declared, or counted while a chunked body arrives), 408 if it
    takes longer than `timeout` seconds (a client dribbling its body holds a connection and its buffers)."""
    too_large = ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise too_large
    try:
        return await asyncio.wait_for(request.read(), timeout)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s") from None
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None


def check_output(options: SpeechOptions, streaming: bool) -> None:
    """The output options a streamed response can honour."""
    if streaming and options.response_format not in streamable_formats():
        raise ApiError(400, f"response_format '{options.response_format}' cannot be streamed; use one of "
                            f"{', '.join(streamable_formats())} or a non-streaming request", "response_format")
    if streaming and options.speed != 1.0:
        raise ApiError(400, "speed must be 1.0 for streaming responses (time-stretching needs the whole "
                            "utterance); send a non-streaming request to change the speed", "speed")


class Admission:
    """An admitted speech request's slot among --max-queue, and the gauges that count it (with: raises 429 when
    the server is at capacity, 503 while a stage is down)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.waiting = True   # for its first audio

    def __enter__(self) -> "Admission":
        state = self.state
        if state.admitted >= state.config.max_queue:
            raise ApiError(429, f"the server is at capacity ({state.config.max_queue} requests); retry shortly")
        if not state.engine.is_healthy:
            raise ApiError(503, unavailable_message(state.engine))
        state.admitted += 1
        state.metrics.in_flight.inc()
        state.metrics.queue_depth.inc()
        return self

    def first_audio(self) -> None:
        if self.waiting:
            self.waiting = False
            self.state.metrics.queue_depth.dec()

    def __exit__(self, *exc: object) -> None:
        self.state.admitted -= 1
        self.state.metrics.in_flight.dec()
        self.first_audio()


async def create_speech(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrived = time.monotonic()
    request[SPEECH_LOG] = SpeechLog()
    speech = decode_speech_request(await read_body(request, state.config.body_read_timeout))
    check_output(speech, speech.streaming)
    if not speech.input.strip():
        raise ApiError(400, "input must not be empty", "input")
    voice = check_speech_request(state, speech)
    # the slot is taken before any expensive work: a reference-audio fetch or decode counts against admission
    with Admission(state) as admission:
        return await speak(request, state, speech, voice, arrived, admission)


async def speak(request: web.Request, state: ServerState, speech: SpeechRequest, voice: VoiceChoice, arrived: float,
                admission: Admission) -> web.StreamResponse:
    log = request[SPEECH_LOG]
    stream = None
    headers = {VOICE_IGNORED_HEADER: voice.ignored} if voice.ignored else {}
    try:
        synthesis, voice_key = await build_synthesis_request(state, speech, voice, speech.input)
        stream = state.engine.generate(synthesis, request_id=request_id(request),
                                       initial_chunk_frames=speech.initial_codec_chunk_frames, voice_key=voice_key,
                                       first_audio_timeout=state.config.first_audio_timeout,
                                       timeout=state.config.request_timeout)
        try:
            first = await anext(stream)
        except RequestError as e:
            raise ApiError(400, str(e), e.param) from None
        except StageDeadError as e:
            raise ApiError(503, str(e)) from None
        except RequestTimedOut as e:
            raise ApiError(503, f"the server is overloaded: {e}; retry shortly") from None
        except RequestFailed as e:
            raise ApiError(500, f"speech generation failed: {e}") from None
        admission.first_audio()
        if first.replica is not None:
            headers[REPLICA_HEADER] = first.replica
        log.ttfp = time.monotonic() - arrived
        state.metrics.ttfp.observe(log.ttfp)
        if not speech.streaming:
            try:
                response = await respond_whole(request, state, speech, first, stream, arrived, headers)
            except StageDeadError as e:
                raise ApiError(503, str(e)) from None
            except RequestTimedOut as e:
                raise ApiError(504, str(e)) from None
            except RequestFailed as e:
                raise ApiError(500, f"speech generation failed: {e}") from None
        elif speech.stream_format == "sse":
            response = await respond_sse(request, state, speech, first, stream, arrived, headers)
        else:
            response = await respond_audio_stream(request, state, speech, first, stream, arrived, headers)
        return response
    finally:
        if stream is not None:
            await stream.aclose()  # aborts the request in every stage if it did not finish


def unavailable_message(engine: TTSClient) -> str:
    if engine.fatal is not None:
        return f"the pipeline failed for good ({engine.fatal}); the server is exiting"
    if engine.down is not None:
        return f"stage {engine.down} failed ({engine.down_reason}); the pipeline is restarting, retry shortly"
    return "the pipeline is not running"


def check_speech_request(state: ServerState, speech: SpeechOptions) -> VoiceChoice:
    """What can be refused without work, before admission: the model name, the voice (one decision, names.py) and
    the fields this checkpoint cannot take."""
    config = state.engine.config
    if speech.model is not None and speech.model not in state.config.model_names:
        raise ApiError(404, f"model '{speech.model}' is not served here; available: "
                            f"{', '.join(state.config.model_names)}", "model", "model_not_found")
    if speech.instructions and config.tts_model_type == "custom_voice" and config.tts_model_size == "0b6":
        raise ApiError(400, "instructions are not supported by 0.6B CustomVoice checkpoints", "instructions")
    if speech.ref_audio is not None and config.tts_model_type != "base":
        raise ApiError(400, "ref_audio is only supported by Base (voice clone) models", "ref_audio")
    voices = state.voices
    return state.voice_names.choose(speech.voice_name, speech.ref_audio is not None,
                                    lambda name: voices is not None and name in voices)


async def build_synthesis_request(state: ServerState, speech: SpeechOptions, voice: VoiceChoice,
                                  text: str) -> tuple[SynthesisRequest, str | None]:
    """The engine request for `text`, and the uploaded voice's version key when ref_audio comes from one."""
    ref_audio, ref_text, voice_key = None, speech.ref_text, None
    x_vector_only = speech.x_vector_only_mode
    if speech.ref_audio is not None:
        try:
            samples = await fetch_ref_audio(speech.ref_audio, fetcher=state.fetcher, executor=state.pool,
                                            allowed_local_path=state.config.allowed_local_media_path)
            ref_audio = samples  # decoded at 24 kHz: the engine takes it as it is
        except RefAudioError as e:
            raise ApiError(e.status, str(e), "ref_audio") from None
    elif voice.uploaded is not None:
        try:  # one version, looked up and read whole, whatever uploads and deletes happen meanwhile
            loaded = await state.run(state.voices.load, voice.uploaded)
        except VoiceError as e:
            raise ApiError(e.status, str(e), "voice") from None
        if loaded is None:  # deleted since the request was checked
            raise unknown_uploaded_voice(voice.uploaded)
        record, samples = loaded
        ref_audio = samples
        voice_key = record.version_key
        if ref_text is None:
            ref_text = record.ref_text
        x_vector_only = x_vector_only or not ref_text
    synthesis = SynthesisRequest(
        text=text, task_type=speech.task_type, voice=voice.speaker, language=speech.language,
        instructions=speech.instructions, ref_audio=ref_audio, ref_text=ref_text, x_vector_only=x_vector_only,
        non_streaming_mode=speech.non_streaming_mode,
        sampling=SamplingParams(temperature=speech.temperature, top_k=speech.top_k, top_p=speech.top_p,
                                repetition_penalty=speech.repetition_penalty,
                                subtalker_temperature=speech.subtalker_temperature,
                                subtalker_top_k=speech.subtalker_top_k, subtalker_top_p=speech.subtalker_top_p,
                                max_new_tokens=speech.max_new_tokens, seed=speech.seed))
    return synthesis, voice_key


async def _rest(first: GenerationChunk, stream: AsyncIterator[GenerationChunk]) -> AsyncIterator[GenerationChunk]:
    yield first
    if first.usage is None:
        async for chunk in stream:
            yield chunk


def _usage_json(chunk: GenerationChunk) -> dict:
    u = chunk.usage
    return {"input_tokens": u.input_tokens, "output_tokens": u.output_frames,
            "total_tokens": u.input_tokens + u.output_frames}


def _record_usage(request: web.Request, chunk: GenerationChunk, arrived: float) -> None:
    """An HTTP request's last audio: in its access-log line and the metrics."""
    request[SPEECH_LOG].audio_seconds = chunk.usage.audio_seconds
    record_usage(request.app[STATE], chunk, arrived)


def record_usage(state: ServerState, chunk: GenerationChunk, arrived: float) -> None:
    """At a request's last audio: its outcome, and its latency and real-time factor counted from its arrival."""
    state.metrics.finished.labels(chunk.usage.finish_reason).inc()
    state.metrics.audio_seconds.inc(chunk.usage.audio_seconds)
    latency = time.monotonic() - arrived
    state.metrics.e2e_latency.observe(latency)
    if chunk.usage.audio_seconds > 0:
        state.metrics.real_time_factor.observe(latency / chunk.usage.audio_seconds)


async def encode_whole(state: ServerState, options: SpeechOptions, parts: list[np.ndarray]) -> tuple[bytes, float]:
    """A request's whole audio as one file of options.response_format, at options.speed (in the pool), and its
    duration in seconds (after `speed`: what the file holds)."""
    def encode() -> tuple[bytes, float]:
        audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        samples = change_speed(audio, options.speed, SAMPLE_RATE) if options.speed != 1.0 else audio
        return encode_audio(samples, SAMPLE_RATE, options.response_format), samples.shape[0] / SAMPLE_RATE
    return await state.run(encode)


async def respond_whole(request: web.Request, state: ServerState, speech: SpeechRequest, first: GenerationChunk,
                        stream: AsyncIterator[GenerationChunk], arrived: float,
                        headers: dict[str, str]) -> web.Response:
    parts, last = [], first
    async for chunk in _rest(first, stream):
        parts.append(chunk.audio)
        last = chunk
    _record_usage(request, last, arrived)
    data, seconds = await encode_whole(state, speech, parts)
    usage = _usage_json(last)
    return web.Response(body=data, content_type=content_type(speech.response_format), headers=headers | {
        "x-omni-tts-input-tokens": str(usage["input_tokens"]), "x-omni-tts-output-tokens": str(usage["output_tokens"]),
        "x-omni-tts-finish-reason": last.usage.finish_reason,
        "x-omni-tts-audio-seconds": f"{seconds:.3f}"})


async def encode_chunk(state: ServerState, encoder, audio: np.ndarray) -> bytes:
    """PCM/WAV chunks convert in microseconds; lossy codecs take tens of ms per chunk: off the loop."""
    if encoder.fmt in ("pcm", "wav"):
        return encoder.encode(audio)
    return await state.run(encoder.encode, audio)


async def respond_audio_stream(request: web.Request, state: ServerState, speech: SpeechRequest,
                               first: GenerationChunk, stream: AsyncIterator[GenerationChunk], arrived: float,
                               headers: dict[str, str]) -> web.StreamResponse:
    response = web.StreamResponse(headers=headers | {"Content-Type": content_type(speech.response_format)})
    response.enable_chunked_encoding()
    await response.prepare(request)
    encoder = create_stream_encoder(speech.response_format, SAMPLE_RATE)
    header = encoder.start()
    if header:
        await response.write(header)
    try:
        async for chunk in _rest(first, stream):
            if chunk.audio.size:
                await response.write(await encode_chunk(state, encoder, chunk.audio))
            if chunk.usage is not None:
                _record_usage(request, chunk, arrived)
    except (StageDeadError, RequestFailed) as e:
        # the status line went out long ago: end the connection without the chunked body's terminator, so the
        # client sees a truncated response instead of audio that merely stops (or a second response inside it)
        logger.warning("streamed response cut: %s", e)
        if request.transport is not None:
            request.transport.close()
        return response
    tail = encoder.finish()
    if tail:
        await response.write(tail)
    await response.write_eof()
    return response


async def respond_sse(request: web.Request, state: ServerState, speech: SpeechRequest, first: GenerationChunk,
                      stream: AsyncIterator[GenerationChunk], arrived: float,
                      headers: dict[str, str]) -> web.StreamResponse:
    response = web.StreamResponse(headers=headers | {"Content-Type": "text/event-stream",
                                                     "Cache-Control": "no-cache"})
    await response.prepare(request)
    encoder = create_stream_encoder(speech.response_format, SAMPLE_RATE)

    async def send(event: dict) -> None:
        await response.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())

    pending = encoder.start()
    try:
        async for chunk in _rest(first, stream):
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
                _record_usage(request, chunk, arrived)
                await send({"type": "speech.audio.done", "usage": _usage_json(chunk)})
    except (StageDeadError, RequestFailed) as e:
        await send({"type": "speech.audio.error", "error": {"message": str(e), "type": "server_error",
                                                            "code": "generation_failed"}})
    await response.write_eof()
    return response


# --- voices, models, health, metrics -------------------------------------------------------------------------
def _voices_or_404(state: ServerState) -> VoiceStoreBackend:
    if state.voices is None:
        raise ApiError(404, "voice uploads are disabled (start the server with --voices-dir)")
    return state.voices


async def list_voices(request: web.Request) -> web.Response:
    """vllm-omni's shape (every name in `voices`, the uploads in `uploaded_voices`), OpenAI's list of voice objects
    (`object`, `data`), and for CustomVoice the OpenAI voice names' speakers (`voice_aliases`)."""
    state = request.app[STATE]
    uploaded = [v.to_json() for v in await state.run(state.voices.list)] if state.voices else []
    body = {"object": "list", "data": uploaded, "uploaded_voices": uploaded,
            "voices": sorted(state.voice_names.speakers + [v["name"] for v in uploaded])}
    if state.voice_names.openai:
        body["voice_aliases"] = state.voice_names.openai
    return web.json_response(body)


_VOICE_FORM = ("the body must be multipart/form-data with the fields name and audio_sample (the clip; 'file' is "
               "accepted too) and optionally consent, ref_text and type")
_MAX_TEXT_FIELD_BYTES = 64 * 1024   # what a text field may hold in memory; VoiceUpload checks the real limits


async def _read_part(part: aiohttp.BodyPartReader, limit: int, field: str) -> bytes:
    data = bytearray()
    while chunk := await part.read_chunk():
        data += chunk
        if len(data) > limit:
            raise ApiError(413, f"multipart field '{field}' is larger than {limit} bytes", field)
    return bytes(data)


async def read_voice_form(request: web.Request, max_audio_bytes: int) -> VoiceUpload:
    """The upload form, strictly: an unknown field (refused before it is read), a field given twice, a text field
    sent as a file or not UTF-8 → 400 naming it; each field read with a size cap; a malformed body → 400 with
    `_VOICE_FORM`, the parser's detail to the log."""
    if request.content_type != "multipart/form-data":
        raise ApiError(400, _VOICE_FORM)
    fields: dict[str, str | bytes] = {}
    try:
        async for part in await request.multipart():
            if not isinstance(part, aiohttp.BodyPartReader):  # a nested multipart/mixed
                raise ApiError(400, _VOICE_FORM)
            if part.name is None:
                raise ApiError(400, _VOICE_FORM)
            field = VOICE_FORM_ALIASES.get(part.name, part.name)
            if field not in VoiceUpload.__struct_fields__:
                raise ApiError(400, f"unknown multipart field '{part.name}'; {_VOICE_FORM}", part.name)
            if field in fields:
                also = f" ('{part.name}' is another name for it)" if part.name != field else ""
                raise ApiError(400, f"multipart field '{field}' is given more than once{also}", field)
            if field in VOICE_FORM_FILES:
                fields[field] = await _read_part(part, max_audio_bytes, field)
                continue
            if part.filename is not None:
                raise ApiError(400, f"multipart field '{field}' must be a text field, not a file", field)
            try:
                fields[field] = (await _read_part(part, _MAX_TEXT_FIELD_BYTES, field)).decode("utf-8")
            except UnicodeDecodeError:
                raise ApiError(400, f"multipart field '{field}' is not valid UTF-8", field) from None
    except (ValueError, HttpProcessingError) as e:  # what aiohttp's parser raises for a malformed body
        logger.info("voices: unreadable multipart body: %s", e)
        raise ApiError(400, _VOICE_FORM) from None
    return decode_voice_upload(fields)


async def upload_voice(request: web.Request) -> web.Response:
    state = request.app[STATE]
    store = _voices_or_404(state)
    if state.engine.config.tts_model_type != "base":
        raise ApiError(400, "uploaded voices need a Base (voice clone) model", "audio_sample")
    form = await read_voice_form(request, store.max_bytes)
    try:
        record = await state.run(store.add, form.name, form.audio_sample, form.ref_text or None, form.consent)
    except VoiceError as e:
        raise ApiError(e.status, str(e), e.param) from None
    voice = record.to_json()
    return web.json_response(voice | {"success": True, "voice": voice})  # the SDK reads the top, vllm-omni `voice`


async def delete_voice(request: web.Request) -> web.Response:
    """The `openai` SDK's `VoiceDeleted` (id, object, deleted) and vllm-omni's answer (success, message)."""
    store = _voices_or_404(request.app[STATE])
    name = request.match_info["name"]
    try:
        record = await request.app[STATE].run(store.delete, name)
    except VoiceError as e:
        raise ApiError(e.status, str(e), e.param) from None
    if record is None:
        raise ApiError(404, f"voice '{name}' not found", "name")
    return web.json_response({"id": record.name, "object": "audio.voice.deleted", "deleted": True, "success": True,
                              "name": record.name, "message": f"voice '{record.name}' deleted"})


async def list_models(request: web.Request) -> web.Response:
    """One entry per name the server answers to, the primary first; `root` names the primary in each, and
    `task_type` and `languages` say what a request may ask of the checkpoint (the playground reads them)."""
    state = request.app[STATE]
    names = state.config.model_names
    checkpoint = {"task_type": TASK_TYPE_OF_MODEL[state.engine.config.tts_model_type],
                  "languages": state.engine.prompts.languages}
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "omni_tts", "root": names[0]} | checkpoint
        for name in names]})


async def health(request: web.Request) -> web.Response:
    """200 while the pipeline serves; 503 naming the failed stage while it restarts (or after it gave up)."""
    engine = request.app[STATE].engine
    if engine.is_healthy:
        return web.json_response({"status": "healthy"})
    body = {"status": "unhealthy", "message": unavailable_message(engine)}
    if engine.down is not None:
        body["stage"] = engine.down
    return web.json_response(body, status=503, headers={"Retry-After": "1"})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": package_version()})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.metrics.observe_stages(await state.stage_stats(), state.engine.is_healthy, state.engine.restarts)
    return web.Response(body=state.metrics.render(), content_type="text/plain", charset="utf-8")


SPEECH_STREAM_PATH = "/v1/audio/speech/stream"
# A browser's WebSocket cannot send headers, only subprotocols: on the stream route the key may come as the
# subprotocol `omni-tts.bearer.<the key's UTF-8 in base64url, unpadded>`, offered beside `omni-tts`, the one the
# server answers (so the key never comes back, and aiohttp never logs offered protocols that do not overlap).
WS_PROTOCOL = "omni-tts"
WS_KEY_PROTOCOL_PREFIX = WS_PROTOCOL + ".bearer."


def presented_api_key(request: web.Request) -> bytes | None:
    """The key a request presents: `Authorization: Bearer <key>`, or on the WebSocket route the key subprotocol."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return given.strip().encode("utf-8", "surrogateescape")
    if request.path != SPEECH_STREAM_PATH:
        return None
    offered = [protocol.strip() for protocol in request.headers.get(hdrs.SEC_WEBSOCKET_PROTOCOL, "").split(",")]
    for protocol in offered:
        if protocol.startswith(WS_KEY_PROTOCOL_PREFIX) and WS_PROTOCOL in offered:
            encoded = protocol[len(WS_KEY_PROTOCOL_PREFIX):]
            try:
                return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
            except ValueError:  # binascii.Error: not base64
                return None
    return None


def api_key_middleware(api_key: str) -> Callable:
    """401 (OpenAI envelope, code invalid_api_key) unless the request presents the key (`presented_api_key`);
    OPEN_PATHS stay open (/health for load balancers and supervisors, the /docs and playground pages for browsers,
    which cannot send the header on navigation). Runs inside error_middleware, which renders the error."""
    expected = api_key.encode("utf-8")

    @web.middleware
    async def check_api_key(request: web.Request, handler) -> web.StreamResponse:
        if not is_open_route(request):
            given = presented_api_key(request)
            # constant-time: the comparison must not tell how much of a guessed key was right
            if given is None or not hmac.compare_digest(given, expected):
                raise ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
        return await handler(request)

    return check_api_key


def build_app(engine: TTSClient, config: ServerConfig, owns_engine: bool = True) -> web.Application:
    """The app; with owns_engine it starts the engine on startup and shuts it down on cleanup."""
    cors = Cors(config.allowed_origins)
    middlewares = [cors.middleware(), error_middleware] + ([api_key_middleware(config.api_key)] if config.api_key else [])
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares, handler_args=None)
    app[ENGINE], app[CONFIG] = engine, config
    # refuses a --default-voice the checkpoint lacks before any stage starts
    voice_names = VoiceNames(engine.config.tts_model_type, engine.prompts.speakers, config.default_voice)

    async def lifecycle(app: web.Application):
        if owns_engine:
            await engine.start()
        state = app[STATE] = ServerState(engine, config, voice_names)
        yield
        if state.fetcher is not None:
            await state.fetcher.close()
        state.pool.shutdown(wait=False, cancel_futures=True)
        if owns_engine:
            await engine.shutdown()

    from omni_tts.entrypoints.speech_stream import speech_stream  # it builds on this module's handlers

    app.cleanup_ctx.append(lifecycle)
    app.on_response_prepare.append(send_request_id)
    app.on_response_prepare.append(cors.add_headers)
    app.router.add_routes([
        web.post("/v1/audio/speech", create_speech),
        web.get(SPEECH_STREAM_PATH, speech_stream),
        web.get("/v1/audio/voices", list_voices),
        web.post("/v1/audio/voices", upload_voice),
        web.delete("/v1/audio/voices/{name}", delete_voice),
        web.get("/v1/models", list_models),
        web.get("/health", health),
        web.get("/metrics", metrics),
        web.get("/version", version),
        *openapi_routes(config.model_names, api_key_required=config.api_key is not None),
        *playground_routes(),
    ])
    return app
