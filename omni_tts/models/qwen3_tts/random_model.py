"""Deterministic random-weight checkpoints in the full Hugging Face layout (`omni-tts make-tiny-model`).

Presets: `tiny` (the test fixtures' sizes; the embedded default model), `small` (big enough that compute matters on
a CPU), `medium` (a slightly wider talker than small and a vocoder that costs more CPU per second of audio than the
talker at serving concurrency), `0.6b` / `1.7b` (the released shapes, for GPU benchmarks). Weights are a function of
(seed, tensor name, shape) only, scaled so activations stay O(1) and greedy choices have clear margins; the codec
EOS row is boosted so that utterances end. The reference implementation (qwen-tts) loads the result too.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import zlib
from typing import Any, Callable, Iterator

import torch
from safetensors.torch import save_file
from torch import nn

from .checkpoint_config import MODEL_TYPES as VARIANTS
from .checkpoint_config import RANDOM_MODEL_PRESETS as PRESETS
from .checkpoint_config import Qwen3TTSConfig, SpeechTokenizerConfig
from .lora import target_linears, write_adapter
from .text_tokenizer import write_text_tokenizer_files

TOP_IDS = dict(im_start_token_id=151644, im_end_token_id=151645, tts_pad_token_id=151671, tts_bos_token_id=151672,
               tts_eos_token_id=151673, assistant_token_id=77091)
CODEC_IDS = dict(codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150, codec_think_id=2154,
                 codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157)
LANGUAGES = {"english": 2050, "german": 2053, "spanish": 2054, "chinese": 2055, "japanese": 2058, "french": 2061,
             "korean": 2064, "russian": 2069, "italian": 2070, "portuguese": 2071}
DIALECTS = {"beijing_dialect": 2074, "sichuan_dialect": 2062}
SPEAKERS = {"vivian": 3065, "serena": 3066, "uncle_fu": 3010, "dylan": 2878, "eric": 2875, "ryan": 3061,
            "aiden": 2861, "ono_anna": 2873, "sohee": 2864}
SPEAKER_DIALECT = {name: False for name in SPEAKERS} | {"dylan": "beijing_dialect", "eric": "sichuan_dialect"}
GENERATION_DEFAULTS = dict(do_sample=True, repetition_penalty=1.05, temperature=0.9, top_p=1.0, top_k=50,
                           subtalker_dosample=True, subtalker_temperature=0.9, subtalker_top_p=1.0, subtalker_top_k=50,
                           max_new_tokens=8192)

# talker: hidden, intermediate, layers, heads, kv heads, head_dim, text_hidden; code predictor: hidden, inter, layers,
# heads, kv heads, head_dim; speaker encoder channels; size tag
_TALKER = {
    "tiny": dict(talker=(64, 128, 2, 4, 2, 32, 8), cp=(32, 64, 2, 4, 2, 16), spk=(32, 96, 16, 16), size="1b7"),
    "small": dict(talker=(256, 768, 4, 4, 2, 64, 256), cp=(128, 384, 2, 4, 2, 32), spk=(64, 192, 32, 32), size="1b7"),
    # medium: a wider talker than small, same code predictor (on a CPU its 15 passes per step dominate the cost)
    "medium": dict(talker=(384, 1152, 4, 6, 2, 64, 256), cp=(128, 384, 2, 4, 2, 32), spk=(64, 192, 32, 32),
                   size="1b7"),
    "0.6b": dict(talker=(1024, 3072, 28, 16, 8, 128, 2048), cp=(1024, 3072, 5, 16, 8, 128), spk=(512, 1536, 128, 128),
                 size="0b6"),
    "1.7b": dict(talker=(2048, 6144, 28, 16, 8, 128, 2048), cp=(1024, 3072, 5, 16, 8, 128), spk=(512, 1536, 128, 128),
                 size="1b7"),
}
_REAL_DECODER = dict(codebook_dim=512, latent_dim=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=16, head_dim=64, sliding_window=72, decoder_dim=1536)
_REAL_ENCODER = dict(hidden_size=512, num_filters=64, codebook_dim=256, num_quantizers=32, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=8, head_dim=64, intermediate_size=2048,
                     vector_quantization_hidden_dimension=256)
_SMALL_ENCODER = dict(hidden_size=64, num_filters=8, codebook_dim=32, num_quantizers=16, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=16, intermediate_size=128,
                      vector_quantization_hidden_dimension=32)
_DECODER = {
    "tiny": dict(codebook_dim=16, latent_dim=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, head_dim=8, sliding_window=8, decoder_dim=64),
    "small": dict(codebook_dim=128, latent_dim=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=32, sliding_window=72, decoder_dim=256),
    # vocoder cost grows with decoder_dim² (convolutions) and decoder_dim (activations). At 448 one request's
    # decoding costs more CPU per frame than the talker's share of a 16-row step (docs/benchmarks.md, "The `medium`
    # preset"): at serving concurrency the decoder, not the talker, is the bottleneck
    "medium": dict(codebook_dim=128, latent_dim=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, head_dim=32, sliding_window=72, decoder_dim=448),
    "0.6b": _REAL_DECODER, "1.7b": _REAL_DECODER,
}
_ENCODER = {
    "tiny": dict(hidden_size=32, num_filters=4, codebook_dim=8, num_quantizers=16, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=2, head_dim=16, intermediate_size=64,
                 vector_quantization_hidden_dimension=8),
    # medium shares small's: the encoder only reads Base cloning's reference audio, outside the serving loop
    "small": _SMALL_ENCODER, "medium": _SMALL_ENCODER,
    "0.6b": _REAL_ENCODER, "1.7b": _REAL_ENCODER,
}

# weight-scale knobs: std of the logits heads, extra gain on the EOS row, ECAPA output gain, vocoder gains
CODEC_HEAD_GAIN, EOS_ROW_GAIN, SPK_FC_GAIN = 3.0, 1.6, 0.1
LORA_GAIN = 0.5   # a random adapter's B A relative to the weight it adds to: changes greedy codes, keeps margins
DECODER_GAIN, DECODER_OUT_GAIN, MIMI_CODEBOOK_STD = 0.65, 0.7, 0.2


def tts_config_dict(variant: str, preset: str) -> dict[str, Any]:
    p = _TALKER[preset]
    hidden, inter, layers, heads, kv, head_dim, text_hidden = p["talker"]
    cp_hidden, cp_inter, cp_layers, cp_heads, cp_kv, cp_head_dim = p["cp"]
    channels, mfa, attention, se = p["spk"]
    half = head_dim // 2  # rotary frequencies split over the three (identical) MRoPE axes, as released
    section = [half * 3 // 8, (half - half * 3 // 8) // 2]
    section.append(half - sum(section))
    code_predictor = dict(model_type="qwen3_tts_talker_code_predictor", vocab_size=2048, hidden_size=cp_hidden,
                          intermediate_size=cp_inter, num_hidden_layers=cp_layers, num_attention_heads=cp_heads,
                          num_key_value_heads=cp_kv, head_dim=cp_head_dim, hidden_act="silu",
                          max_position_embeddings=65536, rms_norm_eps=1e-6, rope_theta=1000000, num_code_groups=16)
    languages = LANGUAGES | (DIALECTS if variant == "custom_voice" else {})
    talker = dict(model_type="qwen3_tts_talker", code_predictor_config=code_predictor, vocab_size=3072,
                  hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, head_dim=head_dim, hidden_act="silu", max_position_embeddings=32768,
                  rms_norm_eps=1e-6, rope_theta=1000000,
                  rope_scaling={"rope_type": "default", "type": "default", "mrope_section": section, "interleaved": True},
                  num_code_groups=16, text_hidden_size=text_hidden, text_vocab_size=151936,
                  codec_language_id=languages, spk_id=SPEAKERS if variant == "custom_voice" else {},
                  spk_is_dialect=SPEAKER_DIALECT if variant == "custom_voice" else {}, **CODEC_IDS)
    speaker_encoder = dict(mel_dim=128, enc_dim=hidden, enc_channels=[channels] * 4 + [mfa],
                           enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1],
                           enc_attention_channels=attention, enc_res2net_scale=8, enc_se_channels=se,
                           sample_rate=24000)
    return dict(architectures=["Qwen3TTSForConditionalGeneration"], model_type="qwen3_tts", talker_config=talker,
                speaker_encoder_config=speaker_encoder, tokenizer_type="qwen3_tts_tokenizer_12hz",
                tts_model_size=p["size"], tts_model_type=variant, transformers_version="4.57.1", **TOP_IDS)


def speech_tokenizer_config_dict(preset: str) -> dict[str, Any]:
    encoder = dict(model_type="mimi", sampling_rate=24000, frame_rate=12.5, audio_channels=1, num_residual_layers=1,
                   upsampling_ratios=[8, 6, 5, 4], kernel_size=7, last_kernel_size=3, residual_kernel_size=3,
                   dilation_growth_rate=2, use_causal_conv=True, compress=2, codebook_size=2048,
                   num_semantic_quantizers=1, upsample_groups=32, sliding_window=250, hidden_act="gelu",
                   layer_scale_initial_scale=0.01, max_position_embeddings=8000, norm_eps=1e-5, pad_mode="constant",
                   rope_theta=10000.0, trim_right_ratio=1.0, use_conv_shortcut=False, **_ENCODER[preset])
    decoder = dict(codebook_size=2048, max_position_embeddings=8000, rope_theta=10000, layer_scale_initial_scale=0.01,
                   rms_norm_eps=1e-5, num_quantizers=16, num_semantic_quantizers=1, upsample_rates=[8, 5, 4, 3],
                   upsampling_ratios=[2, 2], attention_bias=False, hidden_act="silu", **_DECODER[preset])
    return dict(architectures=["Qwen3TTSTokenizerV2Model"], model_type="qwen3_tts_tokenizer_12hz",
                encoder_config=encoder, decoder_config=decoder, encoder_valid_num_quantizers=16,
                input_sample_rate=24000, output_sample_rate=24000, decode_upsample_rate=1920,
                encode_downsample_rate=1920, transformers_version="4.57.3")


def _noise(seed: int, name: str, shape: torch.Size, uniform: bool = False) -> torch.Tensor:
    """Depends only on (seed, name, shape): independent of construction order and the global RNG."""
    key = ("u:" + name) if uniform else name
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode("utf-8"))) % (2 ** 62))
    return (torch.rand if uniform else torch.randn)(tuple(shape), generator=g, dtype=torch.float32)


def _fan_in(module: nn.Module, weight: torch.Tensor) -> float:
    if isinstance(module, nn.ConvTranspose1d):
        return module.in_channels * module.kernel_size[0] / module.stride[0] / module.groups
    if isinstance(module, nn.Conv1d):
        return module.in_channels // module.groups * module.kernel_size[0]
    if isinstance(module, nn.Linear):
        return module.in_features
    return weight[0].numel()


@torch.no_grad()
def randomize_tts(model: nn.Module, seed: int, eos_id: int) -> None:
    """Embeddings N(0,1); Linear N(0, 1/fan_in), logits heads ×CODEC_HEAD_GAIN; norm weights 1+0.1N; biases 0.1N;
    speaker-encoder convs He-normal."""
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():
        mod = modules[name.rpartition(".")[0]]
        noise = _noise(seed, name, p.shape)
        if isinstance(mod, nn.Embedding):
            p.copy_(noise)
        elif name.endswith(".bias"):
            p.copy_((0.02 if name.startswith("speaker_encoder.") else 0.1) * noise)
        elif p.dim() == 1:
            p.copy_(1.0 + 0.1 * noise)
        elif name.startswith("speaker_encoder."):
            gain = SPK_FC_GAIN if name == "speaker_encoder.fc.weight" else math.sqrt(2.0)
            p.copy_(gain * noise / math.sqrt(_fan_in(mod, p)))
        else:
            is_head = name == "talker.codec_head.weight" or name.startswith("talker.code_predictor.lm_head.")
            p.copy_((CODEC_HEAD_GAIN if is_head else 1.0) * noise / math.sqrt(_fan_in(mod, p)))
    model.talker.codec_head.weight[eos_id] *= EOS_ROW_GAIN


@torch.no_grad()
def randomize_speech_tokenizer(model: nn.Module, seed: int) -> None:
    """Default inits leave RVQ codebooks at zero and the vocoder output near 1e-8; give every piece O(1) signal."""
    modules = dict(model.named_modules())
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for name in sorted(tensors):
        t = tensors[name]
        mod_name, _, leaf = name.rpartition(".")
        noise = _noise(seed, name, t.shape)
        if not t.is_floating_point():
            continue
        if leaf == "cluster_usage":
            t.copy_(0.5 + _noise(seed, name, t.shape, uniform=True))
        elif leaf in ("embedding_sum", "embed_sum"):
            usage_name = mod_name + ".cluster_usage"
            usage = 0.5 + _noise(seed, usage_name, tensors[usage_name].shape, uniform=True)
            t.copy_((1.0 if leaf == "embedding_sum" else MIMI_CODEBOOK_STD) * noise * usage[:, None])
        elif leaf in ("scale", "gamma"):
            t.copy_(0.1 + 0.05 * noise)
        elif leaf in ("alpha", "beta"):
            t.copy_(0.1 * noise)
        elif leaf == "bias":
            t.copy_(0.02 * noise)
        elif t.dim() == 1:
            t.copy_(1.0 + 0.1 * noise)
        else:
            gain = DECODER_GAIN if name.startswith("decoder.") else 1.0
            if name.startswith("decoder.decoder.6."):
                gain *= DECODER_OUT_GAIN
            t.copy_(gain * noise / math.sqrt(_fan_in(modules[mod_name], t)))


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def _save(module: nn.Module, path: str, dtype: torch.dtype) -> None:
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in module.state_dict().items()}
    save_file(tensors, path, metadata={"format": "pt"})


def make_random_model(out_dir: str, variant: str = "custom_voice", preset: str = "tiny", seed: int = 0,
                      dtype: torch.dtype = torch.bfloat16) -> str:
    """Write the checkpoint to out_dir (atomically: built in a temporary sibling, then renamed).

    `dtype` applies to model.safetensors (the released files are bf16); the speech tokenizer is stored in fp32."""
    from .model import Qwen3TTSWeights, SpeechTokenizerWeights  # model imports every component

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    with atomic_directory(out_dir) as tmp:
        cfg_dict = tts_config_dict(variant, preset)
        st_dict = speech_tokenizer_config_dict(preset)
        config = Qwen3TTSConfig.from_dict(cfg_dict)
        st_config = SpeechTokenizerConfig.from_dict(st_dict)
        _write_json(os.path.join(tmp, "config.json"), cfg_dict)
        _write_json(os.path.join(tmp, "generation_config.json"), GENERATION_DEFAULTS)
        write_text_tokenizer_files(tmp)
        weights = Qwen3TTSWeights(config)
        randomize_tts(weights, seed, config.talker.codec_eos_token_id)
        _save(weights, os.path.join(tmp, "model.safetensors"), dtype)
        del weights
        st_dir = os.path.join(tmp, "speech_tokenizer")
        os.makedirs(st_dir)
        _write_json(os.path.join(st_dir, "config.json"), st_dict)
        _write_json(os.path.join(st_dir, "preprocessor_config.json"), dict(
            chunk_length_s=None, feature_extractor_type="EncodecFeatureExtractor", feature_size=1, overlap=None,
            padding_side="right", padding_value=0.0, return_attention_mask=True, sampling_rate=24000))
        speech = SpeechTokenizerWeights(st_config, with_encoder=True)
        randomize_speech_tokenizer(speech, seed + 1)
        _save(speech, os.path.join(st_dir, "model.safetensors"), torch.float32)
    return out_dir


def make_random_adapter(out_dir: str, base_dir: str, seed: int = 0, rank: int = 4) -> str:
    """A PEFT LoRA adapter (lora.py) for the checkpoint at base_dir, on every target linear of both decoder stacks,
    in fp32: A N(0, 1/in), B N(0, LORA_GAIN²/r), lora_alpha = r (scale 1), so B A is about LORA_GAIN times the
    size of the weight it adds to. A function of (seed, module, shapes) only."""
    config = Qwen3TTSConfig.load(base_dir)
    weights = {module: (_noise(seed, f"{module}.lora_A", torch.Size((rank, fan_in))) / math.sqrt(fan_in),
                        LORA_GAIN * _noise(seed, f"{module}.lora_B", torch.Size((fan_out, rank))) / math.sqrt(rank))
               for module, (fan_in, fan_out) in target_linears(config.talker).items()}
    with atomic_directory(out_dir) as tmp:
        write_adapter(tmp, weights, rank, float(rank), os.path.abspath(base_dir))
    return out_dir


@contextlib.contextmanager
def atomic_directory(out_dir: str) -> Iterator[str]:
    """A checkpoint written whole or not at all: built in a temporary sibling (yielded), then renamed to out_dir."""
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not empty")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-omni-tts-", dir=parent)
    try:
        yield tmp
        _apply_umask(tmp)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _apply_umask(root: str) -> None:
    """mkdtemp and safetensors create owner-only entries; give the checkpoint ordinary permissions."""
    umask = os.umask(0)
    os.umask(umask)
    for dirpath, _, files in os.walk(root):
        os.chmod(dirpath, 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o666 & ~umask)


def default_model_dir() -> str:
    """The embedded tiny CustomVoice model, generated into the user cache on first use."""
    return generated_once("tiny-custom-voice-v1", os.path.join("speech_tokenizer", "model.safetensors"),
                          lambda path: make_random_model(path, "custom_voice", "tiny", seed=20260122))


def generated_once(name: str, last_file: str, make: Callable[[str], object]) -> str:
    """The user cache's `name` directory, made by `make(path)` unless its `last_file` is there already; processes
    that race each make it, the first rename wins."""
    root = os.environ.get("OMNI_TTS_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "omni_tts"))
    path = os.path.join(root, name)
    if not os.path.isfile(os.path.join(path, last_file)):
        try:
            make(path)
        except OSError:  # another process finished it first (the rename is atomic)
            if not os.path.isfile(os.path.join(path, last_file)):
                raise
    return path
