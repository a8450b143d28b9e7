"""Deterministic random-weight Qwen3-ForcedAligner checkpoints in the released layout
(`omni-tts make-tiny-model --variant forced_aligner`).

Presets: `tiny` (the test fixtures; the embedded default aligner) and `0.6b` (the released shapes, for cost
measurements). Weights depend on (seed, tensor name, shape) only, scaled so activations stay O(1) and the head's
choices have clear margins. The reference (qwen-asr) loads the result too.
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import nn

from ..qwen3_tts.random_model import _noise, _save, _write_json, atomic_directory, generated_once
from ..qwen3_tts.text_tokenizer import write_text_tokenizer_files
from .checkpoint_config import AlignerConfig

PRESETS = ("tiny", "0.6b")
TIMESTAMP_TOKEN_ID, AUDIO_START_ID, AUDIO_END_ID, AUDIO_PAD_ID = 151705, 151669, 151670, 151676
HEAD_GAIN, EMBED_GAIN, CLASS_DECAY = 3.0, 0.1, 200.0
LANGUAGES = ["Chinese", "English", "Cantonese", "French", "German", "Italian", "Japanese", "Korean", "Portuguese",
             "Russian", "Spanish"]
# Qwen3's added tokens, then the audio ones; ids the aligner never reads carry placeholder names
_NAMED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
          "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
          "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
          "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
          "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>"]
SPECIAL_TOKENS = {name: 151643 + i for i, name in enumerate(_NAMED)} | {
    f"<|reserved_{i}|>": i for i in range(151643 + len(_NAMED), TIMESTAMP_TOKEN_ID - 1) if i != AUDIO_PAD_ID} | {
    "<|audio_pad|>": AUDIO_PAD_ID, "<asr_text>": TIMESTAMP_TOKEN_ID - 1, "<timestamp>": TIMESTAMP_TOKEN_ID}
SPECIAL_TOKENS = dict(sorted(SPECIAL_TOKENS.items(), key=lambda kv: kv[1]))

# audio: d_model, layers, heads, ffn, downsample channels; text: hidden, inter, layers, heads, kv heads, head_dim
_SIZES = {
    "tiny": dict(audio=(32, 2, 4, 64, 8), text=(8, 32, 2, 2, 1, 4)),
    "0.6b": dict(audio=(1024, 24, 16, 4096, 480), text=(1024, 3072, 28, 16, 8, 128)),
}


def aligner_config_dict(preset: str) -> dict[str, Any]:
    d_model, enc_layers, enc_heads, ffn, down = _SIZES[preset]["audio"]
    hidden, inter, layers, heads, kv, head_dim = _SIZES[preset]["text"]
    audio = dict(model_type="qwen3_asr_audio_encoder", num_mel_bins=128, d_model=d_model, encoder_layers=enc_layers,
                 encoder_attention_heads=enc_heads, encoder_ffn_dim=ffn, downsample_hidden_size=down,
                 output_dim=hidden, max_source_positions=1500, n_window=50, n_window_infer=800,
                 conv_chunksize=500, activation_function="gelu", scale_embedding=False, dropout=0.0,
                 attention_dropout=0.0, activation_dropout=0.0)
    half = head_dim // 2
    section = [half * 3 // 8, (half - half * 3 // 8) // 2]
    section.append(half - sum(section))
    text = dict(model_type="qwen3_asr_text", vocab_size=152064, hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                hidden_act="silu", max_position_embeddings=65536, rms_norm_eps=1e-6, rope_theta=1000000,
                rope_scaling={"rope_type": "default", "mrope_section": section, "interleaved": True,
                              "mrope_interleaved": True},
                attention_bias=False, attention_dropout=0.0, tie_word_embeddings=False)
    thinker = dict(model_type="qwen3_forced_aligner", audio_config=audio, text_config=text, classify_num=5000,
                   audio_token_id=AUDIO_PAD_ID, audio_start_token_id=AUDIO_START_ID,
                   audio_end_token_id=AUDIO_END_ID, user_token_id=872, initializer_range=0.02)
    return dict(architectures=["Qwen3ASRForConditionalGeneration"], model_type="qwen3_asr", thinker_config=thinker,
                support_languages=LANGUAGES, timestamp_token_id=TIMESTAMP_TOKEN_ID, timestamp_segment_time=80,
                torch_dtype="bfloat16", transformers_version="4.57.1")


PREPROCESSOR = dict(chunk_length=30, dither=0.0, feature_extractor_type="WhisperFeatureExtractor", feature_size=128,
                    hop_length=160, n_fft=400, n_samples=480000, nb_max_frames=3000, padding_side="right",
                    padding_value=0.0, processor_class="Qwen3ASRProcessor", return_attention_mask=True,
                    sampling_rate=16000)


@torch.no_grad()
def randomize_aligner(model: nn.Module, seed: int) -> None:
    """Embeddings N(0, EMBED_GAIN²) (small, so that a timestamp token's class depends on its context); Linear and
    conv N(0, gain²/fan_in), the head ×HEAD_GAIN; norm weights 1+0.1N; biases 0.1N."""
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():
        mod = modules[name.rpartition(".")[0]]
        noise = _noise(seed, name, p.shape)
        if isinstance(mod, nn.Embedding):
            p.copy_(EMBED_GAIN * noise)
        elif name.endswith(".bias"):
            p.copy_(0.1 * noise)
        elif p.dim() == 1:
            p.copy_(1.0 + 0.1 * noise)
        else:
            gain = HEAD_GAIN if name == "lm_head.weight" else (math.sqrt(2.0) if isinstance(mod, nn.Conv2d) else 1.0)
            p.copy_(gain * noise / math.sqrt(p[0].numel()))
    # early classes weigh more, so that the times mostly fall within a few seconds of audio, as a real aligner's
    model.lm_head.weight.mul_(1.0 / (1.0 + torch.arange(model.lm_head.weight.shape[0]) / CLASS_DECAY)[:, None])


def make_random_aligner(out_dir: str, preset: str = "tiny", seed: int = 0,
                        dtype: torch.dtype = torch.bfloat16) -> str:
    """Write the checkpoint to out_dir (atomically: built in a temporary sibling, then renamed)."""
    from .model import ForcedAlignerModel

    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)} for the forced aligner, got {preset!r}")
    with atomic_directory(out_dir) as tmp:
        _write_json(os.path.join(tmp, "config.json"), aligner_config_dict(preset))
        _write_json(os.path.join(tmp, "preprocessor_config.json"), PREPROCESSOR)
        write_text_tokenizer_files(tmp, SPECIAL_TOKENS, dict(
            processor_class="Qwen3ASRProcessor", extra_special_tokens={
                "audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>",
                "audio_eos_token": "<|audio_end|>"}))
        model = ForcedAlignerModel(AlignerConfig.load(tmp))
        randomize_aligner(model, seed)
        weights = nn.Module()
        weights.thinker = model
        _save(weights, os.path.join(tmp, "model.safetensors"), dtype)
    return out_dir


def default_aligner_dir() -> str:
    """The embedded tiny aligner (the test fixture's weights), generated into the user cache on first use."""
    return generated_once("tiny-forced-aligner-v1", "model.safetensors",
                          lambda path: make_random_aligner(path, "tiny", seed=20260122))
