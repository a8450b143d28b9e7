"""The LoRA adapters an engine serves, each on one model's talker: loaded at start-up (in the talker's launch) or at
run time (`load`, `unload`: the talker reads the files beside its loop and answers), named apart from the models. The
supervisor keeps each talker's adapters, so a talker that restarts or loads again after an idle unload has them."""
from __future__ import annotations

from omni_tts.models.qwen3_tts.prompt import RequestError
from omni_tts.stages.messages import LoadLoRA, UnloadLoRA

from .model_layout import PipelineLayout
from .model_loads import ModelLoads
from .stage_client import StageClient


class LoRAAdapters:
    def __init__(self, client: StageClient, loads: ModelLoads, layout: PipelineLayout) -> None:
        self.client, self.loads, self.layout = client, loads, layout
        self.model_of: dict[str, str] = {}   # adapter name → the model it runs on

    def add_at_start(self, name: str, path: str, model: str) -> None:
        """An adapter its model's talker loads when it starts (before the engine starts)."""
        self._check_name(name)
        self.model_of[name] = model
        self.client.supervisor.loras.setdefault(self.layout.talker_of[model], {})[name] = path

    async def load(self, name: str, path: str, model: str, timeout: float = 120.0) -> None:
        """Load an adapter on `model`'s talker (loading the talker if it was unloaded); RequestError for a name
        taken or an adapter the talker refuses (its files: `lora_path`)."""
        self._check_name(name)
        talker = self.layout.talker_of[model]
        with self.loads.hold(talker):
            await self.loads.ready(talker)
            await self.client.change_lora(talker, LoadLoRA(name, path), timeout)
        self.model_of[name] = model
        self.client.supervisor.loras.setdefault(talker, {})[name] = path

    async def unload(self, name: str, timeout: float = 60.0) -> None:
        """Free an adapter; RequestError for one not loaded, or one that requests still run with."""
        if name not in self.model_of:
            raise RequestError("lora_name", f"no adapter named '{name}' is loaded")
        talker = self.layout.talker_of[self.model_of[name]]
        if self.loads.is_loaded(talker):   # an unloaded talker holds no adapter: forgetting it is enough
            with self.loads.hold(talker):
                await self.client.change_lora(talker, UnloadLoRA(name), timeout)
        del self.model_of[name]
        del self.client.supervisor.loras[talker][name]

    def check(self, lora: str | None, model: str) -> None:
        """RequestError('model') unless `lora` is None or an adapter of `model`."""
        if lora is not None and self.model_of.get(lora) != model:
            raise RequestError("model", f"no adapter named '{lora}' is loaded on model '{model}'")

    def _check_name(self, name: str) -> None:
        if name in self.model_of or name in self.layout.talker_of:
            raise RequestError("lora_name", f"'{name}' names a served model or adapter already")
