"""The HTTP API's OpenAPI 3.1 document, served at GET /openapi.json.

The speech request and voice upload schemas are derived from `SpeechRequest` and `VoiceUpload` (msgspec), so the
document states exactly what the server decodes (types, ranges, lengths; unknown fields are allowed in a speech
request, which ignores them, unless the server runs with --strict-fields); `model` is narrowed to the names the
server answers to, which it enforces (404 otherwise). Every route is documented (a test checks), and a fuzzer drives
the server from this document. GET /docs renders it (static/docs.html, no outside host); GET / is the playground.
"""
from __future__ import annotations

import importlib.resources
import json
from collections.abc import Sequence
from typing import get_args

import msgspec
from aiohttp import web

from omni_tts.audio.encoding import content_type
from omni_tts.entrypoints.api.names import VOICE_IGNORED_HEADER
from omni_tts.entrypoints.api.playground import playground_asset_names
from omni_tts.entrypoints.api.schema import (IGNORED_FIELDS_HEADER, MAX_BATCH_AUDIO_BYTES, MAX_BATCH_ITEMS,
                                           REPLICA_HEADER, ClientMessage, ResponseFormat, SpeechBatchRequest,
                                           SpeechRequest)
from omni_tts.entrypoints.api.voice_schema import VOICE_FORM_ALIASES, VOICE_FORM_FILES, VoiceUpload

from .dashscope.audio_links import AUDIO_PATH
from .dashscope.qwen_openapi import dashscope_paths
from .elevenlabs.ws_messages import openapi_paths as elevenlabs_socket_paths
from .pronunciation.dictionary_docs import pronunciation_paths, pronunciation_schemas
from .lora_routes import lora_paths
from .voice_consent_docs import consent_paths, consent_schemas
from .elevenlabs.api_document import elevenlabs_paths
from .elevenlabs.api_document import error_response as elevenlabs_error
from .response_schemas import (BATCH_RESPONSE, ERROR_RESPONSE, HEALTH, MODEL_LIST, SCHEMAS, SPEECH_EVENT,
                               SPEECH_JSON, SPEECH_STREAM_EVENT, USAGE, VOICE, VOICE_DELETED, VOICE_EMBEDDING,
                               VOICE_LIST)

# routes an API key does not guard: a health probe, and static pages with their files (they ask the browser's user
# for the key); the routes as the router names them, so a path that merely looks like one of them stays guarded
# (and DashScope's audio links, whose random id is the permission, as DashScope's signed URLs are)
OPEN_PATHS = ("/health", "/docs", "/", "/playground/{name}", AUDIO_PATH)


def is_open_route(request: web.Request) -> bool:
    """Whether the route the request matched is one of OPEN_PATHS (not found: not open)."""
    resource = request.match_info.route.resource
    return resource is not None and resource.canonical in OPEN_PATHS


def _json(schema_name: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": SCHEMAS + schema_name}}}}


def _error(description: str) -> dict:
    return _json("ErrorResponse", description)


def _request_schemas(model_names: Sequence[str], strict_fields: bool) -> dict:
    (_, _, _, client_message), schemas = msgspec.json.schema_components(
        [SpeechRequest, SpeechBatchRequest, VoiceUpload, ClientMessage], ref_template=SCHEMAS + "{name}")
    schemas["SpeechBatchRequest"]["properties"]["items"]["description"] = (
        f"1–{MAX_BATCH_ITEMS} speech requests, each a SpeechRequest that asks for a whole file; the batch's other "
        "fields are defaults an item's own fields override")
    for name in ("SpeechRequest", "SessionConfig", "SpeechBatchRequest"):
        schemas[name]["properties"]["model"]["anyOf"][0]["enum"] = list(model_names)
        if not strict_fields:  # schema.decode_speech_options: ignored, and named in a header
            del schemas[name]["additionalProperties"]
    upload = schemas["VoiceUpload"]["properties"]
    for field in VOICE_FORM_FILES:  # a file part, not base64 text (msgspec's JSON view of bytes)
        upload[field] = {"type": "string", "contentMediaType": "application/octet-stream"}
    upload["audio_sample"]["description"] = ("the reference clip: wav, flac, ogg or mp3, 1–30 s (sniffed, not "
                                             "trusted by MIME type); the field may also be called "
                                             + " or ".join(f"`{alias}`" for alias in VOICE_FORM_ALIASES))
    upload["name"]["description"] = ("1–64 letters, digits, '_', '.' or '-', not starting with '.'; an existing "
                                     "voice of that name (any case) is replaced")
    upload["ref_text"]["description"] = "the clip's transcript (enables in-context cloning)"
    upload["speaker_embedding"] = {"type": "string", "contentMediaType": "application/json", "description": (
        "instead of audio_sample: the voice as the speaker encoder's x-vector, a JSON list of as many numbers as the "
        "checkpoint's speaker encoder gives (1024 for 0.6B, 2048 for 1.7B), finite, each within ±1000")}
    upload["speaker_description"]["description"] = "free text kept with the voice and listed"
    for field in upload.values():  # a form leaves an optional field out: it has no null
        if "anyOf" in field:
            field.update(next(choice for choice in field.pop("anyOf") if choice.get("type") != "null"))
            field.pop("default")
    schemas["VoiceUpload"]["oneOf"] = [{"required": ["audio_sample"]}, {"required": ["speaker_embedding"]}]
    return schemas | {"SpeechStreamClientMessage": client_message, "SpeechStreamServerEvent": SPEECH_STREAM_EVENT}


def _header(description: str, schema_type: str = "string") -> dict:
    return {"description": description, "schema": {"type": schema_type}}


def _speech_operation() -> dict:
    audio = {content_type(fmt): {"schema": {"type": "string", "contentMediaType": content_type(fmt)}}
             for fmt in get_args(ResponseFormat)}
    sse = {"text/event-stream": {"schema": {"$ref": SCHEMAS + "SpeechEvent"}}}
    whole_json = {"application/json": {"schema": {"$ref": SCHEMAS + "SpeechJson"}}}
    return {
        "operationId": "createSpeech",
        "summary": "Synthesize speech (OpenAI CreateSpeech + Qwen3-TTS extensions)",
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": {"$ref": SCHEMAS + "SpeechRequest"}}}},
        "responses": {
            "200": {"description": "the audio: whole, a chunked stream, or SSE speech.audio.delta events",
                    "content": audio | sse | whole_json,
                    "headers": {
                        "x-omni-tts-audio-seconds": _header("whole-file responses: the audio's duration in seconds "
                                                            "(after `speed`)", "number"),
                        "x-omni-tts-finish-reason": _header("whole-file responses: stop (the end token) or length "
                                                            "(a frame budget ended it)"),
                        "x-omni-tts-input-tokens": _header("whole-file responses: input tokens (the text's, and a "
                                                           "voice clone's reference frames)", "integer"),
                        "x-omni-tts-output-tokens": _header("whole-file responses: codec frames generated",
                                                            "integer"),
                        **{f"x-vllm-omni-{name}-tokens": _header(f"whole-file responses: vllm-omni's {name} tokens",
                                                                 "integer")
                           for name in ("input", "output", "total", "input-text", "input-audio")},
                        IGNORED_FIELDS_HEADER: _header("the request's fields the server does not know, ignored "
                                                       "(absent with --strict-fields, where they are a 400)"),
                        VOICE_IGNORED_HEADER: _header("the request's voice, which this checkpoint ignores "
                                                      "(VoiceDesign; Base beside ref_audio or "
                                                      "speaker_embedding)"),
                        REPLICA_HEADER: _header("omni-tts serve-ray: the replica that served the request")}},
            "400": _error("invalid request (the field is named in `param`)"),
            "404": _error("the model is not served here"),
            "408": _error("the body did not arrive within --body-read-timeout"),
            "413": _error("the body or the reference clip is too large"),
            "429": _error("the server is at capacity; see Retry-After"),
            "503": _error("a stage is down and restarting; see Retry-After")}}


def _speech_batch_operation() -> dict:
    return {
        "operationId": "createSpeechBatch",
        "summary": "Synthesize 1–32 speech requests at once, answered together as base64 files in JSON",
        "description": ("Each item is checked and admitted as a /v1/audio/speech request and fails alone: its "
                        "result (`status` success or error, vllm-omni's) carries the status code and error that route "
                        "would answer, and the batch is still 200. The totals are vllm-omni's, and again in `summary`. "
                        f"The items' files together hold at most {MAX_BATCH_AUDIO_BYTES >> 20} MiB (each item its "
                        "equal share; over it: 413)."),
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": {"$ref": SCHEMAS + "SpeechBatchRequest"}}}},
        "responses": {
            "200": _json("SpeechBatchResponse", "every item's result, in order, and the totals"),
            "400": _error("a malformed batch (the field is named in `param`)"),
            "404": _error("the batch's `model` is not served here"),
            "408": _error("the body did not arrive within --body-read-timeout"),
            "413": _error("the body is too large")}}


def _speech_stream_operation() -> dict:
    return {
        "operationId": "speechStream",
        "summary": "Text that streams in: a WebSocket session (vllm-omni's protocol)",
        "description": (
            "Upgrade this GET to a WebSocket (RFC 6455). The client sends JSON text messages "
            "(SpeechStreamClientMessage): session.config first (the speech fields but input, plus split_granularity "
            "and stream_audio), then input.text pieces and input.done per utterance (input.cancel stops the one in "
            "progress: barge-in), session.close at the end. The "
            "server answers with JSON events (SpeechStreamServerEvent) and the audio in the configured format "
            "between a request's audio.start and audio.done: binary frames, or with audio_frames json (the default "
            "for word_timestamps over streamed pcm, as vllm-omni) audio.chunk events; an error event is followed "
            "by the close of the connection. split_granularity token (the default) speaks each utterance as one "
            "request whose text grows as it arrives, with the audio of the whole text (streaming layout). With an "
            "API key, a client that cannot set the Authorization header (a browser) may offer the subprotocols "
            "`omni-tts` and `omni-tts.bearer.<the key's UTF-8 in base64url, without padding>` instead; the server "
            "answers `omni-tts`."),
        "x-websocket": {"client-messages": {"$ref": SCHEMAS + "SpeechStreamClientMessage"},
                        "server-events": {"$ref": SCHEMAS + "SpeechStreamServerEvent"}},
        "responses": {
            "101": {"description": "Switching Protocols: the session runs over the WebSocket"},
            "400": _error("not a WebSocket upgrade request")}}


def openapi_document(model_names: Sequence[str], api_key_required: bool, strict_fields: bool = False) -> dict:
    """The document for an app answering to `model_names`; with `api_key_required` every route but OPEN_PATHS
    declares the bearer scheme and its 401; with `strict_fields` a speech request's schema refuses unknown fields."""
    voice_name = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    paths = {
        "/v1/audio/speech": {"post": _speech_operation()},
        "/v1/audio/speech/batch": {"post": _speech_batch_operation()},
        "/v1/audio/speech/stream": {"get": _speech_stream_operation()},
        "/v1/realtime": {"get": {
            "operationId": "realtime", "summary": "OpenAI's Realtime API (GA), reading text aloud: a WebSocket session",
            "description": (
                "Upgrade this GET to a WebSocket; `model` (query) is echoed. The client events and server events are "
                "OpenAI's (session.update, conversation.item.create, response.create, response.cancel → "
                "session.created/updated, conversation.item.added/done, response.created, "
                "response.output_audio.delta, ..., response.done, error); a response speaks the input_text of the "
                "user messages, `instructions` being its style (README, OpenAI Realtime). With an API key, a browser "
                "may offer the subprotocols `realtime` and `openai-insecure-api-key.<key>`; the server answers "
                "`realtime`."),
            "parameters": [{"name": "model", "in": "query", "required": False, "schema": {"type": "string"}}],
            "responses": {"101": {"description": "Switching Protocols: the session runs over the WebSocket"},
                          "400": _error("not a WebSocket upgrade request")}}},
        "/v1/audio/voices": {
            "get": {"operationId": "listVoices", "summary": "Built-in speakers and uploaded voices",
                    "responses": {"200": _json("VoiceList", "all voice names, and the uploaded voices")}},
            "post": {"operationId": "uploadVoice", "summary": "Upload a reference clip or a speaker embedding as a "
                                                             "named voice, or design one from a prompt (type "
                                                             "prompt: a VoiceDesign model speaks it, a Base model "
                                                             "clones it; with --voices-dir)",
                     "requestBody": {"required": True, "content": {
                         "multipart/form-data": {"schema": {"oneOf": [{"$ref": SCHEMAS + "VoiceUpload"},
                                                                      {"$ref": SCHEMAS + "VoicePrompt"}]}},
                         "application/json": {"schema": {"$ref": SCHEMAS + "VoicePrompt"}}}},
                     "responses": {
                         "200": {"description": "stored: the voice (OpenAI's Voice), and again under `voice` "
                                                "(vllm-omni)", "content": {"application/json": {"schema": {
                                                    "allOf": [{"$ref": SCHEMAS + "Voice"}, {
                                                        "type": "object", "required": ["success", "voice"],
                                                        "properties": {"success": {"const": True},
                                                                       "voice": {"$ref": SCHEMAS + "Voice"}}}]}}}},
                         "400": _error("invalid form (an unknown, repeated or mistyped field), name, text or clip; "
                                       "an unknown consent id; type prompt without a VoiceDesign or Base model"),
                         "404": _error("voice uploads are disabled (no --voices-dir)"),
                         "409": _error("the voice limit is reached, or the name is a read-only manifest voice"),
                         "413": _error("the clip is too large, or the voice store is full"),
                         "415": _error("the clip is not wav, flac, ogg or mp3")}}},
        "/v1/audio/voices/{name}": {
            "delete": {"operationId": "deleteVoice", "summary": "Delete an uploaded voice", "parameters": [voice_name],
                       "responses": {
                           "200": _json("VoiceDeleted", "deleted, its clip removed from disk"),
                           "404": _error("no such voice, or voice uploads are disabled"),
                           "409": _error("a read-only voice from --voices-manifest")}}},
        "/v1/audio/voices/{name}/embedding": {
            "get": {"operationId": "getVoiceEmbedding", "summary": "An uploaded voice's x-vector (a clip voice's "
                                                                   "computed from its clip, once per version)",
                    "parameters": [voice_name],
                    "responses": {
                        "200": _json("VoiceEmbedding", "the vector, to store, mix and send back as "
                                                       "speaker_embedding"),
                        "400": _error("the model is not a Base (voice clone) model"),
                        "404": _error("no such voice, or voice uploads are disabled"),
                        "503": _error("a stage is down and restarting; see Retry-After")}}},
        **consent_paths(),
        **pronunciation_paths(),
        **lora_paths(_error),
        "/v1/models": {"get": {"operationId": "listModels", "summary": "The served model",
                               "responses": {"200": _json("ModelList", "one entry per name the server answers "
                                                                       "to, the primary first")}}},
        "/health": {"get": {"operationId": "health", "summary": "Liveness of the pipeline", "security": [],
                            "responses": {"200": _json("Health", "serving"),
                                          "503": _json("Health", "a stage is down (named in `stage`)")}}},
        "/metrics": {"get": {"operationId": "metrics", "summary": "Prometheus metrics", "responses": {
            "200": {"description": "text exposition format",
                    "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/version": {"get": {"operationId": "version", "summary": "The server's version", "responses": {
            "200": {"description": "the omni_tts package version", "content": {"application/json": {"schema": {
                "type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}}}}}}},
        "/openapi.json": {"get": {"operationId": "openapi", "summary": "This document", "responses": {
            "200": {"description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
        "/docs": {"get": {"operationId": "docs", "summary": "This document, rendered for a browser (no outside "
                                                            "host)", "security": [], "responses": {
            "200": {"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}}}}},
        "/": {"get": {"operationId": "playground", "summary": "The playground: try the models, voices and streaming "
                                                              "from a browser (no outside host)", "security": [],
                      "responses": {"200": {"description": "HTML", "content": {"text/html": {
                          "schema": {"type": "string"}}}}}}},
        "/playground/{name}": {"get": {
            "operationId": "playgroundFile", "summary": "A script, style sheet or icon of the playground",
            "security": [],
            "parameters": [{"name": "name", "in": "path", "required": True,
                            "schema": {"enum": playground_asset_names()}}],
            "responses": {"200": {"description": "the file", "content": {
                              "text/javascript": {"schema": {"type": "string"}},
                              "text/css": {"schema": {"type": "string"}},
                              "image/svg+xml": {"schema": {"type": "string"}}}},
                          "404": _error("no such file")}}},
        **dashscope_paths(_error("not a WebSocket upgrade request")),
        **elevenlabs_socket_paths(),
    }
    other_paths, other_schemas = elevenlabs_paths()
    paths |= other_paths
    document = {
        "openapi": "3.1.0",
        "info": {"title": "omni_tts", "version": "1",
                 "description": "OpenAI-compatible text-to-speech for Qwen3-TTS, and ElevenLabs' REST API "
                                "(tag ElevenLabs). Every error is the OpenAI envelope (ErrorResponse), on "
                                "ElevenLabs' routes ElevenLabs' (ElevenLabsError)."},
        "paths": paths,
        "components": {"schemas": _request_schemas(model_names, strict_fields) | {
            "ErrorResponse": ERROR_RESPONSE, "Voice": VOICE, "VoiceList": VOICE_LIST,
            "VoiceEmbedding": VOICE_EMBEDDING,
            "VoiceDeleted": VOICE_DELETED, "ModelList": MODEL_LIST, "Health": HEALTH, "Usage": USAGE,
            "SpeechBatchResponse": BATCH_RESPONSE,
            "SpeechEvent": SPEECH_EVENT, "SpeechJson": SPEECH_JSON} | consent_schemas() | pronunciation_schemas()
            | other_schemas},
    }
    if api_key_required:
        document["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"apiKey": []}]
        for path, operations in paths.items():
            if path not in OPEN_PATHS:
                for operation in operations.values():
                    error = elevenlabs_error if path in other_paths else _error
                    operation["responses"]["401"] = error("missing or wrong API key")
    return document


def openapi_routes(model_names: Sequence[str], api_key_required: bool,
                   strict_fields: bool = False) -> list[web.RouteDef]:
    """GET /openapi.json, answering the document serialized once, and GET /docs, the page that renders it."""
    body = json.dumps(openapi_document(model_names, api_key_required, strict_fields)).encode()
    page = importlib.resources.files("omni_tts.entrypoints.api").joinpath("static/docs.html").read_bytes()

    async def serve_openapi(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    async def serve_docs(request: web.Request) -> web.Response:
        # the browser itself holds the page to this origin: inline script and style, fetches to the server only
        return web.Response(body=page, content_type="text/html", charset="utf-8", headers={
            "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                       "connect-src 'self'; form-action 'none'; base-uri 'none'"})

    return [web.get("/openapi.json", serve_openapi), web.get("/docs", serve_docs)]
