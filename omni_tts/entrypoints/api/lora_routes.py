"""vLLM's LoRA routes: POST /v1/load_lora_adapter {lora_name, lora_path} and /v1/unload_lora_adapter {lora_name}
(lora_int_id ignored), answered as vLLM answers (200 with a line of text) or with the OpenAI error envelope. An
adapter runs on the default model unless `base_model_name` (ours) names another served one, and is served as model
`lora_name` from then on. Run-time loads are off unless the server has `--lora-dir DIR`, and read only from under it:
a path a client sends is a file this process opens."""
from __future__ import annotations

import os
from typing import Callable

import msgspec
from aiohttp import web

from omni_tts.entrypoints.api.schema import ApiError
from omni_tts.models.qwen3_tts.prompt import RequestError

from .served_models import adapter_model
from .state import STATE, ServerState

MAX_BODY_BYTES = 64 * 1024


class LoadAdapter(msgspec.Struct):
    lora_name: str
    lora_path: str
    base_model_name: str | None = None


class UnloadAdapter(msgspec.Struct):
    lora_name: str
    lora_int_id: int | None = None


async def _body(request: web.Request, kind: type) -> msgspec.Struct:
    data = await request.content.read(MAX_BODY_BYTES + 1)
    if len(data) > MAX_BODY_BYTES:
        raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes")
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"invalid body: {e}", "body") from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the body is not JSON: {e}", "body") from None


def _adapter_path(state: ServerState, path: str) -> str:
    """`path` (absolute, or relative to --lora-dir) resolved inside --lora-dir, or ApiError."""
    root = state.config.lora_dir
    if root is None:
        raise ApiError(404, "loading LoRA adapters at run time is off: start the server with --lora-dir DIR")
    resolved = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([resolved, os.path.realpath(root)]) != os.path.realpath(root):
        raise ApiError(400, f"lora_path {path}: outside the server's --lora-dir", "lora_path")
    return resolved


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _body(request, LoadAdapter)
    path = _adapter_path(state, body.lora_path)
    base = state.served_model(body.base_model_name)
    if base.parent is not None:
        raise ApiError(400, f"'{body.base_model_name}' is an adapter: name the model it runs on", "base_model_name")
    if body.lora_name in state.adapters or state.config.served_model(body.lora_name) is not None:
        raise ApiError(400, f"'{body.lora_name}' names a served model or adapter already", "lora_name")
    try:
        await state.tts.adapters.load(body.lora_name, path, base.name)
    except RequestError as e:
        raise ApiError(400, str(e), e.param) from None
    state.adapters[body.lora_name] = adapter_model(body.lora_name, base)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _body(request, UnloadAdapter)
    if body.lora_name not in state.adapters:
        raise ApiError(404, f"no LoRA adapter named '{body.lora_name}' is loaded", "lora_name")
    try:
        await state.tts.adapters.unload(body.lora_name)
    except RequestError as e:
        raise ApiError(400, str(e), e.param) from None
    del state.adapters[body.lora_name]
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def lora_paths(error: Callable[[str], dict]) -> dict:
    """The routes' OpenAPI paths (`error(description)`: an error response of the document)."""
    def operation(operation_id: str, summary: str, body: type, answer: str, errors: dict[str, str]) -> dict:
        schema = msgspec.json.schema(body)
        return {"post": {"operationId": operation_id, "summary": summary,
                         "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                         "responses": {"200": {"description": answer, "content": {"text/plain": {
                             "schema": {"type": "string"}}}}} | {code: error(why) for code, why in errors.items()}}}
    return {
        "/v1/load_lora_adapter": operation(
            "loadLoraAdapter", "Load a LoRA adapter (PEFT layout, from under --lora-dir), served as model lora_name "
                               "(vLLM's route; base_model_name: the served model it runs on, the default if absent)",
            LoadAdapter, "loaded", {"400": "an adapter that cannot be loaded (the file is named), or a name taken",
                                    "404": "run-time loading is off (no --lora-dir), or no such base model"}),
        "/v1/unload_lora_adapter": operation(
            "unloadLoraAdapter", "Unload a LoRA adapter (vLLM's route)", UnloadAdapter, "unloaded",
            {"400": "requests still run with it", "404": "no adapter of that name is loaded"}),
    }


LORA_ROUTES = [
    web.post("/v1/load_lora_adapter", load_lora_adapter),
    web.post("/v1/unload_lora_adapter", unload_lora_adapter),
]
