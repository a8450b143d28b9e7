"""POST /v1/audio/speech: read and check the body, admit, build the pipeline request, then hand its first audio to
one of the responders (responders.py)."""
from __future__ import annotations

import asyncio
import functools
import logging
import time

import msgspec
from aiohttp import web

from omni_tts.entrypoints.api.names import VOICE_IGNORED_HEADER, VoiceChoice
from omni_tts.entrypoints.api.schema import (IGNORED_FIELDS_HEADER, JSON_RESPONSE, REPLICA_HEADER, ApiError,
                                           SpeechRequest, decode_speech_request, describe_fields)

from .access_log import SPEECH_LOG, SpeechLog, request_id
from .admission import Admission
from .narrated_file import respond_narrated_file
from .narrated_speech import is_narrated, narration_plan, open_narration
from .responders import Responder, respond_audio_stream, respond_sse, respond_whole
from .state import STATE, ServerState
from .served_models import wait_for_model
from .synthesis import build_synthesis_request, check_speech, open_speech
from .word_times import check_word_timestamps

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024  # JSON with a base64 reference clip


async def read_body(request: web.Request, timeout: float) -> bytes:
    """The whole body: 413 beyond MAX_BODY_BYTES (declared, or counted while a chunked body arrives), 408 if it
    takes longer than `timeout` seconds (a client dribbling its body holds a connection and its buffers)."""
    too_large = ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise too_large
    try:
        # not wait_for: on 3.11 it turns the cancellation of a client that left mid-body into the read's own error
        # (a ConnectionResetError, which aiohttp logs with a traceback) instead of the cut it is
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s") from None
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None


async def create_speech(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrived = time.monotonic()
    request[SPEECH_LOG] = SpeechLog()
    speech, ignored = decode_speech_request(await read_body(request, state.config.body_read_timeout),
                                            state.config.strict_fields)
    if ignored:
        logger.warning("request %s: ignored unknown field(s): %s", request_id(request), describe_fields(ignored))
    json_body = speech.response_format == JSON_RESPONSE or (
        speech.word_timestamps and not speech.streaming and _accepts_json_first(request))
    if speech.response_format == JSON_RESPONSE:
        if speech.streaming:
            raise ApiError(400, "response_format 'json' is a whole response: it cannot stream", "response_format")
        speech = msgspec.structs.replace(speech, response_format="wav")   # the audio inside the JSON
    headers = {IGNORED_FIELDS_HEADER: describe_fields(ignored)} if ignored else {}
    respond = functools.partial(respond_whole, json_body=json_body) if not speech.streaming else None
    narrated = functools.partial(respond_narrated_file, json_body=json_body) if not speech.streaming else None
    return await answer_speech(request, speech, arrived, headers, respond, narrated)


async def answer_speech(request: web.Request, speech: SpeechRequest, arrived: float, headers: dict[str, str],
                        respond: Responder | None = None, narrated: Responder | None = None) -> web.StreamResponse:
    """A decoded speech request's answer (POST /v1/audio/speech, ElevenLabs' text-to-speech routes): every check
    before admission, the slot, the first audio, then the responder: `respond` for one request, `narrated` for a
    narrated input; None: the one the request's fields choose (raw audio stream, or SSE). `request[SPEECH_LOG]` is
    set by the caller."""
    state = request.app[STATE]
    voice = await check_speech(state, speech)
    check_word_timestamps(state, speech, speech.streaming and speech.stream_format == "audio")
    if voice.ignored:
        headers = headers | {VOICE_IGNORED_HEADER: voice.ignored}
    segments = await narration_plan(state, speech, speech.input)
    segments = segments if is_narrated(speech, segments) else None
    if segments is not None and speech.speed != 1.0:
        raise ApiError(400, "speed must be 1.0 for a narrated input (longer than one segment)", "speed")
    if speech.streaming and speech.stream_format == "audio":
        default = respond_audio_stream
    else:  # stream_format sse, or `stream: true` alone (vllm-omni's meaning: SSE)
        default = respond_sse
    respond = (respond if segments is None else narrated) or default
    # the slot is taken before any expensive work: a reference-audio fetch or decode counts against admission
    with Admission(state) as admission:
        return await _speak(request, state, speech, voice, arrived, admission, headers, segments, respond)


def _accepts_json_first(request: web.Request) -> bool:
    """`Accept: application/json` (first): a whole response with word times comes as one JSON body."""
    return request.headers.get("Accept", "").split(",")[0].split(";")[0].strip().lower() == "application/json"


async def _speak(request: web.Request, state: ServerState, speech: SpeechRequest, voice: VoiceChoice,
                 arrived: float, admission: Admission, headers: dict[str, str], segments: list | None,
                 respond: Responder) -> web.StreamResponse:
    """A pipeline error before the first audio (or before the last, for a whole file) is the answer: it propagates
    to error_middleware, which gives it its status (errors.api_error)."""
    log = request[SPEECH_LOG]
    headers = headers | await wait_for_model(state.served_model(speech.model))
    if segments is None:
        opened = open_speech(state, speech, voice, request_id(request), admission)
    else:
        synthesis, voice_version = await build_synthesis_request(state, speech, voice, "")
        opened = open_narration(state, speech, synthesis, voice_version, segments, request_id(request), admission,
                                log)
    async with opened as (first, stream):
        if first.replica is not None:
            headers = headers | {REPLICA_HEADER: first.replica}
        log.ttfp = time.monotonic() - arrived
        state.metrics.ttfp.observe(log.ttfp)
        return await respond(request, state, speech, first, stream, arrived, headers)


@web.middleware
async def count_speech_requests(request: web.Request, handler) -> web.StreamResponse:
    """The one place speech requests are counted, by their response's status (validation errors included, as
    error_middleware, inside this one, renders them) or `abort` when the client went away; an error status by its
    kind too (an error after the response started is counted where it ends the stream: responders.py). ElevenLabs'
    text-to-speech routes are speech requests too."""
    if request.match_info.handler is not create_speech and not (
            request.method == "POST" and request.path.startswith("/v1/text-to-speech/")):
        return await handler(request)
    status = "abort"
    try:
        response = await handler(request)
        status = str(response.status)
        return response
    except web.HTTPException as e:
        status = str(e.status)
        raise
    finally:
        metrics = request.app[STATE].metrics
        metrics.requests.labels(status).inc()
        if status.isdigit() and int(status) >= 400:
            metrics.count_error(int(status))
