"""The JSON Schemas of what the server answers (response bodies, SSE and WebSocket events), for the OpenAPI
document (openapi.py), which names them in its components."""
from __future__ import annotations

SCHEMAS = "#/components/schemas/"   # where the document keeps its named schemas


ERROR_RESPONSE = {
    "type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
VOICE = {  # VoiceRecord.to_json
    "type": "object",
    "required": ["id", "object", "type", "name", "created_at", "ref_text", "consent", "speaker_description",
                 "file_size", "mime_type", "duration_s", "embedding_source", "embedding_dim"],
    "properties": {"id": {"type": "string", "description": "the name: what DELETE and a speech request's voice take"},
                   "object": {"const": "audio.voice"},
                   "type": {"enum": ["audio_sample", "speaker_embedding", "prompt"],
                            "description": "prompt: designed from a description (its clip spoken by prompt's "
                                           "VoiceDesign model, design_model)"},
                   "prompt": {"type": "string"}, "design_model": {"type": "string"},
                   "name": {"type": "string"},
                   "created_at": {"type": "integer", "description": "unix seconds, strictly increasing per upload: "
                                                                    "the voice's version"},
                   "ref_text": {"type": ["string", "null"]},
                   "consent": {"type": ["string", "null"], "description": "a consent recording's id, or free text"},
                   "speaker_description": {"type": ["string", "null"]},
                   "file_size": {"type": "integer"}, "mime_type": {"type": "string"},
                   "duration_s": {"type": ["number", "null"], "description": "the clip's; null for an embedding"},
                   "embedding_source": {"enum": ["audio", "embedding"],
                                        "description": "where the voice's x-vector comes from: its clip, or the "
                                                       "upload itself (a voice without audio)"},
                   "embedding_dim": {"type": ["integer", "null"],
                                     "description": "the x-vector's length (a clip's: the served checkpoint's; "
                                                    "null on a checkpoint without a speaker encoder)"},
                   "read_only": {"const": True, "description": "a --voices-manifest voice: it cannot be replaced "
                                                               "or deleted"}}}
VOICE_EMBEDDING = {  # GET /v1/audio/voices/{name}/embedding
    "type": "object",
    "required": ["object", "name", "created_at", "embedding_source", "embedding_dim", "speaker_embedding"],
    "properties": {"object": {"const": "audio.voice.embedding"}, "name": {"type": "string"},
                   "created_at": {"type": "integer"}, "embedding_source": {"enum": ["audio", "embedding"]},
                   "embedding_dim": {"type": "integer"},
                   "speaker_embedding": {"type": "array", "items": {"type": "number"},
                                         "description": "send it back as a speech request's speaker_embedding"}}}
VOICE_LIST = {"type": "object", "required": ["object", "data", "voices", "uploaded_voices"], "properties": {
    "object": {"const": "list"},
    "data": {"type": "array", "items": {"$ref": SCHEMAS + "Voice"}, "description": "the uploaded voices"},
    "voices": {"type": "array", "items": {"type": "string"}, "description": "the speakers and uploaded voices"},
    "uploaded_voices": {"type": "array", "items": {"$ref": SCHEMAS + "Voice"}},
    "voice_aliases": {"type": "object", "additionalProperties": {"type": "string"},
                      "description": "the alias table: the speaker (Base: uploaded voice) each alias stands for"}}}
VOICE_DELETED = {"type": "object", "required": ["id", "object", "deleted", "success", "name"], "properties": {
    "id": {"type": "string"}, "object": {"const": "audio.voice.deleted"}, "deleted": {"const": True},
    "success": {"const": True}, "name": {"type": "string"}, "message": {"type": "string"}}}
RANDOM_WEIGHTS = {"type": "boolean",
                   "description": "true for the embedded tiny model (no --model): random weights, it speaks noise"}
MODEL_LIST = {"type": "object", "required": ["object", "data"], "properties": {
    "object": {"const": "list"},
    "data": {"type": "array", "items": {"type": "object", "required": ["id", "object", "created", "owned_by"],
                                        "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                                                       "created": {"type": "integer"},
                                                       "owned_by": {"type": "string"},
                                                       "root": {"type": "string",
                                                                "description": "the primary name"},
                                                       "task_type": {"enum": ["CustomVoice", "VoiceDesign", "Base"],
                                                                     "description": "the checkpoint's task: the "
                                                                                    "only task_type it takes"},
                                                       "languages": {"type": "array", "items": {"type": "string"},
                                                                     "description": "the language values it "
                                                                                    "takes (auto: detect)"},
                                                       "random_weights": RANDOM_WEIGHTS}}}}}
INT = {"type": "integer"}
USAGE = {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens", "input_token_details"],
          "properties": {**{name: {"type": "integer"} for name in ("input_tokens", "output_tokens", "total_tokens")},
                         "input_token_details": {  # vllm-omni's split of input_tokens
                             "type": "object", "required": ["text_tokens", "audio_tokens"],
                             "properties": {"text_tokens": {"type": "integer"}, "audio_tokens": {"type": "integer"}}}}}
SPEECH_EVENT_DATA = {"oneOf": [
    {"type": "object", "required": ["type", "audio", "response_format"],
     "properties": {"type": {"const": "speech.audio.delta"}, "audio": {"type": "string", "contentEncoding": "base64"},
                    "response_format": {"type": "string"}}},
    {"type": "object", "required": ["type", "usage"],
     "properties": {"type": {"const": "speech.audio.done"}, "usage": {"$ref": SCHEMAS + "Usage"}}},
    {"type": "object", "required": ["type", "error"],
     "properties": {"type": {"const": "speech.audio.error"}, "error": {"type": "object"}}}]}
SPEECH_EVENT = {  # one event of the stream: SSE tools (schemathesis among them) read an SSE schema this way
    "type": "object", "required": ["event", "data"],
    "properties": {"event": {"enum": [event["properties"]["type"]["const"] for event in SPEECH_EVENT_DATA["oneOf"]]},
                   "data": {"type": "string", "contentMediaType": "application/json",
                            "contentSchema": SPEECH_EVENT_DATA}}}
BATCH_TOTALS = {"type": "object", "required": ["total", "succeeded", "failed"],
                 "properties": {name: INT for name in ("total", "succeeded", "failed")}}
BATCH_RESULT = {"oneOf": [  # api/speech_batch.py: vllm-omni's fields (status, audio_data, media_type) and ours
    {"type": "object", "required": ["index", "status", "status_code", "response_format", "media_type", "audio_data",
                                    "usage", "finish_reason", "audio_seconds"],
     "properties": {"index": INT, "status": {"const": "success"}, "status_code": {"const": 200},
                    "response_format": {"type": "string"}, "media_type": {"type": "string"},
                    "audio_data": {"type": "string", "contentEncoding": "base64"},
                    "usage": {"$ref": SCHEMAS + "Usage"},
                    "finish_reason": {"type": "string"}, "audio_seconds": {"type": "number"},
                    "voice_ignored": {"type": "string"}, "ignored_fields": {"type": "string"}}},
    {"type": "object", "required": ["index", "status", "status_code", "error"],
     "properties": {"index": INT, "status": {"const": "error"},
                    "status_code": {"type": "integer", "minimum": 400},
                    "error": ERROR_RESPONSE["properties"]["error"]}}]}
BATCH_RESPONSE = {"type": "object", "required": ["id", "results", *BATCH_TOTALS["required"], "summary"],
                   "properties": {"id": {"type": "string"}, "results": {"type": "array", "items": BATCH_RESULT},
                                  **BATCH_TOTALS["properties"], "summary": BATCH_TOTALS}}
HEALTH = {"type": "object", "required": ["status"], "properties": {
    "status": {"enum": ["healthy", "unhealthy"]}, "message": {"type": "string"},
    "stage": {"type": "string", "description": "the failed stage"}}}


def event(name: str, **properties: dict) -> dict:
    return {"type": "object", "required": ["type", *(p for p in properties if p not in ("sample_rate", "channels"))],
            "properties": {"type": {"const": name}} | properties}


SPEECH_STREAM_EVENT = {"oneOf": [  # the server's JSON messages on WS /v1/audio/speech/stream (api/speech_stream.py)
    event("audio.start", utterance_index=INT, sentence_index=INT, sentence_text={"type": "string"},
           format={"type": "string"}, sample_rate=INT, channels=INT),
    event("audio.done", utterance_index=INT, sentence_index=INT, total_bytes=INT, error={"type": "boolean"}),
    event("input.committed", utterance_index=INT, commit_index=INT, text={"type": "string"},
           commit_id={"type": ["string", "null"]}, sentence_index=INT, chars_committed=INT),
    event("session.done", utterance_index=INT, total_sentences=INT),
    event("input.cancelled", utterance_index=INT, cancelled={"type": "boolean"}),
    event("error", message={"type": "string"}),
    {"type": "object", "required": ["type", "utterance_index", "sentence_index", "timestamps"],
     "description": "audio_frames json (api/audio_frames.py): a piece of audio (`audio_b64`; timestamps null) or the "
                    "request's words (its last, `audio_b64` empty); else a request's words after its audio.done",
     "properties": {"type": {"const": "audio.chunk"}, "utterance_index": INT, "sentence_index": INT,
                    "chunk_id": INT, "sample_rate": INT, "channels": INT, "audio_b64": {"type": "string"},
                    "timestamps": {"type": ["array", "null"],
                                   "items": {"type": "object", "required": ["word", "start_ms", "end_ms"]}},
                    "reason": {"type": "string", "description": "why timestamps is null"}}}]}
SPEECH_JSON = {  # response_format json, or word_timestamps with `Accept: application/json` (api/responders.py)
    "type": "object", "required": ["audio", "format", "sample_rate", "usage"],
    "properties": {"audio": {"type": "string", "contentEncoding": "base64", "description": "the whole file"},
                   "format": {"type": "string"}, "sample_rate": INT, "usage": {"$ref": SCHEMAS + "Usage"},
                   "segments": {"type": "array", "description": "a narrated input's segments"},
                   "words": {"type": ["array", "null"]}, "characters": {"type": ["array", "null"]},
                   "timestamps_unavailable": {"type": "string", "description": "why words is null"}}}
