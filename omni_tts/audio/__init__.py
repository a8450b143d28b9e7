"""Audio output helpers: response-format encoding (whole files and streams) and pitch-preserving speed change."""

from omni_tts.audio.encoding import (
    FORMATS,
    LOSSLESS_FORMATS,
    StreamEncoder,
    content_type,
    create_stream_encoder,
    encode_audio,
    encoded_sample_rate,
    normalize_format,
    streamable_formats,
    to_int16,
    wav_header,
)
from omni_tts.audio.speed import MAX_SPEED, MIN_SPEED, change_speed, check_speed

__all__ = [
    "FORMATS",
    "LOSSLESS_FORMATS",
    "MAX_SPEED",
    "MIN_SPEED",
    "StreamEncoder",
    "change_speed",
    "check_speed",
    "content_type",
    "create_stream_encoder",
    "encode_audio",
    "encoded_sample_rate",
    "normalize_format",
    "streamable_formats",
    "to_int16",
    "wav_header",
]
