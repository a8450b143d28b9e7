"""The voice routes' request schemas: POST /v1/audio/voices (a clip or x-vector upload, or a voice designed from a
prompt) and the consent recordings of /v1/audio/voice_consents, with their decoding (ApiError 400 naming the field).
The limits of what is stored are the voice store's (voices/backend.py, voices/consents.py)."""
from __future__ import annotations

import json
from typing import Annotated, Literal

import msgspec

from omni_tts.voices.backend import MAX_CONSENT_CHARS, MAX_DESCRIPTION_CHARS, MAX_PROMPT_CHARS, MAX_REF_TEXT_CHARS
from omni_tts.voices.consents import MAX_CONSENT_NAME_CHARS

from .schema import ApiError, Embedding, Name, RefText, convert_fields, decode_json


class VoiceUpload(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /v1/audio/voices: a multipart form with the fields of the `openai` SDK's `audio.voices.create` and of
    vllm-omni (`ref_text`, `speaker_embedding`, `speaker_description`): the voice is a clip (`audio_sample`) or an
    x-vector (`speaker_embedding`, a JSON list of numbers), one of them. `consent`: a consent recording's id
    (`cons_...`, which must exist) or, as vllm-omni has it, free text kept with the voice."""
    name: Name
    audio_sample: bytes | None = None
    speaker_embedding: Embedding | None = None
    consent: Annotated[str, msgspec.Meta(max_length=MAX_CONSENT_CHARS)] | None = None
    speaker_description: Annotated[str, msgspec.Meta(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    ref_text: RefText | None = None
    type: Literal["audio_sample"] = "audio_sample"


class VoicePrompt(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /v1/audio/voices with `type: "prompt"` (JSON, or the SDK's multipart form): a voice designed from a
    description (api/voice_design.py). `script_hint`: what the voice reads at creation, its clone's transcript (so
    at most a transcript's length, MAX_REF_TEXT_CHARS, where OpenAI takes 2000); `model`: a served VoiceDesign model
    (OpenAI's "auto" and dated names mean the first); `language` (ours): the script's language, a Qwen3-TTS language
    name."""
    name: Name
    type: Literal["prompt"]
    prompt: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PROMPT_CHARS)]
    script_hint: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REF_TEXT_CHARS)] | None = None
    model: Name | None = None
    language: Name | None = None


VOICE_FORM_ALIASES = {"file": "audio_sample"}  # what clients that upload "a file" name the clip
VOICE_FORM_FILES = frozenset({"audio_sample"})   # read as bytes; every other field is UTF-8 text
UPLOAD_FORM_FIELDS = frozenset(VoiceUpload.__struct_fields__)
VOICE_FORM_FIELDS = UPLOAD_FORM_FIELDS | frozenset(VoicePrompt.__struct_fields__)


def decode_voice_form(fields: dict[str, str | bytes]) -> VoiceUpload | VoicePrompt:
    """POST /v1/audio/voices' form fields (text fields as str, files as bytes) → VoicePrompt for `type: "prompt"`,
    else the upload (decode_voice_upload); ApiError(400) naming the field."""
    if fields.get("type") == "prompt":
        return checked_prompt(convert_fields(fields, VoicePrompt))
    return decode_voice_upload(fields)


def decode_voice_upload(fields: dict[str, str | bytes]) -> VoiceUpload:
    """An upload form's fields → VoiceUpload, or ApiError(400) naming the field: a voice is `audio_sample` or
    `speaker_embedding` (JSON text in the form), exactly one."""
    if isinstance(fields.get("speaker_embedding"), str):
        fields = dict(fields, speaker_embedding=_embedding_field(fields["speaker_embedding"]))
    upload = convert_fields(fields, VoiceUpload)
    if upload.speaker_embedding is not None and upload.audio_sample is not None:
        raise ApiError(400, "give audio_sample (a clip) or speaker_embedding (an x-vector), not both",
                       "speaker_embedding")
    if upload.speaker_embedding is None and upload.audio_sample is None:
        raise ApiError(400, "missing required field 'audio_sample' (or 'speaker_embedding')", "audio_sample")
    return upload


def decode_voice_prompt(body: bytes) -> VoicePrompt:
    """A JSON body of POST /v1/audio/voices: a designed voice (an upload's clip travels as multipart)."""
    try:
        return checked_prompt(decode_json(body, VoicePrompt))
    except ApiError as e:
        if e.param != "type":
            raise
    raise ApiError(400, "a JSON body designs a voice: its type must be 'prompt' (upload a clip, type "
                        "'audio_sample', as multipart/form-data)", "type")


def checked_prompt(prompt: VoicePrompt) -> VoicePrompt:
    """OpenAI's rule: neither the prompt nor a script hint may be blank."""
    for field in ("prompt", "script_hint"):
        value = getattr(prompt, field)
        if value is not None and not value.strip():
            raise ApiError(400, f"{field} must not be blank", field)
    return prompt


def _embedding_field(text: str) -> list:
    """The form's speaker_embedding, a JSON list of numbers, read by Python's reader, which takes NaN and Infinity
    too: the checkpoint's check then refuses them by name, as for a speech request."""
    try:
        values = json.loads(text)
    except (ValueError, RecursionError):
        values = None
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                               for v in values):
        raise ApiError(400, "speaker_embedding must be a JSON list of numbers", "speaker_embedding")
    return values


ConsentName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CONSENT_NAME_CHARS)]


class ConsentUpload(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /v1/audio/voice_consents: OpenAI's multipart form (the recording as a file, `language` a BCP 47 tag)."""
    name: ConsentName
    language: Name
    recording: bytes


class ConsentUpdate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /v1/audio/voice_consents/{id}: a new label (JSON)."""
    name: ConsentName


CONSENT_FORM_FILES = frozenset({"recording"})
MAX_PAGE, DEFAULT_PAGE = 100, 20   # GET /v1/audio/voice_consents' `limit`: OpenAI's bounds
