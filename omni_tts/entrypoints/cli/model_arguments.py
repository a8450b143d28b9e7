"""The models one `omni-tts serve` serves: `--model [NAME[,NAME...]=]MODEL`, repeatable, and `--models FILE` (YAML or
JSON: `{"models": [{"model": MODEL, "served_model_name": NAME or [NAMES]}, ...]}`), in that order; the first is the
default model (a request without `model`), whose names `--served-model-name` may give instead. A model's names
default to its folder's name (names.default_served_model_name)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import yaml


@dataclass(frozen=True)
class ModelArgument:
    model: str | None          # a checkpoint directory or Hugging Face repo id; None: the embedded tiny model
    names: tuple[str, ...]     # its served names (empty: the default)


def model_arguments(args: argparse.Namespace) -> list[ModelArgument]:
    """Every model the options name, the default first; ValueError (one line) for an entry that cannot be used."""
    entries = [_parse(value) for value in args.model or []]
    if args.models_file:
        entries += _read_models_file(args.models_file)
    if not entries:
        entries = [ModelArgument(None, ())]
    if args.served_model_name:
        if entries[0].names:
            raise ValueError("--served-model-name names the first --model, which names itself already (NAME=MODEL)")
        entries[0] = ModelArgument(entries[0].model, tuple(args.served_model_name))
    if len(entries) > 1 and any(entry.model is None for entry in entries):
        raise ValueError("with several models, each --model names its checkpoint")
    return entries


def _parse(value: str) -> ModelArgument:
    names, sep, model = value.rpartition("=") if "=" in value else ("", "", value)
    if sep and (not model or not all(name.strip() for name in names.split(","))):
        raise ValueError(f"--model takes MODEL or NAME[,NAME...]=MODEL, got {value!r}")
    return ModelArgument(model, tuple(name.strip() for name in names.split(",")) if sep else ())


def _read_models_file(path: str) -> list[ModelArgument]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--models {path}: {e}") from None
    entries = data.get("models") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"--models {path}: needs a non-empty list under 'models'")
    parsed = []
    for index, entry in enumerate(entries):
        names = entry.get("served_model_name", []) if isinstance(entry, dict) else None
        names = [names] if isinstance(names, str) else names
        if (not isinstance(entry, dict) or not isinstance(entry.get("model"), str) or not isinstance(names, list)
                or not all(isinstance(name, str) and name.strip() for name in names)
                or set(entry) - {"model", "served_model_name"}):
            raise ValueError(f"--models {path}: models[{index}]: needs 'model' (a checkpoint) and may have "
                             f"'served_model_name' (a name or a list of names), got {entry!r}")
        parsed.append(ModelArgument(entry["model"], tuple(name.strip() for name in names)))
    return parsed
