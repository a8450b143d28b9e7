"""The OpenAPI paths and schemas of /v1/audio/voice_consents (voice_consents.py) and of a voice designed from a prompt
(voice_design.py), which openapi.py adds to the server's document."""
from __future__ import annotations

import msgspec

from omni_tts.entrypoints.api.response_schemas import SCHEMAS

from .voice_schema import DEFAULT_PAGE, MAX_PAGE, ConsentUpdate, ConsentUpload, VoicePrompt

_STRING = {"type": "string"}
VOICE_CONSENT = {"type": "object", "required": ["id", "object", "name", "language", "created_at"], "properties": {
    "id": {"type": "string", "description": "cons_ and 32 hex digits: what an uploaded voice's consent names"},
    "object": {"const": "audio.voice_consent"}, "name": _STRING,
    "language": {"type": "string", "description": "the consent phrase's BCP 47 tag"},
    "created_at": {"type": "integer"}}}
VOICE_CONSENT_LIST = {"type": "object", "required": ["object", "data", "has_more"], "properties": {
    "object": {"const": "list"}, "data": {"type": "array", "items": {"$ref": SCHEMAS + "VoiceConsent"}},
    "first_id": {"type": ["string", "null"]}, "last_id": {"type": ["string", "null"]},
    "has_more": {"type": "boolean"}}}
VOICE_CONSENT_DELETED = {"type": "object", "required": ["id", "object", "deleted"], "properties": {
    "id": _STRING, "object": {"const": "audio.voice_consent"}, "deleted": {"const": True}}}


def _json(schema: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": SCHEMAS + schema}}}}


def _error(description: str) -> dict:
    return _json("ErrorResponse", description)


def consent_schemas() -> dict:
    """The request schemas (the consent form, its update, a designed voice's body) and the answers'."""
    (_, _, _), schemas = msgspec.json.schema_components([ConsentUpload, ConsentUpdate, VoicePrompt],
                                                        ref_template=SCHEMAS + "{name}")
    schemas["ConsentUpload"]["properties"]["recording"] = {
        "type": "string", "contentMediaType": "application/octet-stream",
        "description": "the consent recording: wav, flac, ogg or mp3, 1–30 s, at most 10 MiB"}
    schemas["VoicePrompt"]["properties"]["language"]["description"] = (
        "the script's language (a Qwen3-TTS language name); without script_hint it picks the default script "
        "(absent: English)")
    return schemas | {"VoiceConsent": VOICE_CONSENT, "VoiceConsentList": VOICE_CONSENT_LIST,
                      "VoiceConsentDeleted": VOICE_CONSENT_DELETED}


def consent_paths() -> dict:
    consent_id = {"name": "consent_id", "in": "path", "required": True, "schema": _STRING}
    missing = _error("no such consent recording, or voice uploads are disabled (no --voices-dir)")
    return {
        "/v1/audio/voice_consents": {
            "get": {"operationId": "listVoiceConsents", "summary": "The consent recordings, oldest first",
                    "parameters": [
                        {"name": "after", "in": "query", "required": False, "schema": _STRING},
                        {"name": "limit", "in": "query", "required": False,
                         "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE, "default": DEFAULT_PAGE}}],
                    "responses": {"200": _json("VoiceConsentList", "a page of recordings"),
                                  "400": _error("limit out of range, or `after` is not a consent recording id"),
                                  "404": _error("voice uploads are disabled (no --voices-dir)")}},
            "post": {"operationId": "createVoiceConsent", "summary": "Upload a consent recording (OpenAI's shape)",
                     "requestBody": {"required": True, "content": {"multipart/form-data": {
                         "schema": {"$ref": SCHEMAS + "ConsentUpload"}}}},
                     "responses": {"200": _json("VoiceConsent", "stored"),
                                   "400": _error("invalid form, name, language or recording"),
                                   "404": _error("voice uploads are disabled (no --voices-dir)"),
                                   "409": _error("the recording limit is reached"),
                                   "413": _error("the recording is too large, or the recordings' quota is full"),
                                   "415": _error("the recording is not wav, flac, ogg or mp3")}}},
        "/v1/audio/voice_consents/{consent_id}": {
            "get": {"operationId": "getVoiceConsent", "summary": "A consent recording", "parameters": [consent_id],
                    "responses": {"200": _json("VoiceConsent", "the recording"), "404": missing}},
            "post": {"operationId": "updateVoiceConsent", "summary": "Rename a consent recording",
                     "parameters": [consent_id],
                     "requestBody": {"required": True, "content": {"application/json": {
                         "schema": {"$ref": SCHEMAS + "ConsentUpdate"}}}},
                     "responses": {"200": _json("VoiceConsent", "renamed"), "400": _error("invalid name"),
                                   "404": missing}},
            "delete": {"operationId": "deleteVoiceConsent", "summary": "Delete a consent recording (the voices that "
                                                                       "name it keep its id)",
                       "parameters": [consent_id],
                       "responses": {"200": _json("VoiceConsentDeleted", "deleted"), "404": missing}}},
    }
