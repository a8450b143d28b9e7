"""GET/POST /v1/audio/voices and DELETE /v1/audio/voices/{name}: the uploaded voices (entrypoints/voices.py)."""
from __future__ import annotations

from aiohttp import web

from omni_tts.entrypoints.protocol import ApiError
from omni_tts.entrypoints.voice_backend import UPLOADS_DISABLED
from omni_tts.entrypoints.voices import VoiceError, VoiceStoreBackend

from .state import STATE, ServerState
from .voice_form import read_voice_form


def _voices_or_404(state: ServerState) -> VoiceStoreBackend:
    if state.voices is None:
        raise ApiError(404, UPLOADS_DISABLED)
    return state.voices


async def list_voices(request: web.Request) -> web.Response:
    """vllm-omni's shape (every name in `voices`, the uploads in `uploaded_voices`), OpenAI's list of voice objects
    (`object`, `data`), and for CustomVoice the OpenAI voice names' speakers (`voice_aliases`)."""
    state = request.app[STATE]
    uploaded = [v.to_json() for v in await state.run_voices(state.voices.list)] if state.voices else []
    body = {"object": "list", "data": uploaded, "uploaded_voices": uploaded,
            "voices": sorted(state.voice_names.speakers + [v["name"] for v in uploaded])}
    if state.voice_names.openai:
        body["voice_aliases"] = state.voice_names.openai
    return web.json_response(body)


async def upload_voice(request: web.Request) -> web.Response:
    state = request.app[STATE]
    store = _voices_or_404(state)
    if state.engine.config.tts_model_type != "base":
        raise ApiError(400, "uploaded voices need a Base (voice clone) model", "audio_sample")
    form = await read_voice_form(request, store.max_bytes)
    try:
        record = await state.run_voices(store.add, form.name, form.audio_sample, form.ref_text or None, form.consent)
    except VoiceError as e:
        raise ApiError(e.status, str(e), e.param) from None
    voice = record.to_json()
    return web.json_response(voice | {"success": True, "voice": voice})  # the SDK reads the top, vllm-omni `voice`


async def delete_voice(request: web.Request) -> web.Response:
    """The `openai` SDK's `VoiceDeleted` (id, object, deleted) and vllm-omni's answer (success, message)."""
    state = request.app[STATE]
    store = _voices_or_404(state)
    name = request.match_info["name"]
    try:
        record = await state.run_voices(store.delete, name)
    except VoiceError as e:
        raise ApiError(e.status, str(e), e.param) from None
    if record is None:
        raise ApiError(404, f"voice '{name}' not found", "name")
    return web.json_response({"id": record.name, "object": "audio.voice.deleted", "deleted": True, "success": True,
                              "name": record.name, "message": f"voice '{record.name}' deleted"})


VOICE_ROUTES = [
    web.get("/v1/audio/voices", list_voices),
    web.post("/v1/audio/voices", upload_voice),
    web.delete("/v1/audio/voices/{name}", delete_voice),
]
