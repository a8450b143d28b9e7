"""ElevenLabs' request fields that mean something here, read as our SpeechOptions read them: `output_format`
(codec_samplerate[_bitrate]) → response_format and sample_rate, `language_code` (ISO 639-1) → the model's language
name; and the fields accepted with no meaning for Qwen3-TTS, named as ignored."""
from __future__ import annotations

import re

from omni_tts.audio.encoding import sample_rates
from omni_tts.entrypoints.api.schema import ApiError

# ElevenLabs' codecs → our response formats (its mp3/opus bit rate is ours: the encoder's fixed one)
CODECS = {"mp3": "mp3", "opus": "opus", "pcm": "pcm", "wav": "wav", "ulaw": "ulaw", "alaw": "alaw"}
OUTPUT_FORMAT = re.compile(r"([a-z][a-z0-9]*)_(\d+)(?:_(\d+))?")
# the languages Qwen3-TTS speaks, by ElevenLabs' ISO 639-1 codes
LANGUAGES = {"zh": "chinese", "en": "english", "ja": "japanese", "ko": "korean", "de": "german", "fr": "french",
             "ru": "russian", "pt": "portuguese", "es": "spanish", "it": "italian"}
# voice_settings: none changes Qwen3-TTS' voice; `speed` is ours only for a whole (non-streamed) response
VOICE_SETTINGS = ("stability", "similarity_boost", "style", "use_speaker_boost", "speed")


def speech_format(output_format: str) -> tuple[str, int]:
    """`pcm_24000` → ("pcm", 24000); ApiError 400 naming output_format for a codec or rate we cannot answer."""
    match = OUTPUT_FORMAT.fullmatch(output_format)
    fmt = CODECS.get(match.group(1)) if match else None
    if fmt is None:
        raise ApiError(400, f"output_format {output_format!r} is not codec_samplerate[_bitrate] with codec one of "
                            f"{', '.join(CODECS)}", "output_format")
    rate, rates = int(match.group(2)), sample_rates(fmt)
    if rate not in rates:
        raise ApiError(400, f"output_format {output_format!r}: {match.group(1)} is served at "
                            f"{', '.join(map(str, rates))} Hz", "output_format")
    return fmt, rate


def language_name(language_code: str | None) -> str | None:
    """The model's name for an ISO 639-1 code (None: the model decides); ApiError 400 for a language it lacks."""
    if language_code is None:
        return None
    name = LANGUAGES.get(language_code.strip().lower().split("-")[0])
    if name is None:
        raise ApiError(400, f"language_code {language_code!r} is not one Qwen3-TTS speaks; use one of "
                            f"{', '.join(LANGUAGES)}", "language_code")
    return name
