"""`omni-tts serve`'s LoRA options: `--lora NAME=DIR` (an adapter of the default model, loaded at start-up, served as
model NAME), `--lora-dir DIR` (POST /v1/load_lora_adapter may load adapters from under DIR at run time), and
`--max-loras N` / `--max-lora-rank R` over the stage config's `stages.talker.max_loras` / `max_lora_rank` (with
adapters and a stage config that has no slots: 4 slots, or one per `--lora` if more)."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omni_tts.config import PipelineConfig

DEFAULT_MAX_LORAS = 4   # slots when adapters are asked for and the stage config has none


def lora_arguments(args: argparse.Namespace) -> dict[str, str]:
    """--lora's adapters, name → directory; ValueError (one line) for an entry that cannot be used."""
    loras: dict[str, str] = {}
    for entry in args.lora:
        name, sep, path = entry.partition("=")
        if not sep or not name.strip() or not path:
            raise ValueError(f"--lora takes NAME=DIR, got {entry!r}")
        if name.strip() in loras:
            raise ValueError(f"--lora {entry}: the name '{name.strip()}' is given twice")
        loras[name.strip()] = path
    return loras


def with_lora_slots(pipeline: PipelineConfig, args: argparse.Namespace) -> PipelineConfig:
    """The stage config with --max-loras / --max-lora-rank (checked as the YAML's values are: StageConfigError)."""
    import msgspec

    from omni_tts.config import stage_config_from_dict

    talker = pipeline.stages.talker
    max_loras = args.max_loras if args.max_loras is not None else talker.max_loras
    if max_loras == 0 and (args.lora or args.lora_dir):
        max_loras = max(DEFAULT_MAX_LORAS, len(args.lora))
    max_rank = args.max_lora_rank if args.max_lora_rank is not None else talker.max_lora_rank
    if (max_loras, max_rank) == (talker.max_loras, talker.max_lora_rank):
        return pipeline
    data = msgspec.to_builtins(pipeline)
    data["stages"]["talker"] |= {"max_loras": max_loras, "max_lora_rank": max_rank}
    return stage_config_from_dict(data, "--max-loras / --max-lora-rank")


def check_adapters(loras: dict[str, str], model_dir: str, pipeline: PipelineConfig) -> None:
    """ValueError (one line, naming the file) for a start-up adapter the default model cannot load, before any stage
    starts; more than the slots is refused too."""
    from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
    from omni_tts.models.qwen3_tts.lora import LoRAError, read_adapter

    talker = pipeline.stages.talker
    if len(loras) > talker.max_loras:
        raise ValueError(f"{len(loras)} --lora adapters but {talker.max_loras} slots (--max-loras)")
    config = Qwen3TTSConfig.load(model_dir).talker
    for name, path in loras.items():
        try:
            read_adapter(path, config, talker.max_lora_rank)
        except LoRAError as e:
            raise ValueError(f"--lora {name}: {e}") from None
