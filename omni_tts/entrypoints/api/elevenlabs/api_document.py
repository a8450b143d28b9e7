"""The ElevenLabs routes in the server's OpenAPI document (api/openapi.py adds them): the request body derived from
`TextToSpeechBody` (msgspec), so it states what the route decodes, and the answers in ElevenLabs' shapes."""
from __future__ import annotations

import msgspec

from omni_tts.audio.encoding import content_type
from omni_tts.entrypoints.api.response_schemas import SCHEMAS

from .tts_request import CODECS, TextToSpeechBody
from .voices import MAX_PAGE_SIZE

ERROR = {"type": "object", "required": ["detail"], "properties": {"detail": {
    "type": "object", "required": ["status", "message"],
    "properties": {"status": {"type": "string"}, "message": {"type": "string"}, "param": {"type": ["string", "null"]},
                   "request_id": {"type": "string"}}}}}
ALIGNMENT = {"type": ["object", "null"], "required": ["characters", "character_start_times_seconds",
                                                      "character_end_times_seconds"],
             "properties": {"characters": {"type": "array", "items": {"type": "string"}},
                            "character_start_times_seconds": {"type": "array", "items": {"type": "number"}},
                            "character_end_times_seconds": {"type": "array", "items": {"type": "number"}}}}
AUDIO_WITH_TIMESTAMPS = {"type": "object", "required": ["audio_base64", "alignment", "normalized_alignment"],
                         "properties": {"audio_base64": {"type": "string"}, "alignment": ALIGNMENT,
                                        "normalized_alignment": ALIGNMENT}}
VOICE = {"type": "object", "required": ["voice_id", "name", "category"], "properties": {
    "voice_id": {"type": "string"}, "name": {"type": "string"}, "category": {"enum": ["premade", "cloned"]},
    "description": {"type": ["string", "null"]}}}
COMPONENTS = {"ElevenLabsError": ERROR, "ElevenLabsAudioWithTimestamps": AUDIO_WITH_TIMESTAMPS,
              "ElevenLabsVoice": VOICE}


def error_response(description: str) -> dict:
    """An answer of ElevenLabsError."""
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": SCHEMAS + "ElevenLabsError"}}}}


def _error_responses() -> dict:
    return {status: error_response(description) for status, description in (
        ("400", "invalid request (ElevenLabs' field is named in `param`)"), ("404", "the model is not served here"),
        ("408", "the body did not arrive in time"), ("413", "the body is too large"),
        ("429", "the server is at capacity; see Retry-After"), ("503", "a stage is down and restarting"))}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _text_to_speech(operation_id: str, summary: str, ok: dict) -> dict:
    query = [{"name": name, "in": "query", "required": False, "schema": {"type": "string"}, "description": text}
             for name, text in (("output_format", "codec_rate[_bitrate], codec one of " + ", ".join(CODECS) +
                                 "; default mp3_44100_128"),
                                ("enable_logging", "ignored"), ("optimize_streaming_latency", "ignored"))]
    return {"operationId": operation_id, "summary": summary, "tags": ["ElevenLabs"],
            "parameters": [{"name": "voice_id", "in": "path", "required": True, "schema": {"type": "string"}},
                           *query],
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": SCHEMAS + "TextToSpeechBody"}}}},
            "responses": {"200": ok} | _error_responses()}


def elevenlabs_paths() -> tuple[dict, dict]:
    """(the routes' path items, the component schemas they refer to)."""
    _, schemas = msgspec.json.schema_components([TextToSpeechBody], ref_template=SCHEMAS + "{name}")
    audio = {"description": "the audio in output_format", "content": {
        content_type(fmt): {"schema": {"type": "string", "contentMediaType": content_type(fmt)}}
        for fmt in dict.fromkeys(CODECS.values())}}
    lines = {"description": "ElevenLabsAudioWithTimestamps objects, one per line",
             "content": {"application/x-ndjson": {"schema": {"type": "string"}}}}
    voice_id = {"name": "voice_id", "in": "path", "required": True, "schema": {"type": "string"}}
    voice_list = {"type": "object", "required": ["voices"],
                  "properties": {"voices": {"type": "array", "items": {"$ref": SCHEMAS + "ElevenLabsVoice"}}}}
    page = voice_list | {"required": ["voices", "has_more", "total_count", "next_page_token"]}
    page["properties"] = page["properties"] | {"has_more": {"type": "boolean"}, "total_count": {"type": "integer"},
                                               "next_page_token": {"type": ["string", "null"]}}
    clone_form = {"type": "object", "required": ["name", "files"], "properties": {
        "name": {"type": "string"}, "files": {"type": "string", "contentMediaType": "application/octet-stream"},
        "description": {"type": "string"}, "labels": {"type": "string"}, "remove_background_noise": {"type": "string"}}}
    paths = {
        "/v1/text-to-speech/{voice_id}": {"post": _text_to_speech("elevenlabsConvert", "ElevenLabs: the whole file",
                                                                  audio)},
        "/v1/text-to-speech/{voice_id}/stream": {"post": _text_to_speech(
            "elevenlabsStream", "ElevenLabs: the audio as it is made", audio)},
        "/v1/text-to-speech/{voice_id}/with-timestamps": {"post": _text_to_speech(
            "elevenlabsConvertWithTimestamps", "ElevenLabs: the whole file in base64 and its characters' times",
            _json({"$ref": SCHEMAS + "ElevenLabsAudioWithTimestamps"}, "the audio and its alignment"))},
        "/v1/text-to-speech/{voice_id}/stream/with-timestamps": {"post": _text_to_speech(
            "elevenlabsStreamWithTimestamps", "ElevenLabs: audio chunks and sentences' alignments, a JSON object "
                                              "per line", lines)},
        "/v1/voices": {"get": {"operationId": "elevenlabsVoices", "summary": "ElevenLabs: the voices",
                               "tags": ["ElevenLabs"], "responses": {"200": _json(voice_list, "every voice")}}},
        "/v2/voices": {"get": {
            "operationId": "elevenlabsSearchVoices", "summary": "ElevenLabs: the voices, searched and paged",
            "tags": ["ElevenLabs"], "parameters": [
                {"name": "search", "in": "query", "required": False, "schema": {"type": "string"}},
                {"name": "page_size", "in": "query", "required": False,
                 "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE_SIZE}},
                {"name": "next_page_token", "in": "query", "required": False,
                 "schema": {"type": "string", "pattern": "^[0-9]*$"}}],
            "responses": {"200": _json(page, "a page of the voices"),
                          "400": error_response("a bad page_size or token")}}},
        "/v1/voices/{voice_id}": {
            "get": {"operationId": "elevenlabsVoice", "summary": "ElevenLabs: one voice (an alias: the voice it "
                                                                 "stands for)", "tags": ["ElevenLabs"],
                    "parameters": [voice_id],
                    "responses": {"200": _json({"$ref": SCHEMAS + "ElevenLabsVoice"}, "the voice"),
                                  "404": error_response("no such voice")}},
            "delete": {"operationId": "elevenlabsDeleteVoice", "summary": "ElevenLabs: delete an uploaded voice",
                       "tags": ["ElevenLabs"], "parameters": [voice_id],
                       "responses": {"200": _json({"type": "object", "required": ["status"],
                                                   "properties": {"status": {"const": "ok"}}}, "deleted"),
                                     "400": error_response("a speaker of the checkpoint"),
                                     "404": error_response("no such voice, or voice uploads are disabled"),
                                     "409": error_response("a read-only voice from --voices-manifest")}}},
        "/v1/voices/add": {"post": {
            "operationId": "elevenlabsAddVoice", "summary": "ElevenLabs: an instant clone (Base models with "
                                                            "--voices-dir)", "tags": ["ElevenLabs"],
            "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": clone_form}}},
            "responses": {"200": _json({"type": "object", "required": ["voice_id", "requires_verification"],
                                        "properties": {"voice_id": {"type": "string"},
                                                       "requires_verification": {"const": False}}}, "stored"),
                          "400": error_response("not a Base model, or an invalid form, name or clip"),
                          "404": error_response("voice uploads are disabled (no --voices-dir)"),
                          "409": error_response("the voice limit is reached, or the name is a read-only voice"),
                          "413": error_response("the clip is too large, or the voice store is full"),
                          "415": error_response("the clip is not wav, flac, ogg or mp3")}}},
    }
    return paths, schemas | COMPONENTS
