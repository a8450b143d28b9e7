"""The models a server serves (`omni-tts serve --model A --model B`): each with its served names, its TTSClient (one
model's: AsyncTTS.for_model when there are several) and its voice rules (names.VoiceNames), and what it can do
(`capabilities`: named speakers, voice design, voice cloning), which /v1/models lists. A request's `model` picks one
(ServerState.served_model); without one, the first (the default)."""
from __future__ import annotations

from dataclasses import dataclass

from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
from omni_tts.orchestrator.model_client import ModelClient
from omni_tts.orchestrator.tts_client import TTSClient

from .names import VoiceNames
from .server_config import ServerConfig

MODEL_LOAD_HEADER = "x-omni-tts-model-load-seconds"   # the seconds a request waited for its model to load


@dataclass(frozen=True)
class ServedModel:
    names: tuple[str, ...]   # its served names; the first is its own (the engine's) and the one /v1/models roots at
    tts: TTSClient
    voice_names: VoiceNames
    parent: str | None = None   # a LoRA adapter's: the model it runs on (its voices and capabilities are that one's)

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def config(self) -> Qwen3TTSConfig:
        return self.tts.config

    @property
    def model_type(self) -> str:
        return self.config.tts_model_type

    @property
    def takes_instructions(self) -> bool:
        """Qwen3-TTS speaks with an instruct prompt on CustomVoice 1.7B and VoiceDesign; Base and 0.6B CustomVoice
        take none."""
        return self.model_type == "voice_design" or (self.model_type == "custom_voice"
                                                     and self.config.tts_model_size != "0b6")

    def capabilities(self) -> dict[str, object]:
        """What a request may ask of it: its named speakers, whether it designs a voice from a description
        (`instructions`), clones one from a clip, follows style instructions, and whether its talker runs now (an
        idle model's may be unloaded: its next request loads it)."""
        return {"speakers": sorted(self.config.talker.spk_id), "voice_design": self.model_type == "voice_design",
                "voice_clone": self.model_type == "base", "instructions": self.takes_instructions,
                "loaded": self.tts.is_loaded()}


def adapter_model(name: str, base: ServedModel) -> ServedModel:
    """A LoRA adapter of `base`, served as model `name` (AsyncTTS's adapters)."""
    return ServedModel((name,), ModelClient(base.tts.engine if isinstance(base.tts, ModelClient) else base.tts,
                                            base.name, lora=name), base.voice_names, parent=base.name)


def served_models(tts: TTSClient, config: ServerConfig) -> dict[str, ServedModel]:
    """Every model `config` names, by its own name, the default first. ValueError for a --default-voice the default
    model lacks."""
    models = config.served_models
    entries = {}
    for index, names in enumerate(models):
        client = tts if len(models) == 1 else ModelClient(tts, names[0])
        checkpoint = client.config
        voice_names = VoiceNames(checkpoint.tts_model_type, list(checkpoint.talker.spk_id),
                                 config.default_voice if index == 0 else None, config.aliases.voices)
        entries[names[0]] = ServedModel(names, client, voice_names)
    return entries


async def wait_for_model(model: ServedModel) -> dict[str, str]:
    """Returns once the model's talker runs (an idle one unloaded comes back): the response headers that say how long
    the request waited for its load, none when it did not."""
    waited = await model.tts.load_model()
    return {MODEL_LOAD_HEADER: f"{waited:.3f}"} if waited else {}
