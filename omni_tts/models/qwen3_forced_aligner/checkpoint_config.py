"""Typed view of a Qwen3-ForcedAligner checkpoint's `config.json` and `preprocessor_config.json`.

The released checkpoint is a Qwen3-ASR one (`model_type` "qwen3_asr") whose thinker is a forced aligner
(`thinker_config.model_type` "qwen3_forced_aligner"): an audio encoder, a Qwen3 decoder, and a head of
`classify_num` timestamp classes of `timestamp_segment_time` ms each instead of the vocabulary.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..qwen3_tts.checkpoint_config import ConfigError, DecoderLMConfig, _Reader, read_json

SAMPLE_RATE = 16000  # what the encoder hears: every clip is resampled to it first


@dataclass(frozen=True)
class AudioEncoderConfig:
    num_mel_bins: int
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    downsample_hidden_size: int
    output_dim: int
    max_source_positions: int
    n_window: int          # mel frames per convolution chunk: 2 * n_window
    n_window_infer: int    # mel frames per attention window: n_window_infer

    @classmethod
    def read(cls, r: _Reader) -> "AudioEncoderConfig":
        cfg = cls(**{name: r.get(name, int) for name in cls.__dataclass_fields__})
        if cfg.d_model % cfg.encoder_attention_heads:
            raise ConfigError(f"{r.path}: '{r._name('d_model')}' must be a multiple of "
                              f"'{r._name('encoder_attention_heads')}'")
        if cfg.n_window_infer % (2 * cfg.n_window):
            raise ConfigError(f"{r.path}: '{r._name('n_window_infer')}' must be a multiple of 2 * n_window")
        if r.get("activation_function", str, "gelu") != "gelu" or r.get("scale_embedding", bool, False):
            raise ConfigError(f"{r.path}: only the released encoder (gelu, no embedding scale) is supported")
        return cfg


@dataclass(frozen=True)
class AlignerConfig:
    audio: AudioEncoderConfig
    text: DecoderLMConfig
    classify_num: int
    timestamp_token_id: int
    timestamp_ms: float     # one timestamp class, in milliseconds
    audio_token_id: int
    audio_start_token_id: int
    audio_end_token_id: int

    @classmethod
    def load(cls, model_dir: str) -> "AlignerConfig":
        path = os.path.join(model_dir, "config.json")
        r = _Reader(read_json(path), path)
        thinker = r.child("thinker_config")
        if "forced_aligner" not in thinker.get("model_type", str, ""):
            raise ConfigError(f"{path}: not a forced aligner (thinker_config.model_type is "
                              f"{thinker.data.get('model_type')!r}, expected 'qwen3_forced_aligner')")
        text = DecoderLMConfig.read(thinker.child("text_config"))
        audio = AudioEncoderConfig.read(thinker.child("audio_config"))
        if audio.output_dim != text.hidden_size:
            raise ConfigError(f"{path}: audio_config.output_dim ({audio.output_dim}) must equal "
                              f"text_config.hidden_size ({text.hidden_size})")
        cfg = cls(audio=audio, text=text, classify_num=thinker.get("classify_num", int),
                  timestamp_token_id=r.get("timestamp_token_id", int),
                  timestamp_ms=r.get("timestamp_segment_time", float),
                  audio_token_id=thinker.get("audio_token_id", int),
                  audio_start_token_id=thinker.get("audio_start_token_id", int),
                  audio_end_token_id=thinker.get("audio_end_token_id", int))
        _check_preprocessor(model_dir, audio.num_mel_bins)
        return cfg


def _check_preprocessor(model_dir: str, num_mel_bins: int) -> None:
    """The features are Whisper's log-mel at 16 kHz; a checkpoint that asks for other ones is refused."""
    path = os.path.join(model_dir, "preprocessor_config.json")
    r = _Reader(read_json(path), path)
    expected = dict(feature_size=num_mel_bins, sampling_rate=SAMPLE_RATE, hop_length=160, n_fft=400)
    for key, value in expected.items():
        if r.get(key, int) != value:
            raise ConfigError(f"{path}: '{key}' must be {value}, got {r.get(key, int)}")
    if r.get("dither", float, 0.0) != 0.0:
        raise ConfigError(f"{path}: 'dither' must be 0 (alignment is deterministic)")
