import os
from pathlib import Path

import msgspec
import pytest

from omni_tts.config import (
    STAGE_CONFIG_DIR,
    Code2WavStageConfig,
    ConnectorConfig,
    PipelineConfig,
    StageConfigError,
    TalkerStageConfig,
    available_cpus,
    available_stage_configs,
    code2wav_lanes,
    default_stage_config_path,
    load_stage_config,
    parse_stage_config,
    stage_config_from_dict,
    stage_environment,
    stage_threads,
)
from omni_tts.models.qwen3_tts.sampling_params import SamplingDefaults

SHIPPED = ["cpu_small", "cpu_tiny", "qwen3_tts_1gpu", "qwen3_tts_2gpu"]
SRC = "stage_configs/x.yaml"
MINIMAL = "stages:\n  talker: {device: cpu}\n  code2wav: {device: cpu}\n"


def minimal(talker: str = "", code2wav: str = "", extra: str = "") -> str:
    """MINIMAL with extra keys in the stage flow mappings (device: cpu unless given) and extra top-level text."""
    def stage(keys: str) -> str:
        return "{" + ", ".join(k for k in ("" if "device:" in keys else "device: cpu", keys) if k) + "}"
    return f"stages:\n  talker: {stage(talker)}\n  code2wav: {stage(code2wav)}\n{extra}"


def test_shipped_configs_load():
    assert set(SHIPPED) <= set(available_stage_configs())
    for name in available_stage_configs():
        cfg = load_stage_config(str(STAGE_CONFIG_DIR / f"{name}.yaml"))
        assert isinstance(cfg, PipelineConfig)
        assert cfg.stages.talker.num_cache_rows >= 1


def test_shipped_layouts():
    tiny = load_stage_config(default_stage_config_path("cpu_tiny"))
    t, c = tiny.stages.talker, tiny.stages.code2wav
    assert (t.device, t.dtype, t.max_batch_size, t.max_model_len) == ("cpu", "float32", 32, 1024)
    assert (c.device, c.dtype, c.max_batch_size) == ("cpu", "float32", 32)
    assert (tiny.connector.initial_codec_chunk_frames, tiny.connector.codec_chunk_frames) == (2, 25)

    small = load_stage_config("cpu_small")
    assert (small.stages.talker.device, small.stages.code2wav.device) == ("cpu", "cpu")

    one = load_stage_config("qwen3_tts_1gpu")
    t, c = one.stages.talker, one.stages.code2wav
    assert (t.device, t.dtype, t.max_batch_size, t.max_model_len) == ("cuda:0", "bfloat16", 64, 4096)
    assert (c.device, c.dtype, c.max_batch_size) == ("cuda:0", "bfloat16", 64)
    assert one.connector.chunk_schedule == "auto"   # the leaders' profiles, by load
    assert (one.connector.chunk_frames(None, 1), one.connector.chunk_frames(None, 8)) == ((1, 2, 4, 8, 12),
                                                                                          (4, 4, 8, 16, 25))
    assert one.stages.talker.num_cache_rows == 64

    two = load_stage_config("qwen3_tts_2gpu")
    assert (two.stages.talker.device, two.stages.code2wav.device) == ("cuda:0", "cuda:1")


def test_defaults_fill_in():
    cfg = parse_stage_config(MINIMAL, SRC)
    t = cfg.stages.talker
    assert t == TalkerStageConfig(device="cpu", dtype="float32", max_batch_size=32, max_model_len=2048,
                                  kv_cache_tokens=32 * 2048, max_prefill_tokens_per_step=512, max_text_tokens=1024)
    assert t.num_cache_rows == 32
    assert cfg.stages.code2wav == Code2WavStageConfig(device="cpu", dtype="float32", max_batch_size=32)
    assert cfg.connector == ConnectorConfig(initial_codec_chunk_frames=2, codec_chunk_frames=25, ring_slots=256,
                                            ring_slot_frames=64, kind="shm", tcp_host=None, tcp_port=None)
    assert cfg.sampling == SamplingDefaults()
    assert all(v is None for v in msgspec.structs.asdict(cfg.sampling).values())


def test_kv_budget_rows_and_conversions():
    cfg = parse_stage_config(minimal("max_batch_size: 8, max_model_len: 100, kv_cache_tokens: 450",
                                     extra="sampling: {top_p: 1, temperature: 0}\n"), SRC)
    assert cfg.stages.talker.num_cache_rows == 4  # 450 // 100
    assert cfg.sampling.top_p == 1.0 and isinstance(cfg.sampling.top_p, float)
    assert parse_stage_config(minimal("device: cuda"), SRC).stages.talker.device == "cuda"
    assert parse_stage_config(minimal("device: 'cuda:3'"), SRC).stages.talker.device == "cuda:3"
    # defaults come from this talker's own sizes
    assert parse_stage_config(minimal("max_batch_size: 3, max_model_len: 16"), SRC).stages.talker.kv_cache_tokens == 48


def test_tcp_connector():
    cfg = parse_stage_config(MINIMAL + "connector: {kind: tcp, ring_slots: 8}\n", SRC)
    assert (cfg.connector.kind, cfg.connector.tcp_host, cfg.connector.tcp_port, cfg.connector.ring_slots) == (
        "tcp", "127.0.0.1", 0, 8)  # loopback, a port the owner picks
    remote = parse_stage_config(MINIMAL + "connector: {kind: tcp, tcp_host: 'fd00::2', tcp_port: 7100}\n", SRC)
    assert (remote.connector.tcp_host, remote.connector.tcp_port) == ("fd00::2", 7100)
    assert stage_config_from_dict(msgspec.to_builtins(remote), "<dict>") == remote


def test_frozen_and_round_trip():
    cfg = load_stage_config("cpu_tiny")
    with pytest.raises(AttributeError):
        cfg.stages.talker.max_batch_size = 1  # type: ignore[misc]
    assert stage_config_from_dict(msgspec.to_builtins(cfg), "<dict>") == cfg


BAD = [
    # (talker, code2wav, extra, exact message after "stage_configs/x.yaml: ")
    ("dtype: fp8", "", "", "stages.talker.dtype: must be one of float32, bfloat16, float16, got 'fp8'"),
    ("", "dtype: half", "", "stages.code2wav.dtype: must be one of float32, bfloat16, float16, got 'half'"),
    ("device: gpu", "", "", "stages.talker.device: must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
    ("", "device: 'cuda:x'", "", "stages.code2wav.device: must be 'cpu', 'cuda' or 'cuda:N', got 'cuda:x'"),
    ("max_batch_size: 0", "", "", "stages.talker.max_batch_size: must be an integer >= 1, got 0"),
    ("max_batch_size: 'many'", "", "", "stages.talker.max_batch_size: must be an integer >= 1, got 'many'"),
    ("max_batch_size: true", "", "", "stages.talker.max_batch_size: must be an integer >= 1, got true"),
    ("max_model_len: 8", "", "", "stages.talker.max_model_len: must be an integer >= 16, got 8"),
    ("max_model_len: 20.5", "", "", "stages.talker.max_model_len: must be an integer >= 16, got 20.5"),
    ("max_prefill_tokens_per_step: 0", "", "",
     "stages.talker.max_prefill_tokens_per_step: must be an integer >= 1, got 0"),
    ("max_text_tokens: -1", "", "", "stages.talker.max_text_tokens: must be an integer >= 1, got -1"),
    ("max_loras: -1", "", "", "stages.talker.max_loras: must be an integer in 0..64, got -1"),
    ("max_loras: 65", "", "", "stages.talker.max_loras: must be an integer in 0..64, got 65"),
    ("max_lora_rank: 0", "", "", "stages.talker.max_lora_rank: must be an integer in 1..256, got 0"),
    ("max_model_len: 1024, kv_cache_tokens: 1000", "", "",
     "stages.talker.kv_cache_tokens: must be >= max_model_len (1024) so at least one KV cache row fits, got 1000"),
    ("", "max_batch_size: 0", "", "stages.code2wav.max_batch_size: must be an integer >= 1, got 0"),
    ("", "", "connector: {initial_codec_chunk_frames: 65}\n",
     "connector.initial_codec_chunk_frames: must be <= ring_slot_frames (64) so a chunk fits in one ring slot, "
     "got 65"),
    ("", "", "connector: {codec_chunk_frames: 0}\n",
     "connector.codec_chunk_frames: must be an integer in 1..256 or null, got 0"),
    ("", "", "connector: {ring_slots: 1}\n", "connector.ring_slots: must be an integer in 2..65536, got 1"),
    ("", "", "connector: {ring_slot_frames: 0}\n", "connector.ring_slot_frames: must be an integer >= 1, got 0"),
    ("", "", "connector: {codec_chunk_frames: 100}\n",
     "connector.codec_chunk_frames: must be <= ring_slot_frames (64) so a chunk fits in one ring slot, got 100"),
    ("", "", "connector: {ring_slot_frames: 16, codec_chunk_frames: 16, initial_codec_chunk_frames: 32}\n",
     "connector.initial_codec_chunk_frames: must be <= ring_slot_frames (16) so a chunk fits in one ring slot, "
     "got 32"),
    ("", "", "connector: {chunk_schedule: fast}\n",
     "connector.chunk_schedule: must be one of auto, latency, load or a list (an integer each) or null, got 'fast'"),
    ("", "", "connector: {chunk_schedule: []}\n",
     "connector.chunk_schedule: an empty list; give the chunks' frames, the last repeated"),
    ("", "", "connector: {chunk_schedule: [2, 0]}\n", "connector.chunk_schedule: must be >= 1, got 0"),
    ("", "", "connector: {chunk_schedule: [2, 70]}\n",
     "connector.chunk_schedule: must be <= ring_slot_frames (64) so a chunk fits in one ring slot, got 70"),
    ("", "", "connector: {chunk_schedule: auto, ring_slot_frames: 16}\n",
     "connector.chunk_schedule: the load profile's chunks ([4, 4, 8, 16, 25]) must fit ring_slot_frames (16)"),
    ("", "", "connector: {chunk_schedule: latency, initial_codec_chunk_frames: 1}\n",
     "connector.initial_codec_chunk_frames: not used with chunk_schedule (the schedule sets every chunk; a request "
     "may still set its first)"),
    ("", "", "connector: {chunk_schedule: load, codec_chunk_frames: 25}\n",
     "connector.codec_chunk_frames: not used with chunk_schedule (the schedule sets every chunk; a request may "
     "still set its first)"),
    ("", "", "connector: {chunk_schedule: auto, auto_load_requests: 0}\n",
     "connector.auto_load_requests: must be an integer >= 1, got 0"),
    ("", "", "sampling: {top_p: 0}\n", "sampling.top_p: must be a number in (0, 1] or null, got 0"),
    ("", "", "sampling: {subtalker_top_p: 1.5}\n",
     "sampling.subtalker_top_p: must be a number in (0, 1] or null, got 1.5"),
    ("", "", "sampling: {temperature: -0.1}\n",
     "sampling.temperature: must be a number in [0, 100] or null, got -0.1"),
    ("", "", "sampling: {temperature: 1000}\n",
     "sampling.temperature: must be a number in [0, 100] or null, got 1000"),
    ("", "", "sampling: {repetition_penalty: 0}\n",
     "sampling.repetition_penalty: must be a number in (0, 100] or null, got 0"),
    ("", "", "sampling: {top_k: -1}\n", "sampling.top_k: must be an integer in 0..2147483647 or null, got -1"),
    ("", "", "sampling: {max_new_tokens: 1}\n", "sampling.max_new_tokens: must be an integer in 2..8192 or null, got 1"),
    ("", "", "sampling: {seed: 1}\n", "sampling.seed: unknown key; allowed keys: temperature, top_k, top_p, "
     "repetition_penalty, subtalker_temperature, subtalker_top_k, subtalker_top_p, max_new_tokens"),
    ("", "", "connector: 3\n",
     "connector: must be a mapping with keys chunk_schedule, initial_codec_chunk_frames, codec_chunk_frames, "
     "auto_load_requests, ring_slots, ring_slot_frames, kind, tcp_host, tcp_port, got 3"),
    ("", "", "connector: {kind: udp}\n", "connector.kind: must be one of local, shm, tcp, got 'udp'"),
    ("", "", "connector: {kind: tcp, tcp_host: localhost}\n",
     "connector.tcp_host: must be an IP address, got 'localhost'"),
    ("", "", "connector: {kind: tcp, tcp_port: 65536}\n",
     "connector.tcp_port: must be an integer in 0..65535 or null, got 65536"),
    ("", "", "connector: {tcp_port: 5555}\n", "connector.tcp_port: only used with kind: tcp (kind is shm)"),
    ("", "", "connector: {kind: shm, tcp_host: 10.0.0.2}\n",
     "connector.tcp_host: only used with kind: tcp (kind is shm)"),
]


@pytest.mark.parametrize("talker,code2wav,extra,message", BAD, ids=[b[3].split(":")[0] for b in BAD])
def test_bad_values_name_file_key_and_allowed_values(talker, code2wav, extra, message):
    with pytest.raises(StageConfigError) as info:
        parse_stage_config(minimal(talker, code2wav, extra), SRC)
    assert str(info.value) == f"{SRC}: {message}"
    assert info.value.source == SRC and info.value.key == message.split(": ")[0]


@pytest.mark.parametrize("text,message", [
    (minimal("colour: red"), "stages.talker.colour: unknown key; allowed keys: device, dtype, max_batch_size, "
                             "max_model_len, kv_cache_tokens, max_prefill_tokens_per_step, max_text_tokens, threads, "
                             "enforce_eager, fused_kernels, max_loras, max_lora_rank"),
    (MINIMAL + "  vocoder: {device: cpu}\n", "stages.vocoder: unknown key; allowed keys: talker, code2wav"),
    (MINIMAL + "connector: {chunk_frames: 4}\n",
     "connector.chunk_frames: unknown key; allowed keys: chunk_schedule, initial_codec_chunk_frames, "
     "codec_chunk_frames, auto_load_requests, ring_slots, ring_slot_frames, kind, tcp_host, tcp_port"),
    (MINIMAL + "num_layers: 28\n", "num_layers: unknown key; allowed keys: stages, connector, aligner, sampling"),
    ("stages:\n  talker: {dtype: float32}\n  code2wav: {device: cpu}\n", "stages.talker.device: missing required key"),
    ("stages:\n  talker: {device: cpu}\n", "stages.code2wav: missing required key"),
    ("connector: {}\n", "stages: missing required key"),
    ("stages:\n  1: {device: cpu}\n", "stages: keys must be strings, got 1"),
])
def test_unknown_and_missing_keys(text, message):
    with pytest.raises(StageConfigError) as info:
        parse_stage_config(text, SRC)
    assert str(info.value) == f"{SRC}: {message}"


@pytest.mark.parametrize("text,message", [
    ("stages:\n  talker: {device: cpu\n",
     "invalid YAML at line 3, column 1: expected ',' or '}', but got '<stream end>'"),
    ("stages:\n talker:\n   device: cpu\n  code2wav: x\n",
     "invalid YAML at line 4, column 3: expected <block end>, but found '<block mapping start>'"),
    ("stages:\n  talker: {device: cpu, device: cuda}\n", "invalid YAML at line 2, column 25: duplicate key 'device'"),
    ("", "empty config: expected a mapping with a 'stages' key"),
    ("- stages\n", "the top level must be a mapping with keys stages, connector, aligner, sampling, got a list"),
])
def test_yaml_errors_name_the_file(text, message):
    with pytest.raises(StageConfigError) as info:
        parse_stage_config(text, SRC)
    assert str(info.value) == f"{SRC}: {message}"


def test_load_from_file_names_the_path(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text(minimal("dtype: fp8"))
    with pytest.raises(StageConfigError, match=rf"^{path}: stages\.talker\.dtype: must be one of"):
        load_stage_config(str(path))
    path.write_text("stages: [\n")
    with pytest.raises(StageConfigError, match=rf"^{path}: invalid YAML at line 2"):
        load_stage_config(str(path))
    with pytest.raises(StageConfigError, match=rf"^{tmp_path / 'missing.yaml'}: file not found$"):
        load_stage_config(str(tmp_path / "missing.yaml"))


def test_default_stage_config_path():
    assert default_stage_config_path("cpu_tiny") == str(STAGE_CONFIG_DIR / "cpu_tiny.yaml")
    assert Path(default_stage_config_path("cpu_tiny")).is_file()
    assert STAGE_CONFIG_DIR == Path(__file__).resolve().parents[2] / "omni_tts" / "stage_configs"
    assert default_stage_config_path("some/dir/x.yaml") == "some/dir/x.yaml"  # explicit paths pass through
    assert default_stage_config_path("x.yml") == "x.yml"
    with pytest.raises(StageConfigError, match="^nope: no such stage config in .*; available: .*cpu_tiny"):
        default_stage_config_path("nope")


def test_direct_construction_runs_cross_field_checks():
    assert TalkerStageConfig(device="cpu", max_batch_size=4, max_model_len=100).kv_cache_tokens == 400
    with pytest.raises(ValueError, match="^kv_cache_tokens: must be >= max_model_len"):
        TalkerStageConfig(device="cpu", max_model_len=64, kv_cache_tokens=63)
    with pytest.raises(ValueError, match="^codec_chunk_frames: must be <= ring_slot_frames"):
        ConnectorConfig(codec_chunk_frames=65)


@pytest.mark.parametrize("schedule,fields,largest", [
    (None, (2, 25), 25), ("latency", (None, None), 12), ("load", (None, None), 25), ("auto", (None, None), 25),
    ([3, 9, 6], (None, None), 9)])
def test_a_chunk_schedule_replaces_the_doubling_fields_and_survives_a_round_trip(schedule, fields, largest):
    """The loader's view and a stage process's (the launch carries the config through msgspec) are the same."""
    cfg = parse_stage_config(MINIMAL + ("" if schedule is None else f"connector: {{chunk_schedule: {schedule}}}\n"),
                             SRC)
    connector = cfg.connector
    assert (connector.initial_codec_chunk_frames, connector.codec_chunk_frames) == fields
    assert connector.max_chunk_frames == largest   # what code2wav sizes its decoder calls by
    assert stage_config_from_dict(msgspec.to_builtins(cfg)) == cfg
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(cfg), type=PipelineConfig) == cfg


@pytest.mark.parametrize("cpus,talker,code2wav,expected,lanes", [
    (1, "", "", {"talker": 1, "code2wav": 1}, 2),
    (2, "", "", {"talker": 1, "code2wav": 1}, 2),       # the API runs beside the stages (they sit at niceness 5)
    (4, "", "", {"talker": 1, "code2wav": 2}, 1),       # one core kept for the API, the odd one to code2wav
    (16, "", "", {"talker": 7, "code2wav": 8}, 1),      # the talker's 7 cores fund no whole 8-thread lane
    (16, "threads: 8", "threads: 4", {"talker": 8, "code2wav": 4}, 3),
    (16, "threads: 3", "threads: 5, lanes: 3", {"talker": 3, "code2wav": 5}, 3),
    (16, "device: cuda", "", {"talker": 1, "code2wav": 15}, 1),   # a GPU talker's host thread funds no lane
    (16, "device: cuda", "device: cuda", {"talker": 1, "code2wav": 1}, 1),
])
def test_thread_budget(cpus, talker, code2wav, expected, lanes):
    def stage(extra):
        return "{" + ", ".join(p for p in ("device: cpu" if "device" not in extra else "", extra) if p) + "}"
    cfg = parse_stage_config(f"stages:\n  talker: {stage(talker)}\n  code2wav: {stage(code2wav)}\n", SRC)
    threads = stage_threads(cfg, cpus)
    assert threads == expected
    assert code2wav_lanes(cfg, threads) == lanes


@pytest.mark.parametrize("user_value", [None, "ACTIVE"])
def test_stage_environment_passive_workers_for_the_talker_only(monkeypatch, user_value):
    if user_value is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", user_value)
    assert stage_environment("talker") == ({} if user_value else {"OMP_WAIT_POLICY": "PASSIVE"})
    assert stage_environment("code2wav") == {}  # passive workers cost its decoder calls their second thread
    assert os.environ.get("OMP_WAIT_POLICY") == user_value


def test_thread_budget_reads_affinity():
    assert available_cpus() == len(os.sched_getaffinity(0))
    assert sum(stage_threads(parse_stage_config(MINIMAL, SRC)).values()) <= max(2, available_cpus())
