"""ElevenLabs' voice and model routes over ours: GET /v1/voices, /v2/voices, /v1/voices/{voice_id}, POST
/v1/voices/add (an instant clone: an uploaded voice, Base models), DELETE /v1/voices/{voice_id}, and /v1/models in
ElevenLabs' shape (`elevenlabs_models`: info.list_models answers it to errors.is_elevenlabs_client). A voice's
voice_id is its name here: a speaker ("premade") or an uploaded voice ("cloned")."""
from __future__ import annotations

import re

from aiohttp import web
from multidict import MultiMapping

from omni_tts.entrypoints.api.aliases import DEFAULT_MODEL_ALIASES
from omni_tts.entrypoints.api.schema import ApiError
from omni_tts.entrypoints.api.state import STATE, ServerState
from omni_tts.entrypoints.api.voice_form import read_upload_form
from omni_tts.entrypoints.api.voice_routes import add_voice, store_call, voice_store

from .tts_request import LANGUAGES, query_value

MAX_PAGE_SIZE = 100
# the instant-clone form: its fields, ours they fill, and those with no meaning here
_CLONE_FIELDS = {"files": "audio_sample", "description": "speaker_description"}
_CLONE_IGNORED = frozenset({"labels", "remove_background_noise"})
_CLONE_FORM = ("the body must be multipart/form-data with the fields name and files (one clip), and optionally "
               "description, labels and remove_background_noise")
_NOT_A_NAME = re.compile(r"[^A-Za-z0-9_.-]")


def _voice(voice_id: str, category: str, description: str | None = None) -> dict:
    """ElevenLabs' `Voice` (the fields its SDK and LiveKit read)."""
    return {"voice_id": voice_id, "name": voice_id, "category": category, "labels": {}, "description": description,
            "preview_url": None, "available_for_tiers": [], "settings": None, "samples": None,
            "high_quality_base_model_ids": [], "is_owner": category == "cloned"}


async def _all_voices(state: ServerState) -> list[dict]:
    uploaded = await state.run_voices(state.voices.list) if state.voices is not None else []
    return ([_voice(name, "premade") for name in state.voice_names.speakers] +
            [_voice(v.name, "cloned", v.speaker_description) for v in uploaded])


async def list_voices(request: web.Request) -> web.Response:
    return web.json_response({"voices": await _all_voices(request.app[STATE])})


async def search_voices(request: web.Request) -> web.Response:
    """/v2/voices: `search` (in the name, any case), `page_size` (1–100, default 10), `next_page_token` (where the
    page starts, as the last page gave it)."""
    query = request.query
    search = (query_value(query, "search") or "").lower()
    size, start = _int(query, "page_size", 10, 1, MAX_PAGE_SIZE), _int(query, "next_page_token", 0, 0, None)
    voices = [v for v in await _all_voices(request.app[STATE]) if search in v["name"].lower()]
    end = start + size
    return web.json_response({"voices": voices[start:end], "has_more": end < len(voices),
                              "total_count": len(voices), "next_page_token": str(end) if end < len(voices) else None})


def _int(query: MultiMapping[str], name: str, default: int, low: int, high: int | None) -> int:
    """An integer query parameter (a page token may be empty: the first page)."""
    value = query_value(query, name)
    if value is None or (value == "" and name == "next_page_token"):
        return default
    if not value.isdigit() or int(value) < low or (high is not None and int(value) > high):
        raise ApiError(400, f"{name} must be an integer from {low}" + (f" to {high}" if high else ""), name)
    return int(value)


async def get_voice(request: web.Request) -> web.Response:
    """A speaker or uploaded voice by its name, or by an alias of one (under the id asked for); 404 listing them."""
    state = request.app[STATE]
    voice_id = request.match_info["voice_id"]
    names = state.voice_names
    speaker = names.speaker(voice_id) if names.model_type == "custom_voice" else None
    if speaker is not None:
        return web.json_response(_voice(voice_id, "premade", None if speaker == voice_id.lower() else
                                        f"an alias of the speaker '{speaker}'"))
    if state.voices is not None:
        uploaded = {v.name.lower(): v for v in await store_call(state.run_voices, state.voices.list)}
        for name in (voice_id, names.alias(voice_id)):
            if name is not None and name.lower() in uploaded:
                return web.json_response(_voice(voice_id, "cloned", uploaded[name.lower()].speaker_description))
    available = ", ".join(v["voice_id"] for v in await _all_voices(state)) or "none yet"
    raise ApiError(404, f"voice '{voice_id}' not found; available: {available}", "voice_id")


async def add_cloned_voice(request: web.Request) -> web.Response:
    """An instant clone (`voices.ivc.create`): the first clip becomes an uploaded voice, x-vector only (no
    transcript comes with it), named after `name` (the characters a voice name cannot hold become '_')."""
    state = request.app[STATE]
    if state.clone_model.model_type != "base":
        raise ApiError(400, f"instant voice cloning needs a Base (voice clone) model; this server serves a "
                            f"{state.clone_model.model_type} one", "files")
    store = voice_store(state)
    with state.voice_write_slot():
        form = await read_upload_form(request, store.max_bytes, _CLONE_FIELDS, _CLONE_IGNORED, _CLONE_FORM)
        form.name = _NOT_A_NAME.sub("_", form.name).lstrip(".")[:64] or "voice"
        record = await add_voice(state, store, form)
    return web.json_response({"voice_id": record.name, "requires_verification": False})


async def delete_voice(request: web.Request) -> web.Response:
    state = request.app[STATE]
    voice_id = request.match_info["voice_id"]
    if voice_id.lower() in state.voice_names.speakers:
        raise ApiError(400, f"'{voice_id}' is a speaker of the checkpoint: only uploaded voices can be deleted",
                       "voice_id")
    store = voice_store(state)
    with state.voice_write_slot():
        record = await store_call(state.write_voices, store.delete, voice_id)
    if record is None:
        raise ApiError(404, f"voice '{voice_id}' not found", "voice_id")
    return web.json_response({"status": "ok"})


def elevenlabs_models(state: ServerState) -> list[dict]:
    """ElevenLabs' `Model` list: the served names, then the ElevenLabs model names of the alias table (not its
    patterns)."""
    config = state.config
    names = [*config.all_served_names,
             *(name for name in (*DEFAULT_MODEL_ALIASES, *config.aliases.models)
               if name.startswith("eleven_") and not name.endswith("*"))]
    codes = {name: code for code, name in LANGUAGES.items()}
    languages = [{"language_id": codes.get(name, name), "name": name.capitalize()}
                 for name in state.default_model.tts.prompts.languages if name != "auto"]
    return [{"model_id": name, "name": name, "description": f"served by omni-tts as {config.served_model(name)}",
             "can_do_text_to_speech": True, "can_do_voice_conversion": False, "can_be_finetuned": False,
             "can_use_style": False, "can_use_speaker_boost": False, "serves_pro_voices": False,
             "requires_alpha_access": False, "token_cost_factor": 1.0, "languages": languages,
             "maximum_text_length_per_request": config.max_input_chars} for name in dict.fromkeys(names)]


VOICE_ROUTES = [
    web.get("/v1/voices", list_voices),
    web.get("/v2/voices", search_voices),
    web.get("/v1/voices/{voice_id}", get_voice),
    web.post("/v1/voices/add", add_cloned_voice),
    web.delete("/v1/voices/{voice_id}", delete_voice),
]
