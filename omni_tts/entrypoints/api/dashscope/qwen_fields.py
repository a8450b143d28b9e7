"""What DashScope's Qwen-TTS clients send, read as our options: the realtime session's fields (`session.update`), the
HTTP call's `input` and `parameters`, the language names they use, and the characters they are billed by.

Fields that mean nothing to Qwen3-TTS (volume, pitch_rate, bit_rate, enable_tn, optimize_instructions) are accepted
and named as ignored; our sampling fields (temperature, top_k, seed, max_new_tokens, ...) are accepted beside them
as extensions (the SDK passes extra keyword arguments through), so a client may ask for greedy audio.
"""
from __future__ import annotations

import unicodedata
from typing import Annotated, Any, Literal

import msgspec

from omni_tts.entrypoints.api.schema import ApiError, Name, SampleRate, SpeechOptions, Text
from omni_tts.models.qwen3_tts.sampling_params import SamplingParams

from ..state import ServerState

# accepted and named as ignored: post-processing Qwen3-TTS does not do, or a switch it has no use for
IGNORED_FIELDS = ("volume", "pitch_rate", "bit_rate", "enable_tn", "optimize_instructions")
SpeechRate = Annotated[float, msgspec.Meta(ge=0.5, le=2.0)]   # DashScope's range (ours is wider)


class QwenSession(SamplingParams, kw_only=True):
    """`session.update`'s `session`, each update the whole config (the SDK always sends it whole)."""
    voice: Name | None = None
    mode: Literal["server_commit", "commit"] = "server_commit"
    response_format: Literal["pcm", "wav", "mp3", "opus"] = "pcm"
    sample_rate: SampleRate = 24000
    language_type: Name | None = None
    instructions: Text | None = None
    speech_rate: SpeechRate | None = None
    volume: Any = None
    pitch_rate: Any = None
    bit_rate: Any = None
    enable_tn: Any = None
    optimize_instructions: Any = None


class GenerationInput(msgspec.Struct, kw_only=True):
    """The HTTP call's `input` (the SDK puts text, voice and language_type here; instructions may come either
    here or in `parameters`)."""
    text: Text   # one request's text, as a realtime response's
    voice: Name | None = None
    language_type: Name | None = None
    instructions: Text | None = None
    optimize_instructions: Any = None


class GenerationRequest(msgspec.Struct, kw_only=True):
    model: Name | None = None
    input: GenerationInput
    parameters: msgspec.Raw = msgspec.Raw(b"{}")


class GenerationParameters(SamplingParams, kw_only=True):
    """The HTTP call's `parameters` (every other keyword argument of `MultiModalConversation.call`)."""
    instructions: Text | None = None
    language_type: Name | None = None
    speech_rate: SpeechRate | None = None
    stream: bool | None = None
    incremental_output: bool | None = None
    volume: Any = None
    pitch_rate: Any = None
    bit_rate: Any = None
    enable_tn: Any = None
    optimize_instructions: Any = None


def given_ignored(fields: msgspec.Struct) -> list[str]:
    """The fields of IGNORED_FIELDS the client gave."""
    return [name for name in IGNORED_FIELDS if getattr(fields, name, None) is not None]


def language_of(state: ServerState, language_type: str | None) -> str | None:
    """A DashScope language name (`Auto`, `English`, `Chinese`, ...) → ours (the same names, lower-case; None for
    Auto), or ApiError 400 naming `language_type` for one the checkpoint does not have."""
    if language_type is None or language_type.strip().lower() == "auto":
        return None
    language = language_type.strip().lower()
    languages = state.default_model.tts.prompts.languages
    if language not in languages:
        raise ApiError(400, f"unsupported language_type '{language_type}'; supported: "
                            f"{', '.join(name.capitalize() for name in languages)}", "language_type")
    return language


def speech_options(state: ServerState, session: QwenSession, model: str | None) -> SpeechOptions:
    """The realtime session's SpeechOptions (`model`: the URL's, an alias of the served one, names.py): every response
    of it streams, so speech_rate is never applied."""
    return SpeechOptions(model=model, voice=session.voice, response_format=session.response_format,
                         sample_rate=session.sample_rate, language=language_of(state, session.language_type),
                         instructions=session.instructions,
                         **msgspec.structs.asdict(SamplingParams.of(session)))


def billed_characters(text: str) -> int:
    """DashScope's `usage.characters`: a wide (CJK) character counts twice."""
    return sum(2 if unicodedata.east_asian_width(char) in "WF" else 1 for char in text)
