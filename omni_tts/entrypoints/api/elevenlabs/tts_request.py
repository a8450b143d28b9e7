"""ElevenLabs' text-to-speech request (path voice_id, query output_format, JSON body) read into our SpeechRequest:
each field given its meaning here, or named as ignored (`x-omni-tts-ignored-fields`)."""
from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from multidict import MultiMapping

from omni_tts.audio.encoding import bit_rate
from omni_tts.entrypoints.api.schema import (ApiError, Name, SpeechRequest, decode_json, decode_speech_options,
                                             describe_fields)

DEFAULT_OUTPUT_FORMAT = "mp3_44100_128"
CODECS = {"mp3": "mp3", "pcm": "pcm", "wav": "wav", "ulaw": "ulaw", "alaw": "alaw", "opus": "opus"}
_OUTPUT_FORMAT = re.compile(r"([a-z][a-z0-9]*?)_(\d+)(?:_(\d+))?")
# ElevenLabs' language_code (ISO 639-1) → our language names
LANGUAGES = {"zh": "chinese", "en": "english", "fr": "french", "de": "german", "it": "italian", "ja": "japanese",
             "ko": "korean", "pt": "portuguese", "ru": "russian", "es": "spanish"}
# request fields whose errors name ours → ElevenLabs' name for them
PARAMS = {"input": "text", "voice": "voice_id", "model": "model_id", "language": "language_code",
          "speed": "voice_settings.speed", "response_format": "output_format", "sample_rate": "output_format"}


class VoiceSettings(msgspec.Struct, kw_only=True):
    speed: Annotated[float, msgspec.Meta(gt=0)] | None = None
    stability: Any = None
    similarity_boost: Any = None
    style: Any = None
    use_speaker_boost: Any = None


class TextToSpeechBody(msgspec.Struct, kw_only=True):
    """`Body_Text_to_speech_*` of ElevenLabs' API; what has no meaning for Qwen3-TTS is read and named ignored."""
    text: str
    model_id: Name | None = None
    language_code: Name | None = None
    voice_settings: VoiceSettings | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=4294967295)] | None = None
    previous_text: Any = None
    next_text: Any = None
    previous_request_ids: Any = None
    next_request_ids: Any = None
    use_pvc_as_ivc: Any = None
    apply_text_normalization: Any = None
    apply_language_text_normalization: Any = None
    audio_effects: Any = None


# our own fields a body may add (sampling, instructions, a clone's reference, ...): those the route does not set;
# ElevenLabs' pronunciation_dictionary_locators is one of ours, of the same shape (api/pronunciation/)
ROUTE_FIELDS = {"input", "voice", "model", "language", "seed", "speed", "response_format", "sample_rate",
                "stream_format", "stream", "word_timestamps"}
EXTENSIONS = tuple(name for name in SpeechRequest.__struct_fields__ if name not in ROUTE_FIELDS)


def query_value(query: MultiMapping[str], name: str) -> str | None:
    """A query parameter given at most once, or ApiError."""
    values = query.getall(name, [])
    if len(values) > 1:
        raise ApiError(400, f"query parameter '{name}' is given more than once", name)
    return values[0] if values else None


def output_format(value: str | None) -> tuple[str, int, list[str]]:
    """ElevenLabs' `codec_samplerate[_bitrate]` → (our response_format, sample rate, what is not honoured): the
    codec and rate are, a bit rate other than our encoder's is named. ApiError for a format we do not have."""
    value = value or DEFAULT_OUTPUT_FORMAT
    match = _OUTPUT_FORMAT.fullmatch(value)
    if match is None or match.group(1) not in CODECS:
        raise ApiError(400, f"unknown output_format '{value}'; expected codec_samplerate[_bitrate] with codec one of "
                            f"{', '.join(CODECS)} (e.g. {DEFAULT_OUTPUT_FORMAT}, pcm_24000, ulaw_8000)",
                       "output_format")
    fmt, rate = CODECS[match.group(1)], int(match.group(2))
    ignored = []
    if match.group(3) is not None:
        ours = bit_rate(fmt)
        if ours is None or int(match.group(3)) * 1000 != ours:
            ignored.append(f"output_format bitrate {match.group(3)} kbps" +
                           (f" ({fmt} is encoded at {ours // 1000} kbps)" if ours else ""))
    return fmt, rate, ignored


def speech_request(raw: bytes, voice_id: str, output: str | None, streaming: bool,
                   strict: bool) -> tuple[SpeechRequest, list[str]]:
    """The body (and path, query) → (our SpeechRequest, the fields ignored), or ApiError naming the
    field. `voice_settings.speed` is our speed where the response is whole; in a stream a speed ≠ 1 is ignored."""
    fields = decode_json(raw, dict[str, msgspec.Raw])
    ours = {name: fields.pop(name) for name in EXTENSIONS if name in fields}
    unknown = [name for name in fields if name not in TextToSpeechBody.__struct_fields__]
    if unknown and strict:
        name = describe_fields(unknown[:1])
        raise ApiError(400, f"unknown field '{name}' (the server runs with --strict-fields)", name)
    body = decode_json(msgspec.json.encode(fields), TextToSpeechBody)
    fmt, rate, ignored = output_format(output)
    ignored += [name for name in TextToSpeechBody.__struct_fields__
                if name not in ("text", "model_id", "language_code", "voice_settings", "seed")
                and name in fields and bytes(fields[name]) != b"null"]
    settings = body.voice_settings or VoiceSettings()
    ignored += [f"voice_settings.{name}" for name in VoiceSettings.__struct_fields__
                if name != "speed" and getattr(settings, name) is not None]
    speed = settings.speed if settings.speed is not None else 1.0
    if streaming and speed != 1.0:
        ignored.append("voice_settings.speed (a streamed response keeps the model's pace)")
        speed = 1.0
    if not body.text.strip():
        raise ApiError(400, "text must not be empty", "text")
    language = LANGUAGES.get(body.language_code.lower(), body.language_code) if body.language_code else None
    translated = {"input": body.text, "voice": voice_id, "model": body.model_id, "language": language,
                  "seed": body.seed, "speed": speed, "response_format": fmt, "sample_rate": rate,
                  "stream_format": "audio" if streaming else None}
    encoded = msgspec.json.encode({k: v for k, v in translated.items() if v is not None})
    extra = b"".join(b"," + msgspec.json.encode(name) + b":" + bytes(value) for name, value in ours.items())
    try:
        speech, _ = decode_speech_options(encoded[:-1] + extra + b"}", SpeechRequest, strict)
    except ApiError as e:
        raise renamed(e) from None
    return speech, ignored + unknown


def renamed(error: ApiError) -> ApiError:
    """An error about one of our fields, naming ElevenLabs' field that carried it."""
    if error.param in PARAMS:
        error.param = PARAMS[error.param]
    return error
