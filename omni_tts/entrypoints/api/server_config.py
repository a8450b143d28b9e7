"""What the API server is told at start-up: its settings (`omni-tts serve`'s options, defaults in
config/settings.py) and what the server made of its other options."""
from __future__ import annotations

from dataclasses import dataclass, field

from omni_tts.audio.url_fetch import UrlPolicy
from omni_tts.config.settings import ApiSettings
from omni_tts.orchestrator.aligner_client import AlignerClient
from omni_tts.entrypoints.api.aliases import AliasFile
from omni_tts.entrypoints.api.names import accepted_model_names, served_model
from omni_tts.entrypoints.api.pronunciation.dictionaries import ServerLexicons
from omni_tts.voices.manifest import VoiceManifest


@dataclass(kw_only=True)
class ServerConfig(ApiSettings):
    served_model_names: tuple[str, ...]        # the default model's names clients send; the first is the primary
    more_models: tuple[tuple[str, ...], ...] = ()   # each further model's served names (a server of several)
    lora_dir: str | None = None                # POST /v1/load_lora_adapter loads adapters from under it; None: off
    voices_manifest: VoiceManifest | None = None   # --voices-manifest's voices, loaded and checked
    ref_audio_urls: UrlPolicy | None = None    # where http(s) ref_audio may lead; None: URLs are refused
    api_key: str | None = None                 # when set, every route but openapi.OPEN_PATHS needs the key
    aligner: AlignerClient | None = None       # the forced aligner (word_timestamps), started with the app; None:
                                               # the field is refused
    # --pronunciation-dictionary's rules and --voice-pronunciation-dictionary's, read at start-up
    pronunciation: ServerLexicons = field(default_factory=ServerLexicons)
    aliases: AliasFile = field(default_factory=AliasFile)   # --aliases' voices and models, over the default table
    random_weights: bool = False               # the embedded tiny model (no --model): /v1/models says it speaks noise

    @property
    def served_models(self) -> tuple[tuple[str, ...], ...]:
        """Every model's served names, the default model's first."""
        return (self.served_model_names, *self.more_models)

    @property
    def all_served_names(self) -> tuple[str, ...]:
        return tuple(name for names in self.served_models for name in names)

    @property
    def model_names(self) -> tuple[str, ...]:
        """What /v1/models lists: the served names, then OpenAI's TTS names (unless --no-openai-aliases)."""
        return accepted_model_names(self.all_served_names, self.openai_aliases)

    def served_model(self, model: str) -> str | None:
        """The served name a request's `model` stands for (names.served_model), None for none."""
        return served_model(model, self.all_served_names, self.openai_aliases, self.aliases.models)

    def model_of(self, served_name: str) -> str:
        """The own name (the first served name) of the model that `served_name` names."""
        return next(names[0] for names in self.served_models if served_name in names)
