"""The multipart forms of the voice routes (POST /v1/audio/voices, /v1/audio/voice_consents), read strictly and with
a size cap per field."""
from __future__ import annotations

import logging

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from omni_tts.entrypoints.api.schema import ApiError
from omni_tts.entrypoints.api.voice_schema import (UPLOAD_FORM_FIELDS, VOICE_FORM_ALIASES, VOICE_FORM_FIELDS,
                                                 VOICE_FORM_FILES, VoicePrompt, VoiceUpload, decode_voice_form,
                                                 decode_voice_upload)

logger = logging.getLogger(__name__)

_VOICE_FORM = ("the body must be multipart/form-data with the fields name and audio_sample (the clip; 'file' is "
               "accepted too) or speaker_embedding (a JSON list of numbers), and optionally consent, ref_text, "
               "speaker_description and type; or, for type 'prompt' (also as JSON), name, prompt and optionally "
               "script_hint, model and language")
_MAX_TEXT_FIELD_BYTES = 64 * 1024   # what a text field may hold in memory; the schemas check the real limits


async def read_part(part: aiohttp.BodyPartReader, limit: int, field: str) -> bytes:
    data = bytearray()
    while chunk := await part.read_chunk():
        data += chunk
        if len(data) > limit:
            raise ApiError(413, f"multipart field '{field}' is larger than {limit} bytes", field)
    return bytes(data)


async def read_voice_form(request: web.Request, max_audio_bytes: int) -> VoiceUpload | VoicePrompt:
    """POST /v1/audio/voices' form (read_form): an upload, or a voice designed from a prompt."""
    return decode_voice_form(await read_form(request, VOICE_FORM_FIELDS, VOICE_FORM_FILES, max_audio_bytes,
                                             _VOICE_FORM, VOICE_FORM_ALIASES))


async def read_upload_form(request: web.Request, max_audio_bytes: int, aliases: dict[str, str],
                           ignored: frozenset[str], usage: str) -> VoiceUpload:
    """Another API's upload form (ElevenLabs' instant clone): an upload's fields under the names `aliases` gives."""
    return decode_voice_upload(await read_form(request, UPLOAD_FORM_FIELDS, VOICE_FORM_FILES, max_audio_bytes, usage,
                                               aliases, ignored))


async def read_form(request: web.Request, known: frozenset[str], files: frozenset[str], max_file_bytes: int,
                    usage: str, aliases: dict[str, str] | None = None,
                    ignored: frozenset[str] = frozenset()) -> dict[str, str | bytes]:
    """A form's fields, strictly: an unknown field (refused before it is read), a field given twice, a text field
    sent as a file or not UTF-8 → 400 naming it; each field read with a size cap (`files` at `max_file_bytes`,
    read as bytes); a malformed body → 400 with `usage`, the parser's detail to the log. `aliases`: other names of
    the fields; `ignored`: fields read (bounded) and dropped."""
    aliases = aliases or {}
    if request.content_type != "multipart/form-data":
        raise ApiError(400, usage)
    fields: dict[str, str | bytes] = {}
    try:
        async for part in await request.multipart():
            if not isinstance(part, aiohttp.BodyPartReader):  # a nested multipart/mixed
                raise ApiError(400, usage)
            if part.name is None:
                raise ApiError(400, usage)
            if part.name in ignored:
                await read_part(part, _MAX_TEXT_FIELD_BYTES, part.name)
                continue
            field = aliases.get(part.name, part.name)
            if field not in known:
                raise ApiError(400, f"unknown multipart field '{part.name}'; {usage}", part.name)
            if field in fields:
                also = f" ('{part.name}' is another name for it)" if part.name != field else ""
                raise ApiError(400, f"multipart field '{field}' is given more than once{also}", field)
            if field in files:
                fields[field] = await read_part(part, max_file_bytes, field)
                continue
            if part.filename is not None:
                raise ApiError(400, f"multipart field '{field}' must be a text field, not a file", field)
            try:
                fields[field] = (await read_part(part, _MAX_TEXT_FIELD_BYTES, field)).decode("utf-8")
            except UnicodeDecodeError:
                raise ApiError(400, f"multipart field '{field}' is not valid UTF-8", field) from None
    except (ValueError, HttpProcessingError) as e:  # what aiohttp's parser raises for a malformed body
        logger.info("voices: unreadable multipart body: %s", e)
        raise ApiError(400, usage) from None
    return fields
