"""Checkpoint resolution and strict safetensors loading (single file or sharded with an index)."""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from torch import nn

from .checkpoint_config import WeightsError


def resolve_model_dir(model: str) -> str:
    """A local directory as is; otherwise a Hugging Face repo id, downloaded (or taken from the local cache).

    Offline (no network, or HF_HUB_OFFLINE=1) an uncached repo id fails at once with a clear message."""
    if os.path.isdir(model):
        return model
    if os.path.exists(model) or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise WeightsError(f"model {model!r} is neither a local checkpoint directory nor a Hugging Face repo id "
                           "(owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(model, etag_timeout=10)
    except LocalEntryNotFoundError:  # its text is several lines about huggingface_hub's own settings
        raise WeightsError(f"model {model!r} is not a local directory and could not be downloaded from the Hugging "
                           "Face Hub (offline, or not in the local cache)") from None
    except (HfHubHTTPError, OSError, ValueError) as e:  # the first line says what happened; more lines say how
        raise WeightsError(f"model {model!r}: could not be fetched from the Hugging Face Hub: "
                           f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None


def safetensors_files(directory: str, name: str = "model.safetensors") -> list[str]:
    """The checkpoint's files: `name`, or the shards listed by `name.index.json`."""
    single = os.path.join(directory, name)
    if os.path.isfile(single):
        return [single]
    index = single + ".index.json"
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(directory, s))]
        if missing:
            raise WeightsError(f"{index}: shard files missing: {', '.join(missing)}")
        return [os.path.join(directory, s) for s in shards]
    raise WeightsError(f"{directory}: neither {name} nor {name}.index.json found")


def read_tensors(files: list[str], prefix: str) -> dict[str, torch.Tensor]:
    """All tensors whose key starts with `prefix`, with the prefix stripped."""
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    tensors[key[len(prefix):]] = f.get_tensor(key)
    return tensors


def load_strict(module: nn.Module, tensors: dict[str, torch.Tensor], where: str, device: torch.device | str,
                dtype: torch.dtype) -> nn.Module:
    """Load every parameter/buffer of `module` (built on the meta device or not) from `tensors`.

    Missing or unexpected tensors and shape mismatches are an error naming them. Floating tensors are cast to
    `dtype`; integer buffers keep theirs."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {', '.join(missing[:20])}{' …' if len(missing) > 20 else ''}")
        if unexpected:
            parts.append(f"unexpected tensors: {', '.join(unexpected[:20])}{' …' if len(unexpected) > 20 else ''}")
        raise WeightsError(f"{where}: {'; '.join(parts)}")
    converted = {}
    for name, target in expected.items():
        value = tensors[name]
        if tuple(value.shape) != tuple(target.shape):
            raise WeightsError(f"{where}: tensor {name} has shape {tuple(value.shape)}, the config implies "
                               f"{tuple(target.shape)}")
        converted[name] = value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
    module.load_state_dict(converted, strict=True, assign=True)
    return module.eval().requires_grad_(False)
