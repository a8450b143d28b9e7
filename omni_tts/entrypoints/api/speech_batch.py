"""POST /v1/audio/speech/batch: 1–32 speech requests in one JSON body, answered together in one JSON body.

The body is `{"items": [...], ...defaults}`: each item is a /v1/audio/speech body; every other field of the batch
(any speech field but `input`) is a default that an item's own field overrides (`speaker` and `voice` count as one
field); `response_format` defaults to wav, as vllm-omni's batch route has it (OpenAI has none). An item is checked
exactly as a request to /v1/audio/speech is (`schema.decode_speech_options`,
`synthesis.check_speech`), takes its own admission slot, and runs concurrently with the others; it asks for a
whole file (`stream: true` or a `stream_format` fails it). One item's failure is its own: its result carries the
status code and error envelope /v1/audio/speech would have answered, and the batch is still 200. Only a malformed
batch (not a JSON object; `items` missing, not a list of objects, empty or over 32; a default of the wrong type;
`input`, `stream` or `stream_format` beside `items`) is a 400, and a default `model` the server does not serve a 404.

The answer is vllm-omni's batch response with our additions: `{"id" (the request id), "results": [{"index",
"status": "success", "status_code": 200, "response_format", "media_type", "audio_data" (base64 of the file),
"usage", "finish_reason", "audio_seconds", and "voice_ignored" / "ignored_fields" as /v1/audio/speech's headers} |
{"index", "status": "error", "status_code", "error" (the envelope's error object)}, ...in the items' order],
"total", "succeeded", "failed", "summary": {the same three}}`. vllm-omni's client reads `status` as "success" /
"error" and the file as `audio_data` (sent once: it is most of the body), so the HTTP status has a name of its own.
Its size is bounded: the items' files together hold at most MAX_BATCH_AUDIO_BYTES, each item at most its equal
share (an item over it fails with 413), so the body stays under ~86 MiB once base64'd.

A client that goes away cancels the handler (the app runs with handler_cancellation), which cancels every item;
each item's audio stream is closed as it unwinds (`synthesis.open_speech`), which aborts it in every stage.
"""
from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from aiohttp import web

from omni_tts.audio.encoding import content_type
from omni_tts.entrypoints.api.schema import (FIELD_ALIASES, IGNORED_FIELDS_HEADER, JSON_RESPONSE, MAX_BATCH_AUDIO_BYTES,
                                           ApiError,
                                           SpeechBatchRequest, SpeechRequest, decode_json, decode_speech_options,
                                           describe_fields)

from .access_log import SPEECH_LOG, SpeechLog, request_id
from .admission import Admission
from .errors import REQUEST_ERRORS, api_error
from .narrated_speech import is_narrated, narration_plan
from .responders import collect, encode_whole, record_usage, usage_json
from .speech import read_body
from .state import STATE, ServerState
from .synthesis import check_speech, open_speech

logger = logging.getLogger(__name__)

# fields of a speech request that a batch does not take beside `items`
_NOT_DEFAULTS = {"input": "'input' is given in each item; the batch's other fields are defaults for every item",
                 "stream": "the batch route answers whole files; stream with POST /v1/audio/speech",
                 "stream_format": "the batch route answers whole files; stream with POST /v1/audio/speech"}


def decode_batch(body: bytes, strict: bool) -> tuple[SpeechBatchRequest, dict[str, msgspec.Raw], list[str]]:
    """(the batch, its defaults as sent, the batch's ignored fields), or ApiError(400) naming the field."""
    batch, ignored = decode_speech_options(body, SpeechBatchRequest, strict)
    for name, why in _NOT_DEFAULTS.items():
        if name in ignored:
            raise ApiError(400, f"'{name}' is not a field of a batch: {why}", name)
    raw = decode_json(body, dict[str, msgspec.Raw])
    defaults = {name: value for name, value in raw.items() if name != "items" and name not in ignored}
    defaults.setdefault("response_format", msgspec.Raw(msgspec.json.encode(batch.response_format)))  # the batch's
    return batch, defaults, ignored


def with_defaults(defaults: dict[str, msgspec.Raw], item: dict[str, msgspec.Raw]) -> bytes:
    """An item's JSON body: the defaults it does not give itself, under either name of an aliased field, then its
    own fields."""
    given = set(item)
    for alias, name in FIELD_ALIASES.items():
        if alias in given or name in given:
            given |= {alias, name}
    return msgspec.json.encode({name: value for name, value in defaults.items() if name not in given} | item)


async def create_speech_batch(request: web.Request) -> web.Response:
    state = request.app[STATE]
    arrived = time.monotonic()
    log = request[SPEECH_LOG] = SpeechLog()
    batch, defaults, ignored = decode_batch(await read_body(request, state.config.body_read_timeout),
                                           state.config.strict_fields)
    state.served_model(batch.model)  # a default every item would fail on: the batch's own 404
    share = MAX_BATCH_AUDIO_BYTES // len(batch.items)
    async with asyncio.TaskGroup() as group:  # created in order: the items take admission slots in order
        tasks = [group.create_task(_item(state, request_id(request), index, with_defaults(defaults, item), arrived,
                                         share))
                 for index, item in enumerate(batch.items)]
    results = [task.result() for task in tasks]
    if ignored:
        logger.warning("request %s: ignored unknown field(s): %s", request_id(request), describe_fields(ignored))
    log.audio_seconds = sum(r.get("audio_seconds", 0.0) for r in results)
    totals = {"total": len(results), "succeeded": sum(r["status"] == "success" for r in results)}
    totals["failed"] = totals["total"] - totals["succeeded"]
    answer = {"id": request_id(request), "results": results, **totals, "summary": totals}
    body = await state.run(msgspec.json.encode, answer)  # tens of MB at most, base64 included: off the loop
    headers = {IGNORED_FIELDS_HEADER: describe_fields(ignored)} if ignored else None
    return web.Response(body=body, content_type="application/json", headers=headers)


async def _item(state: ServerState, batch_id: str, index: int, body: bytes, arrived: float, share: int) -> dict:
    """One item's result. Until its first await it only checks and takes its slot, so items are admitted in order."""
    try:
        speech, ignored = decode_speech_options(body, SpeechRequest, state.config.strict_fields)
        if speech.streaming:
            raise ApiError(400, "the batch route answers whole files; stream with POST /v1/audio/speech",
                           "stream_format" if speech.stream_format is not None else "stream")
        if speech.word_timestamps or speech.response_format == JSON_RESPONSE:
            raise ApiError(400, "the batch route answers files without word times; ask POST /v1/audio/speech",
                           "word_timestamps" if speech.word_timestamps else "response_format")
        voice = await check_speech(state, speech)
        if is_narrated(speech, await narration_plan(state, speech, speech.input)):
            raise ApiError(400, f"the batch route speaks one segment per item (at most {state.config.segment_chars} "
                                "characters within the talker's limits); narrate a longer input with POST "
                                "/v1/audio/speech", "input")
        with Admission(state) as admission:
            async with open_speech(state, speech, voice, f"{batch_id}-{index}", admission) as (first, stream):
                state.metrics.ttfp.observe(time.monotonic() - arrived)
                parts, last = await collect(first, stream)
        record_usage(state, last, arrived)
        data, seconds = await encode_whole(state, speech, parts)
        if len(data) > share:
            raise ApiError(413, f"the item's {speech.response_format} file ({len(data)} bytes) is over its share of "
                                f"the batch's answer ({share} bytes: {MAX_BATCH_AUDIO_BYTES >> 20} MiB over its "
                                "items); send it alone to POST /v1/audio/speech")
    except REQUEST_ERRORS as e:
        error = api_error(e)
        state.metrics.requests.labels(str(error.status)).inc()
        state.metrics.count_error(error.status)
        return {"index": index, "status": "error", "status_code": error.status, "error": error.body()["error"]}
    except asyncio.CancelledError:  # the client went away
        state.metrics.requests.labels("abort").inc()
        raise
    state.metrics.requests.labels("200").inc()
    result = {"index": index, "status": "success", "status_code": 200, "response_format": speech.response_format,
              "media_type": content_type(speech.response_format),
              "audio_data": data,  # bytes: msgspec writes them as base64
              "usage": usage_json(last), "finish_reason": last.usage.finish_reason, "audio_seconds": round(seconds, 3)}
    if voice.ignored:
        result["voice_ignored"] = voice.ignored
    if ignored:
        result["ignored_fields"] = describe_fields(ignored)
        logger.warning("request %s item %d: ignored unknown field(s): %s", batch_id, index, result["ignored_fields"])
    return result
