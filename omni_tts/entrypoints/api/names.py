"""Names clients send that are not ours, and the one place a speech request's voice is decided.

Models: a request's `model` must be one of the served names (`--served-model-name`, several allowed, the first is
the primary) or, unless `--no-openai-aliases`, one of OpenAI's TTS model names, which OpenAI clients send.

Voices (`VoiceNames.choose`):
- Any model: a name with a control character (newline, NUL, ESC, ...) is a 400, whatever the model does with it: a
  name may be echoed in a response header, and a header cannot hold one.
- CustomVoice: a checkpoint speaker (any case), else an OpenAI voice name mapped by `openai_voice_map`; no voice →
  `--default-voice`, else the checkpoint's first speaker (vllm-omni has a default speaker too).
- VoiceDesign: the voice comes from `instructions`; a `voice` (the `openai` SDK always sends one) is ignored and
  named in the `x-omni-tts-voice-ignored` response header.
- Base: `voice` names an uploaded voice. Beside `ref_audio` or `speaker_embedding` (a voice given whole), a name that
  is not an uploaded voice is ignored the same way and the given voice is used (vllm-omni's voice-clone client
  always sends a `voice`); an uploaded voice's name beside one is a 400 (which of the two was meant is unclear).
"""
from __future__ import annotations

import os
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from omni_tts.entrypoints.api.schema import ApiError

OPENAI_TTS_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-12-15")
# OpenAI's built-in TTS voices, in the order of its API reference (the order the fallback rule counts in)
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse",
                 "marin", "cedar")
# the released CustomVoice speaker nearest each OpenAI voice in gender and register; the dialect speakers (dylan,
# eric) are left out, because they turn Chinese or auto-language text into their dialect
PREFERRED_SPEAKERS = {"alloy": "vivian", "ash": "ryan", "ballad": "aiden", "coral": "serena", "echo": "aiden",
                      "fable": "ryan", "onyx": "uncle_fu", "nova": "vivian", "sage": "serena", "shimmer": "sohee",
                      "verse": "ryan", "marin": "ono_anna", "cedar": "uncle_fu"}
VOICE_IGNORED_HEADER = "x-omni-tts-voice-ignored"


def accepted_model_names(served: Sequence[str], openai_aliases: bool) -> tuple[str, ...]:
    """Every name a request's `model` may hold, primary first: the served names, then OpenAI's if enabled."""
    names = list(dict.fromkeys(served))
    if openai_aliases:
        names += [name for name in OPENAI_TTS_MODELS if name not in names]
    return tuple(names)


def default_served_model_name(model: str | None, model_dir: str) -> str:
    """The checkpoint folder's name: of the directory given, or the name part of a Hugging Face repo id (the
    download's own folder is named by a commit hash)."""
    if model is not None and not os.path.isdir(model):
        return model.rstrip("/").rsplit("/", 1)[-1]
    return os.path.basename(os.path.abspath(model_dir))


def openai_voice_map(speakers: Sequence[str]) -> dict[str, str]:
    """OpenAI voice → checkpoint speaker (names lower-case): a speaker of the same name; else the voice's
    `PREFERRED_SPEAKERS` entry when the checkpoint has it; else the i-th OpenAI voice → the (i mod n)-th speaker in
    sorted order. Empty for a checkpoint without speakers."""
    ordered = sorted(speakers)
    mapping = {}
    for i, voice in enumerate(OPENAI_VOICES):
        if voice in ordered:
            mapping[voice] = voice
        elif PREFERRED_SPEAKERS[voice] in ordered:
            mapping[voice] = PREFERRED_SPEAKERS[voice]
        elif ordered:
            mapping[voice] = ordered[i % len(ordered)]
    return mapping


@dataclass(frozen=True)
class VoiceChoice:
    """What a request's voice means on this checkpoint."""
    speaker: str | None = None     # CustomVoice: the checkpoint speaker
    uploaded: str | None = None    # Base: the uploaded voice to clone
    ignored: str | None = None     # a voice this checkpoint cannot use, named in VOICE_IGNORED_HEADER


class VoiceNames:
    """The voice rules of one checkpoint (`model_type`: custom_voice | voice_design | base)."""

    def __init__(self, model_type: str, speakers: Sequence[str], default_voice: str | None = None) -> None:
        """speakers: the checkpoint's, in its order (the first is the default voice)."""
        self.model_type = model_type
        self.speakers = sorted(speakers)
        self.openai = openai_voice_map(self.speakers) if model_type == "custom_voice" else {}
        self.default = speakers[0].lower() if model_type == "custom_voice" and speakers else None
        if default_voice is not None:
            if model_type != "custom_voice":
                raise ValueError(f"--default-voice needs a CustomVoice checkpoint; this one is {model_type}")
            self.default = self._speaker(default_voice)
            if self.default is None:
                raise ValueError(f"--default-voice {default_voice!r} is not a voice of this checkpoint; "
                                 f"{self._available()}")

    def _speaker(self, voice: str) -> str | None:
        key = voice.lower()
        return key if key in self.speakers else self.openai.get(key)

    def _available(self) -> str:
        return f"available: {', '.join(self.speakers)}, or an OpenAI voice ({', '.join(OPENAI_VOICES)})"

    def choose(self, voice: str | None, reference: str | None, is_uploaded: Callable[[str], bool]) -> VoiceChoice:
        """The request's voice (`voice`: stripped, None when absent; `reference`: the field that gives a Base voice
        whole, ref_audio or speaker_embedding, if one does), or ApiError 400 naming the field."""
        if voice is not None and any(unicodedata.category(c) == "Cc" for c in voice):
            raise ApiError(400, "voice must not contain control characters", "voice")
        if self.model_type == "custom_voice":
            if voice is None:
                if self.default is None:  # a CustomVoice checkpoint without speakers
                    raise ApiError(400, f"voice is required; {self._available()}", "voice")
                return VoiceChoice(speaker=self.default)
            speaker = self._speaker(voice)
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
