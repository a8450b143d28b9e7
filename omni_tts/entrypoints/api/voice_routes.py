"""GET/POST /v1/audio/voices, DELETE /v1/audio/voices/{name} and GET /v1/audio/voices/{name}/embedding: the
uploaded voices (voices/store.py), clips or speaker embeddings, and the voices designed from a prompt
(voice_design.py)."""
from __future__ import annotations

import functools
from typing import Awaitable, Callable, TypeVar

from aiohttp import web

from omni_tts.entrypoints.api.schema import ApiError
from omni_tts.voices.backend import UPLOADS_DISABLED
from omni_tts.voices.consents import is_consent_id
from omni_tts.voices.store import VoiceError, VoiceRecord, VoiceStoreBackend
from omni_tts.models.qwen3_tts.prompt import RequestError, check_speaker_embedding

from .access_log import request_id
from .speech import read_body
from .state import STATE, ServerState
from .voice_design import design_sample
from .voice_form import read_voice_form
from .voice_schema import VoicePrompt, VoiceUpload, decode_voice_prompt

T = TypeVar("T")


def voice_store(state: ServerState) -> VoiceStoreBackend:
    """The voice store, or 404 on a server without one."""
    if state.voices is None:
        raise ApiError(404, UPLOADS_DISABLED)
    return state.voices


def _embedding_dim(state: ServerState) -> int | None:
    """The length of the x-vectors the served checkpoint's speaker encoder gives (Base only)."""
    encoder = state.clone_model.config.speaker_encoder
    return encoder.enc_dim if encoder is not None else None


async def list_voices(request: web.Request) -> web.Response:
    """vllm-omni's shape (every name in `voices`, the uploads in `uploaded_voices`), OpenAI's list of voice objects
    (`object`, `data`), and the alias table's voices: alias → speaker or uploaded voice (`voice_aliases`)."""
    state = request.app[STATE]
    dim = _embedding_dim(state)
    uploaded = [v.to_json(dim) for v in await state.run_voices(state.voices.list)] if state.voices else []
    body = {"object": "list", "data": uploaded, "uploaded_voices": uploaded,
            "voices": sorted({speaker for model in state.models.values() for speaker in model.voice_names.speakers}
                             | {v["name"] for v in uploaded})}
    if state.voice_names.aliases:
        body["voice_aliases"] = state.voice_names.aliases
    return web.json_response(body)


async def upload_voice(request: web.Request) -> web.Response:
    """A clip or x-vector upload (multipart), or a voice designed from a prompt (JSON or multipart)."""
    state = request.app[STATE]
    store = voice_store(state)
    with state.voice_write_slot():
        if request.content_type == "application/json":
            form = decode_voice_prompt(await read_body(request, state.config.body_read_timeout))
        else:
            form = await read_voice_form(request, store.max_bytes)
        if isinstance(form, VoicePrompt):
            record = await add_designed_voice(state, store, form, request_id(request))
        else:
            if state.clone_model.model_type != "base":
                raise ApiError(400, "uploaded voices need a Base (voice clone) model", "audio_sample")
            record = await add_voice(state, store, form)
    voice = record.to_json(_embedding_dim(state))
    return web.json_response(voice | {"success": True, "voice": voice})  # the SDK reads the top, vllm-omni `voice`


async def add_designed_voice(state: ServerState, store: VoiceStoreBackend, form: VoicePrompt,
                             request_id: str) -> VoiceRecord:
    """Design the voice `form` describes and store its sample as a clip voice (call it under a write slot)."""
    sample, script, design = await design_sample(state, form, request_id)
    try:
        return await state.write_voices(functools.partial(store.add, form.name, sample, script, None, design=design))
    except VoiceError as e:  # the clip's checks name a field the client did not send: the sample its script made
        if e.param != "audio_sample":
            raise ApiError(e.status, str(e), e.param) from None
        raise ApiError(e.status, f"{str(e).replace('audio_sample', 'the designed sample', 1)}; give another "
                                 "script_hint", "script_hint") from None


async def add_voice(state: ServerState, store: VoiceStoreBackend, form: VoiceUpload) -> VoiceRecord:
    """Store the voice `form` gives (call it under a write slot), or ApiError naming the field. A `consent` shaped
    as a consent recording's id must name one; other text is kept as given (vllm-omni's free-text consent)."""
    if is_consent_id(form.consent) and (
            state.consents is None or await store_call(state.run_voices, state.consents.get, form.consent) is None):
        raise ApiError(400, f"consent recording '{form.consent}' does not exist (POST /v1/audio/voice_consents "
                            "makes one)", "consent")
    try:
        if form.speaker_embedding is not None:
            vector = check_speaker_embedding(state.clone_model.config, form.speaker_embedding, ref_audio=False,
                                             ref_text=bool((form.ref_text or "").strip()))
            record = await state.write_voices(store.add_embedding, form.name, vector, form.consent,
                                              form.speaker_description)
        else:
            record = await state.write_voices(store.add, form.name, form.audio_sample, form.ref_text or None,
                                              form.consent, form.speaker_description)
    except RequestError as e:
        raise ApiError(400, str(e), e.param) from None
    except VoiceError as e:
        raise ApiError(e.status, str(e), e.param) from None
    return record


async def store_call(run: Callable[..., Awaitable[T]], method: Callable[..., T], *args: object) -> T:
    """A voice store call, run by `run` (ServerState.run_voices or write_voices); its VoiceError as the API error it
    says."""
    try:
        return await run(method, *args)
    except VoiceError as e:
        raise ApiError(e.status, str(e), e.param) from None


async def delete_voice(request: web.Request) -> web.Response:
    """The `openai` SDK's `VoiceDeleted` (id, object, deleted) and vllm-omni's answer (success, message)."""
    state = request.app[STATE]
    store = voice_store(state)
    name = request.match_info["name"]
    with state.voice_write_slot():
        record = await store_call(state.write_voices, store.delete, name)
    if record is None:
        raise ApiError(404, f"voice '{name}' not found", "name")
    return web.json_response({"id": record.name, "object": "audio.voice.deleted", "deleted": True, "success": True,
                              "name": record.name, "message": f"voice '{record.name}' deleted"})


async def voice_embedding(request: web.Request) -> web.Response:
    """A voice's x-vector, to store, mix and send back as a speech request's `speaker_embedding`: an embedding
    voice's own, or for a clip voice the one the talker computes from the clip (the very vector of its
    x-vector-only requests), once per version of the voice."""
    state = request.app[STATE]
    store = voice_store(state)
    name = request.match_info["name"]
    if _embedding_dim(state) is None:
        raise ApiError(400, "speaker embeddings need a Base (voice clone) model", "name")
    loaded = await store_call(state.run_voices, store.load, name)
    if loaded is None:
        raise ApiError(404, f"voice '{name}' not found", "name")
    record, voice = loaded
    if record.embedding_dim is None:
        vector = state.voice_embeddings.get(record.voice_version)
        if vector is None:  # pipeline errors (a stage down: 503) reach error_middleware
            try:
                vector = await state.clone_model.tts.embed_voice(voice, record.voice_version)
            except RequestError as e:  # the speaker encoder refuses the voice's clip
                raise ApiError(400, f"voice '{record.name}': {e}", "name") from None
            state.voice_embeddings.put(record.voice_version, vector)
        voice = vector
    return web.json_response({"object": "audio.voice.embedding", "name": record.name,
                              "created_at": record.created_at, "embedding_source": record.embedding_source,
                              "embedding_dim": int(voice.shape[0]), "speaker_embedding": voice.tolist()})


VOICE_ROUTES = [
    web.get("/v1/audio/voices", list_voices),
    web.post("/v1/audio/voices", upload_voice),
    web.delete("/v1/audio/voices/{name}", delete_voice),
    web.get("/v1/audio/voices/{name}/embedding", voice_embedding),
]
