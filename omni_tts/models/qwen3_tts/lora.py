"""Talker LoRA adapters in the PEFT layout: read and checked against a base model, merged, written.

A PEFT adapter of this model is a directory with `adapter_config.json` and `adapter_model.safetensors`, whose keys
are the module paths of the whole checkpoint under `base_model.model.`:

    base_model.model.talker.model.layers.0.self_attn.q_proj.lora_A.weight                [r, in]
    base_model.model.talker.code_predictor.model.layers.1.mlp.down_proj.lora_B.weight    [out, r]

The targets taken are the Qwen3 layers' linears of both decoder stacks, the talker's and the code predictor's
(`self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`): PEFT matches `target_modules` by name suffix, so an
adapter trained with `["q_proj", "v_proj"]` holds both stacks'. Anything else (embeddings, the codec heads, the text
projection, DoRA, biases, `modules_to_save`, per-module ranks) is refused, naming the file. The weights file's keys
decide what is targeted (`target_modules` is PEFT's instruction for making them). The scale (lora_alpha / r, or /
sqrt(r) with rsLoRA) is folded into B once, here.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .checkpoint_config import DecoderLMConfig, TalkerConfig

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
STACKS = ("talker.model", "talker.code_predictor.model")   # the decoder stacks whose layers take adapters
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?P<module>(?P<stack>.+)\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<name>\w+))"
                  r"\.lora_(?P<side>[AB])\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be used with this model; str() names the file and the problem."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path


@dataclass(frozen=True)
class LoRAAdapter:
    """A checked adapter: per target module path (`talker.model.layers.0.self_attn.q_proj`) its A [r, in] and its
    scaled B [out, r] (fp32, CPU). x W^T becomes x W^T + (x A^T) B^T."""
    path: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _linears(cfg: DecoderLMConfig) -> dict[str, tuple[int, int]]:
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
            "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
            "mlp.down_proj": (inter, h)}


def target_linears(config: TalkerConfig) -> dict[str, tuple[int, int]]:
    """Every linear an adapter may target: module path → (in_features, out_features)."""
    out = {}
    for stack, cfg in zip(STACKS, (config, config.code_predictor)):
        for i in range(cfg.num_hidden_layers):
            out.update({f"{stack}.layers.{i}.{name}": shape for name, shape in _linears(cfg).items()})
    return out


def read_adapter(directory: str, config: TalkerConfig, max_rank: int | None = None) -> LoRAAdapter:
    """Read a PEFT adapter directory and check it against the talker's config (and a served talker's
    max_lora_rank; None: any rank, offline); LoRAError names the file."""
    config_path, weights_path = os.path.join(directory, CONFIG_FILE), os.path.join(directory, WEIGHTS_FILE)
    if not os.path.isdir(directory):
        raise LoRAError(directory, "no such adapter directory")
    rank, scale = _read_config(config_path, max_rank)
    if not os.path.isfile(weights_path):
        bin_only = os.path.isfile(os.path.join(directory, "adapter_model.bin"))
        raise LoRAError(weights_path, "missing" + (" (adapter_model.bin is not read: it needs pickle; save the "
                                                   "adapter with safe_serialization)" if bin_only else ""))
    try:
        with safe_open(weights_path, framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as e:  # a truncated or foreign file: safetensors raises several types
        raise LoRAError(weights_path, f"not a readable safetensors file: {e}") from None
    return LoRAAdapter(directory, rank, _check_weights(weights_path, tensors, config, rank, scale))


def _read_config(path: str, max_rank: int | None) -> tuple[int, float]:
    """(r, scale) from adapter_config.json, refusing the PEFT features this runtime does not compute."""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoRAError(path, "missing") from None
    except (OSError, ValueError) as e:
        raise LoRAError(path, f"not readable JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(path, "must be a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(path, f"peft_type must be LORA, got {cfg['peft_type']!r}")
    unsupported = {"use_dora": cfg.get("use_dora"), "bias": cfg.get("bias", "none") != "none",
                   "lora_bias": cfg.get("lora_bias"),
                   "modules_to_save": cfg.get("modules_to_save"), "fan_in_fan_out": cfg.get("fan_in_fan_out"),
                   "rank_pattern": cfg.get("rank_pattern"), "alpha_pattern": cfg.get("alpha_pattern")}
    for key, used in unsupported.items():
        if used:
            raise LoRAError(path, f"{key} {cfg[key]!r} is not supported (plain LoRA on the layers' linears only)")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(path, f"r must be a positive integer, got {rank!r}")
    if max_rank is not None and rank > max_rank:
        raise LoRAError(path, f"rank {rank} exceeds the configured max_lora_rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAError(path, f"lora_alpha must be a number, got {alpha!r}")
    return rank, alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)


def _check_weights(path: str, tensors: dict[str, torch.Tensor], config: TalkerConfig, rank: int,
                   scale: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    targets = target_linears(config)
    sides: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key.removeprefix(PEFT_PREFIX))
        if not key.startswith(PEFT_PREFIX) or m is None or m["stack"] not in STACKS:
            raise LoRAError(path, f"tensor {key}: not a LoRA weight of a supported target module (the talker's and "
                                  f"code predictor's {', '.join(TARGET_MODULES)})")
        if f"{m['block']}.{m['name']}" not in _linears(config):
            raise LoRAError(path, f"tensor {key}: unsupported target module {m['name']!r}")
        if m["module"] not in targets:
            raise LoRAError(path, f"tensor {key}: layer {m['layer']} does not exist in this model (an adapter for "
                                  "another base model?)")
        sides.setdefault(m["module"], {})[m["side"]] = tensor
    if not sides:
        raise LoRAError(path, "holds no LoRA weights")
    weights = {}
    for module, pair in sorted(sides.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAError(path, f"{module}: lora_{'B' if 'A' in pair else 'A'} missing")
        fan_in, fan_out = targets[module]
        a, b = pair["A"], pair["B"]
        for side, tensor, shape in (("A", a, (rank, fan_in)), ("B", b, (fan_out, rank))):
            if tuple(tensor.shape) != shape:
                raise LoRAError(path, f"{module}.lora_{side}.weight has shape {tuple(tensor.shape)}, this model and "
                                      f"r={rank} imply {shape} (an adapter for another base model?)")
            if not tensor.is_floating_point():
                raise LoRAError(path, f"{module}.lora_{side}.weight has dtype {tensor.dtype}, not a float type")
            if not torch.isfinite(tensor).all():
                raise LoRAError(path, f"{module}.lora_{side}.weight holds non-finite values")
        weights[module] = (a.float().contiguous(), (b.float() * scale).contiguous())
    return weights


@torch.no_grad()
def merge_into(state_dict: dict[str, torch.Tensor], adapter: LoRAAdapter) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with the adapter folded into its weights, W + B A in fp32 (the other tensors as
    they are): the model the LoRA rows compute, up to float rounding."""
    merged = dict(state_dict)
    for module, (a, b) in adapter.weights.items():
        key = f"{module}.weight"
        merged[key] = state_dict[key].float() + b @ a
    return merged


def write_adapter(directory: str, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int, alpha: float,
                  base_model: str) -> None:
    """A PEFT adapter directory from unscaled (A, B) per module path; into an existing (empty) directory."""
    config = dict(peft_type="LORA", r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", use_dora=False,
                  use_rslora=False, fan_in_fan_out=False, modules_to_save=None, base_model_name_or_path=base_model,
                  target_modules=sorted({m.rpartition(".")[2] for m in weights}), task_type=None)
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    tensors = {}
    for module, (a, b) in weights.items():
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.contiguous()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.contiguous()
    save_file(tensors, os.path.join(directory, WEIGHTS_FILE), metadata={"format": "pt"})
