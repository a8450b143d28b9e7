"""Typed views of a Qwen3-TTS-12Hz checkpoint's `config.json` and `speech_tokenizer/config.json`.

Unknown keys are tolerated (the released files carry many transformers defaults); a missing required key is a
`ConfigError` naming the key and the file. The reference's Python defaults are not the released values, so only
keys with a value that every released file agrees on have a default here.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

MODEL_TYPES = ("custom_voice", "voice_design", "base")
# the sizes random_model.py builds; here, torch-free, so the CLI can list them without importing torch
RANDOM_MODEL_PRESETS = ("tiny", "small", "medium", "0.6b", "1.7b")


class ConfigError(ValueError):
    """A checkpoint config is missing a key or holds a value of the wrong kind."""


class WeightsError(RuntimeError):
    """A checkpoint is missing, unreachable, or does not match the model it is loaded into (weights.py raises it;
    defined here, torch-free, so the CLI can catch it without importing torch)."""


class _Reader:
    """Reads typed values out of one JSON object, naming the file and the key path in every error."""

    def __init__(self, data: dict[str, Any], path: str, prefix: str = "") -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: {prefix or 'top level'} must be a JSON object")
        self.data, self.path, self.prefix = data, path, prefix

    def _name(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = dataclasses.MISSING) -> Any:
        if key not in self.data or self.data[key] is None:
            if default is dataclasses.MISSING:
                raise ConfigError(f"{self.path}: missing required key '{self._name(key)}'")
            return default
        value = self.data[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float)):
            raise ConfigError(f"{self.path}: key '{self._name(key)}' must be {_kind_name(kind)}, got {value!r}")
        return value

    def ints(self, key: str) -> list[int]:
        values = self.get(key, list)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ConfigError(f"{self.path}: key '{self._name(key)}' must be a list of integers")
        return values

    def child(self, key: str) -> "_Reader":
        return _Reader(self.get(key, dict), self.path, self._name(key))


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({int: "an integer", float: "a number", str: "a string", bool: "a boolean",
                        list: "a list", dict: "an object"}.get(k, k.__name__) for k in kinds)


@dataclass(frozen=True)
class DecoderLMConfig:
    """A Qwen3 decoder stack (talker or code predictor)."""
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int

    @classmethod
    def read(cls, r: _Reader) -> "DecoderLMConfig":
        heads = r.get("num_attention_heads", int)
        hidden = r.get("hidden_size", int)
        cfg = cls(hidden_size=hidden, intermediate_size=r.get("intermediate_size", int),
                  num_hidden_layers=r.get("num_hidden_layers", int), num_attention_heads=heads,
                  num_key_value_heads=r.get("num_key_value_heads", int),
                  head_dim=r.get("head_dim", int, hidden // heads), rms_norm_eps=r.get("rms_norm_eps", float),
                  rope_theta=r.get("rope_theta", float), max_position_embeddings=r.get("max_position_embeddings", int),
                  vocab_size=r.get("vocab_size", int))
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ConfigError(f"{r.path}: '{r._name('num_attention_heads')}' must be a multiple of "
                              f"'{r._name('num_key_value_heads')}'")
        return cfg


@dataclass(frozen=True)
class TalkerConfig(DecoderLMConfig):
    text_vocab_size: int = 151936
    text_hidden_size: int = 2048
    num_code_groups: int = 16
    code_predictor: DecoderLMConfig | None = None
    codec_pad_id: int = 2148
    codec_bos_id: int = 2149
    codec_eos_token_id: int = 2150
    codec_think_id: int = 2154
    codec_nothink_id: int = 2155
    codec_think_bos_id: int = 2156
    codec_think_eos_id: int = 2157
    codec_language_id: dict[str, int] = field(default_factory=dict)
    spk_id: dict[str, int] = field(default_factory=dict)
    spk_is_dialect: dict[str, str | bool] = field(default_factory=dict)

    @classmethod
    def read(cls, r: _Reader) -> "TalkerConfig":
        base = DecoderLMConfig.read(r)
        ids = {k: r.get(k, int) for k in ("codec_pad_id", "codec_bos_id", "codec_eos_token_id", "codec_think_id",
                                           "codec_nothink_id", "codec_think_bos_id", "codec_think_eos_id")}
        spk_id = {}
        for name, value in r.get("spk_id", dict, {}).items():
            # released files hold an int or a one-element list
            value = value[0] if isinstance(value, list) and len(value) == 1 else value
            if not isinstance(value, int):
                raise ConfigError(f"{r.path}: '{r._name('spk_id')}.{name}' must be an integer")
            spk_id[name.lower()] = value
        languages = {k.lower(): v for k, v in r.get("codec_language_id", dict, {}).items()}
        dialects = {k.lower(): (v.lower() if isinstance(v, str) else v)
                    for k, v in r.get("spk_is_dialect", dict, {}).items()}
        return cls(**dataclasses.asdict(base), text_vocab_size=r.get("text_vocab_size", int),
                   text_hidden_size=r.get("text_hidden_size", int), num_code_groups=r.get("num_code_groups", int),
                   code_predictor=DecoderLMConfig.read(r.child("code_predictor_config")),
                   codec_language_id=languages, spk_id=spk_id, spk_is_dialect=dialects, **ids)


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    mel_dim: int
    enc_dim: int
    enc_channels: list[int]
    enc_kernel_sizes: list[int]
    enc_dilations: list[int]
    enc_attention_channels: int
    enc_res2net_scale: int
    enc_se_channels: int
    sample_rate: int

    @classmethod
    def read(cls, r: _Reader) -> "SpeakerEncoderConfig":
        cfg = cls(mel_dim=r.get("mel_dim", int, 128), enc_dim=r.get("enc_dim", int),
                  enc_channels=r.ints("enc_channels"), enc_kernel_sizes=r.ints("enc_kernel_sizes"),
                  enc_dilations=r.ints("enc_dilations"), enc_attention_channels=r.get("enc_attention_channels", int),
                  enc_res2net_scale=r.get("enc_res2net_scale", int), enc_se_channels=r.get("enc_se_channels", int),
                  sample_rate=r.get("sample_rate", int, 24000))
        if not len(cfg.enc_channels) == len(cfg.enc_kernel_sizes) == len(cfg.enc_dilations):
            raise ConfigError(f"{r.path}: speaker_encoder_config enc_channels, enc_kernel_sizes and enc_dilations "
                              "must have the same length")
        return cfg


@dataclass(frozen=True)
class Qwen3TTSConfig:
    """Top-level `config.json`."""
    tts_model_type: str
    tts_model_size: str
    talker: TalkerConfig
    speaker_encoder: SpeakerEncoderConfig | None
    im_start_token_id: int
    im_end_token_id: int
    tts_pad_token_id: int
    tts_bos_token_id: int
    tts_eos_token_id: int
    assistant_token_id: int
    path: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str = "config.json") -> "Qwen3TTSConfig":
        r = _Reader(data, path)
        model_type = r.get("tts_model_type", str)
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"{path}: 'tts_model_type' must be one of {', '.join(MODEL_TYPES)}, got {model_type!r}")
        speaker = None
        if model_type == "base":
            speaker = SpeakerEncoderConfig.read(r.child("speaker_encoder_config"))
        ids = {k: r.get(k, int) for k in ("im_start_token_id", "im_end_token_id", "tts_pad_token_id",
                                           "tts_bos_token_id", "tts_eos_token_id")}
        return cls(tts_model_type=model_type, tts_model_size=r.get("tts_model_size", str, "1b7"),
                   talker=TalkerConfig.read(r.child("talker_config")), speaker_encoder=speaker,
                   assistant_token_id=r.get("assistant_token_id", int, 77091), path=path, **ids)

    @classmethod
    def load(cls, model_dir: str) -> "Qwen3TTSConfig":
        path = os.path.join(model_dir, "config.json")
        return cls.from_dict(read_json(path), path)


@dataclass(frozen=True)
class SpeechDecoderConfig:
    """`speech_tokenizer/config.json` → `decoder_config` (see the model doc §10 for the mapping)."""
    codebook_size: int
    codebook_dim: int
    latent_dim: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    sliding_window: int
    num_quantizers: int
    upsample_rates: list[int]
    upsampling_ratios: list[int]
    decoder_dim: int

    @classmethod
    def read(cls, r: _Reader) -> "SpeechDecoderConfig":
        heads = r.get("num_attention_heads", int)
        hidden = r.get("hidden_size", int)
        return cls(codebook_size=r.get("codebook_size", int), codebook_dim=r.get("codebook_dim", int),
                   latent_dim=r.get("latent_dim", int), hidden_size=hidden,
                   intermediate_size=r.get("intermediate_size", int),
                   num_hidden_layers=r.get("num_hidden_layers", int), num_attention_heads=heads,
                   num_key_value_heads=r.get("num_key_value_heads", int, heads),
                   head_dim=r.get("head_dim", int, hidden // heads), rms_norm_eps=r.get("rms_norm_eps", float),
                   rope_theta=r.get("rope_theta", float), sliding_window=r.get("sliding_window", int),
                   num_quantizers=r.get("num_quantizers", int), upsample_rates=r.ints("upsample_rates"),
                   upsampling_ratios=r.ints("upsampling_ratios"), decoder_dim=r.get("decoder_dim", int))

    @property
    def samples_per_frame(self) -> int:
        n = 1
        for rate in self.upsampling_ratios + self.upsample_rates:
            n *= rate
        return n


@dataclass(frozen=True)
class SpeechTokenizerConfig:
    decoder: SpeechDecoderConfig
    encoder: dict[str, Any]  # transformers MimiConfig kwargs
    encoder_valid_num_quantizers: int
    input_sample_rate: int
    output_sample_rate: int
    path: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str = "speech_tokenizer/config.json") -> "SpeechTokenizerConfig":
        r = _Reader(data, path)
        model_type = r.get("model_type", str)
        if model_type != "qwen3_tts_tokenizer_12hz":
            raise ConfigError(f"{path}: 'model_type' must be 'qwen3_tts_tokenizer_12hz', got {model_type!r}")
        return cls(decoder=SpeechDecoderConfig.read(r.child("decoder_config")),
                   encoder=dict(r.get("encoder_config", dict)),
                   encoder_valid_num_quantizers=r.get("encoder_valid_num_quantizers", int, 16),
                   input_sample_rate=r.get("input_sample_rate", int, 24000),
                   output_sample_rate=r.get("output_sample_rate", int, 24000), path=path)

    @classmethod
    def load(cls, model_dir: str) -> "SpeechTokenizerConfig":
        path = os.path.join(model_dir, "speech_tokenizer", "config.json")
        return cls.from_dict(read_json(path), path)


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def read_generation_config(model_dir: str) -> dict[str, Any]:
    """The checkpoint's generation_config.json (sampling defaults), {} when it has none."""
    path = os.path.join(model_dir, "generation_config.json")
    return read_json(path) if os.path.isfile(path) else {}
