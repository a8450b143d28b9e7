"""/v1/audio/voice_consents: OpenAI's consent recordings (create, list, retrieve, update, delete), kept beside the
uploaded voices (voices/consents.py); an uploaded voice names one as its `consent`."""
from __future__ import annotations

from aiohttp import web

from omni_tts.voices.backend import UPLOADS_DISABLED
from omni_tts.voices.consents import ConsentRecord, ConsentStore, is_consent_id

from .schema import ApiError, convert_fields, decode_json
from .speech import read_body
from .state import STATE, ServerState
from .voice_form import read_form
from .voice_routes import store_call
from .voice_schema import CONSENT_FORM_FILES, DEFAULT_PAGE, MAX_PAGE, ConsentUpdate, ConsentUpload

_CONSENT_FORM = ("the body must be multipart/form-data with the fields name, language (a BCP 47 tag) and recording "
                 "(the audio file)")


def consent_store(state: ServerState) -> ConsentStore:
    """The consent recordings, or 404 on a server without a voices directory."""
    if state.consents is None:
        raise ApiError(404, UPLOADS_DISABLED)
    return state.consents


def _found(record: ConsentRecord | None, consent_id: str) -> ConsentRecord:
    if record is None:
        raise ApiError(404, f"consent recording '{consent_id}' not found", "consent_id")
    return record


async def create_consent(request: web.Request) -> web.Response:
    state = request.app[STATE]
    store = consent_store(state)
    with state.voice_write_slot():
        fields = await read_form(request, frozenset(ConsentUpload.__struct_fields__), CONSENT_FORM_FILES,
                                 store.max_bytes, _CONSENT_FORM)
        form = convert_fields(fields, ConsentUpload)
        record = await store_call(state.write_voices, store.add, form.name, form.language, form.recording)
    return web.json_response(record.to_json())


async def list_consents(request: web.Request) -> web.Response:
    """OpenAI's cursor page, oldest first: `limit` (1–100, 20) recordings after the id `after`."""
    state = request.app[STATE]
    try:
        limit = int(request.query.get("limit", DEFAULT_PAGE))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise ApiError(400, f"limit must be an integer from 1 to {MAX_PAGE}", "limit")
    records = await store_call(state.run_voices, consent_store(state).list)
    after = request.query.get("after")
    if after is not None:
        if not is_consent_id(after):
            raise ApiError(400, f"after must be a consent recording's id, not '{after}'", "after")
        records = [r for r in records if r.id > after]   # ids sort as made: a page after a deleted one goes on
    page = [r.to_json() for r in records[:limit]]
    return web.json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None, "has_more": len(records) > limit})


async def get_consent(request: web.Request) -> web.Response:
    state = request.app[STATE]
    consent_id = request.match_info["consent_id"]
    record = await store_call(state.run_voices, consent_store(state).get, consent_id)
    return web.json_response(_found(record, consent_id).to_json())


async def update_consent(request: web.Request) -> web.Response:
    """A new label (JSON `{"name"}`)."""
    state = request.app[STATE]
    store = consent_store(state)
    update = decode_json(await read_body(request, state.config.body_read_timeout), ConsentUpdate)
    consent_id = request.match_info["consent_id"]
    with state.voice_write_slot():
        record = await store_call(state.write_voices, store.rename, consent_id, update.name)
    return web.json_response(_found(record, consent_id).to_json())


async def delete_consent(request: web.Request) -> web.Response:
    """OpenAI's VoiceConsentDeleted. The voices that name it keep its id."""
    state = request.app[STATE]
    store = consent_store(state)
    consent_id = request.match_info["consent_id"]
    with state.voice_write_slot():
        record = _found(await store_call(state.write_voices, store.delete, consent_id), consent_id)
    return web.json_response({"id": record.id, "object": "audio.voice_consent", "deleted": True})


CONSENT_ROUTES = [
    web.get("/v1/audio/voice_consents", list_consents),
    web.post("/v1/audio/voice_consents", create_consent),
    web.get("/v1/audio/voice_consents/{consent_id}", get_consent),
    web.post("/v1/audio/voice_consents/{consent_id}", update_consent),
    web.delete("/v1/audio/voice_consents/{consent_id}", delete_consent),
]
