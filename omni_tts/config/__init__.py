"""The bottom layer of settings: the stage-config schema and loader (`omni_tts/stage_configs/*.yaml` ->
`PipelineConfig`), the server's and the narrator's settings with the CLI options made from them (settings.py,
options.py), and torch threads."""
from omni_tts.config.stage_config import (
    STAGE_CONFIG_DIR,
    Code2WavStageConfig,
    ConnectorConfig,
    PipelineConfig,
    StageConfigError,
    StagesConfig,
    TalkerStageConfig,
    available_stage_configs,
    default_stage_config_path,
    load_stage_config,
    parse_stage_config,
    stage_config_from_dict,
)
from omni_tts.config.threads import available_cpus, code2wav_lanes, set_torch_threads, stage_environment, stage_threads

__all__ = [
    "STAGE_CONFIG_DIR", "Code2WavStageConfig", "ConnectorConfig", "PipelineConfig",
    "StageConfigError", "StagesConfig", "TalkerStageConfig", "available_stage_configs", "default_stage_config_path",
    "load_stage_config", "parse_stage_config", "stage_config_from_dict", "available_cpus", "set_torch_threads",
    "code2wav_lanes", "stage_environment", "stage_threads",
]
