"""GET /v1/models, /health, /metrics and /version: what the server serves and how it is doing."""
from __future__ import annotations

from aiohttp import web

from omni_tts import package_version
from omni_tts.models.qwen3_tts.prompt import TASK_TYPES

from .elevenlabs.voices import elevenlabs_models
from .errors import is_elevenlabs_client, unavailable_message
from .served_models import ServedModel
from .state import STATE

TASK_TYPE_OF_MODEL = {model_type: task_type for task_type, model_type in TASK_TYPES.items()}


async def list_models(request: web.Request) -> web.Response:
    """OpenAI's list (ElevenLabs' for its clients: elevenlabs/voices.py): one entry per name listed (names.py), the
    default model's first; `root` names the model each name stands for (its first served name), `task_type`,
    `languages` and `capabilities` (served_models.py) say what a request may ask of it, and `random_weights` whether
    it is the embedded tiny model, which speaks noise (the playground reads them). A LoRA adapter is an entry of its
    own, its `parent` the model it runs on (vLLM's field)."""
    state = request.app[STATE]
    if is_elevenlabs_client(request):   # the path is ElevenLabs' too: its clients get its list
        return web.json_response(elevenlabs_models(state))
    config = state.config
    return web.json_response({"object": "list", "data": [
        _model_entry(name, state.models[config.model_of(config.served_model(name))], config.random_weights)
        for name in config.model_names] + [
        _model_entry(name, adapter, config.random_weights) | {"parent": adapter.parent}
        for name, adapter in state.adapters.items()]})


def _model_entry(name: str, model: ServedModel, random_weights: bool) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "omni_tts", "root": model.parent or model.name,
            "task_type": TASK_TYPE_OF_MODEL[model.model_type], "languages": model.tts.prompts.languages,
            "capabilities": model.capabilities(), "random_weights": random_weights}


async def health(request: web.Request) -> web.Response:
    """200 while the pipeline serves; 503 naming the failed stage while it restarts (or after it gave up). The forced
    aligner is reported beside it (`aligner`), never as the server's health: without it only timestamps are missing."""
    state = request.app[STATE]
    tts = state.tts
    aligner = {"aligner": state.aligner.status()} if state.aligner is not None else {}
    if tts.is_healthy:
        return web.json_response({"status": "healthy"} | aligner)
    body = {"status": "unhealthy", "message": unavailable_message(tts)}
    if tts.down is not None:
        body["stage"] = tts.down
    return web.json_response(body | aligner, status=503, headers={"Retry-After": "1"})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": package_version()})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.metrics.observe_stages(await state.stage_stats(), state.tts.is_healthy, state.tts.restarts)
    return web.Response(body=state.metrics.render(), content_type="text/plain", charset="utf-8")


INFO_ROUTES = [
    web.get("/v1/models", list_models),
    web.get("/health", health),
    web.get("/metrics", metrics),
    web.get("/version", version),
]
