"""Names clients send that are not ours (the alias table: aliases.py), and the one place a speech request's voice
(`VoiceNames.choose`) and model (`served_model`) are decided.

Voices (`VoiceNames.choose`):
- Any model: a name with a control character (newline, NUL, ESC, ...) is a 400, whatever the model does with it: a
  name may be echoed in a response header, and a header cannot hold one.
- CustomVoice: a checkpoint speaker (any case), else an alias of the table (aliases.py: OpenAI's, ElevenLabs' and
  DashScope's voices, then `--aliases FILE`'s, which override them); no voice → `--default-voice`, else the
  checkpoint's first speaker (vllm-omni has a default speaker too).
- VoiceDesign: the voice comes from `instructions`; a `voice` (the `openai` SDK always sends one) is ignored and
  named in the `x-omni-tts-voice-ignored` response header.
- Base: `voice` names an uploaded voice. Beside `ref_audio` or `speaker_embedding` (a voice given whole), a name that
  is not an uploaded voice is ignored the same way and the given voice is used (vllm-omni's voice-clone client
  always sends a `voice`); an uploaded voice's name beside one is a 400 (which of the two was meant is unclear). A
  name that is no uploaded voice but an `--aliases` voice alias names the uploaded voice it stands for.
- Unknown: the API's own 400 (its shape: errors.py) listing the speakers (or, Base, how to upload one).

Models (`served_model`): a served name (`--served-model-name`, several allowed, the first is the primary); else an
`--aliases` model alias; else, unless `--no-openai-aliases`, one of OpenAI's TTS model names; else a vendor model name
of the default table (aliases.DEFAULT_MODEL_ALIASES): each means the primary served model unless the file says
otherwise. Anything else is 404.
"""
from __future__ import annotations

import os
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from omni_tts.entrypoints.api.aliases import DEFAULT_MODEL_ALIASES, matching_alias, voice_alias_map
from omni_tts.entrypoints.api.schema import ApiError

OPENAI_TTS_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-12-15")
VOICE_IGNORED_HEADER = "x-omni-tts-voice-ignored"


def accepted_model_names(served: Sequence[str], openai_aliases: bool) -> tuple[str, ...]:
    """Every name a request's `model` may hold, primary first: the served names, then OpenAI's if enabled."""
    names = list(dict.fromkeys(served))
    if openai_aliases:
        names += [name for name in OPENAI_TTS_MODELS if name not in names]
    return tuple(names)


def served_model(model: str, served: Sequence[str], openai_aliases: bool,
                 aliases: Mapping[str, str]) -> str | None:
    """The served model name a request's `model` stands for, or None when it stands for none (the module's rule)."""
    if model in served:
        return model
    alias = matching_alias(model, aliases)
    if alias is not None:
        return aliases[alias]
    if (openai_aliases and model in OPENAI_TTS_MODELS) or matching_alias(model, DEFAULT_MODEL_ALIASES) is not None:
        return served[0]
    return None


def default_served_model_name(model: str | None, model_dir: str) -> str:
    """The checkpoint folder's name: of the directory given, or the name part of a Hugging Face repo id (the
    download's own folder is named by a commit hash)."""
    if model is not None and not os.path.isdir(model):
        return model.rstrip("/").rsplit("/", 1)[-1]
    return os.path.basename(os.path.abspath(model_dir))


@dataclass(frozen=True)
class VoiceChoice:
    """What a request's voice means on this checkpoint."""
    speaker: str | None = None     # CustomVoice: the checkpoint speaker
    uploaded: str | None = None    # Base: the uploaded voice to clone
    ignored: str | None = None     # a voice this checkpoint cannot use, named in VOICE_IGNORED_HEADER


class VoiceNames:
    """The voice rules of one checkpoint (`model_type`: custom_voice | voice_design | base)."""

    def __init__(self, model_type: str, speakers: Sequence[str], default_voice: str | None = None,
                 aliases: Mapping[str, str] | None = None) -> None:
        """speakers: the checkpoint's, in its order (the first is the default voice); aliases: `--aliases`' voices
        (checked by aliases.load_aliases), over the default table."""
        self.model_type = model_type
        self.speakers = sorted(speakers)
        self.aliases = voice_alias_map(self.speakers) if model_type == "custom_voice" else {}
        self.aliases |= {alias.lower(): voice.lower() if model_type == "custom_voice" else voice
                         for alias, voice in (aliases or {}).items()}
        self.default = speakers[0].lower() if model_type == "custom_voice" and speakers else None
        if default_voice is not None:
            if model_type != "custom_voice":
                raise ValueError(f"--default-voice needs a CustomVoice checkpoint; this one is {model_type}")
            self.default = self.speaker(default_voice)
            if self.default is None:
                raise ValueError(f"--default-voice {default_voice!r} is not a voice of this checkpoint; "
                                 f"{self._available()}")

    def alias(self, voice: str | None) -> str | None:
        """The voice an alias stands for (a speaker; Base: an uploaded voice's name), None if `voice` is none."""
        return self.aliases.get(voice.lower()) if voice is not None else None

    def speaker(self, voice: str) -> str | None:
        key = voice.lower()
        return key if key in self.speakers else self.aliases.get(key)

    def _available(self) -> str:
        return (f"available: {', '.join(self.speakers)}, or an alias (OpenAI's, ElevenLabs' and DashScope's voice "
                "names; GET /v1/audio/voices lists them in voice_aliases)")

    def choose(self, voice: str | None, reference: str | None, is_uploaded: Callable[[str], bool]) -> VoiceChoice:
        """The request's voice (`voice`: stripped, None when absent; `reference`: the field that gives a Base voice
        whole, ref_audio or speaker_embedding, if one does), or ApiError 400 naming the field. `is_uploaded` answers
        for `voice` and for `alias(voice)`."""
        if voice is not None and any(unicodedata.category(c) == "Cc" for c in voice):
            raise ApiError(400, "voice must not contain control characters", "voice")
        if self.model_type == "custom_voice":
            if voice is None:
                if self.default is None:  # a CustomVoice checkpoint without speakers
                    raise ApiError(400, f"voice is required; {self._available()}", "voice")
                return VoiceChoice(speaker=self.default)
            speaker = self.speaker(voice)
            if speaker is None:
                raise ApiError(400, f"unknown voice '{voice}'; {self._available()}", "voice")
            return VoiceChoice(speaker=speaker)
        if self.model_type == "voice_design":
            return VoiceChoice(ignored=voice)
        if voice is None:
            if reference is None:
                raise ApiError(400, "Base (voice clone) models need ref_audio, a speaker_embedding or the name of an "
                                    "uploaded voice", "ref_audio")
            return VoiceChoice()
        uploaded = is_uploaded(voice)
        if not uploaded and self.alias(voice) is not None and is_uploaded(self.alias(voice)):
            voice, uploaded = self.alias(voice), True
        if reference is not None and not uploaded:
            return VoiceChoice(ignored=voice)
        if reference is not None:
            raise ApiError(400, f"'{voice}' is an uploaded voice and {reference} is given too: give one of them",
                           "voice")
        if not uploaded:
            raise unknown_uploaded_voice(voice)
        return VoiceChoice(uploaded=voice)


def unknown_uploaded_voice(voice: str) -> ApiError:
    return ApiError(400, f"unknown voice '{voice}': upload it with POST /v1/audio/voices or give ref_audio", "voice")
