"""Stage config: where each pipeline stage runs and how big its batches, caches and rings are.

One YAML file per device layout ships in the package, `omni_tts/stage_configs/`. The model directory, not the YAML,
decides the architecture, so nothing here describes model shapes. `load_stage_config` checks everything once, with
msgspec's typed conversion, and turns every problem into a `StageConfigError` naming the file and the dotted key:

    stage_configs/x.yaml: stages.talker.dtype: must be one of float32, bfloat16, float16, got 'fp8'

Structs built directly in Python run only the cross-field checks in `__post_init__`; the per-field ranges
(`msgspec.Meta`) are enforced by the loader (`load_stage_config`, `parse_stage_config`, `stage_config_from_dict`).
"""
from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import msgspec
import msgspec.inspect
import msgspec.structs
import yaml

from omni_tts.config.chunk_schedule import (DOUBLING_DEFAULTS, ChunkSchedule, check_profiles_fit, doubling_frames,
                                            scheduled_frames)
from omni_tts.models.qwen3_tts.sampling_params import SamplingDefaults

__all__ = [
    "Code2WavStageConfig", "ConnectorConfig", "PipelineConfig", "StageConfigError",
    "StagesConfig", "TalkerStageConfig", "available_stage_configs", "default_stage_config_path",
    "load_stage_config", "parse_stage_config", "stage_config_from_dict", "STAGE_CONFIG_DIR",
]

STAGE_CONFIG_DIR = Path(__file__).resolve().parents[1] / "stage_configs"  # package data (pyproject.toml)

Device = Annotated[str, msgspec.Meta(pattern=r"^(cpu|cuda(:[0-9]+)?)$", description="'cpu', 'cuda' or 'cuda:N'")]
DType = Literal["float32", "bfloat16", "float16"]  # names of torch dtypes: getattr(torch, dtype)
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
# the first codec chunk's frames, as a stage YAML defaults it and a request may set it; it must also fit a ring slot
# (ConnectorConfig.check_chunk_frames, which knows the slot's size)
InitialChunkFrames = PositiveInt

class StageConfigError(ValueError):
    """A stage config that cannot be used; str() is `source: key: reason` (key omitted for file-level problems)."""

    def __init__(self, source: str, key: str | None, reason: str):
        self.source, self.key, self.reason = source, key, reason
        super().__init__(f"{source}: {key}: {reason}" if key else f"{source}: {reason}")


class _Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class TalkerStageConfig(_Config):
    """Stage 0: the continuous-batching talker LM and its per-request KV cache rows."""
    device: Device
    dtype: DType = "float32"
    max_batch_size: PositiveInt = 32  # requests decoded together in one engine step
    max_model_len: Annotated[int, msgspec.Meta(ge=16)] = 2048  # prompt rows + generated tokens per request
    # KV budget in token slots; one cache row holds max_model_len tokens. None = max_batch_size * max_model_len.
    kv_cache_tokens: PositiveInt | None = None
    max_prefill_tokens_per_step: PositiveInt = 512  # prompt rows prefilled per step, interleaved with decode
    max_text_tokens: PositiveInt = 1024  # longest input text accepted, in text tokens
    threads: PositiveInt | None = None  # torch CPU threads of the stage process; None = a share of the cores
    # CUDA: the decode step replays CUDA graphs captured at start-up; true runs it eagerly (as on the CPU)
    enforce_eager: bool = False
    # CUDA: the layers' fused Triton kernels (models/qwen3_tts/fused_kernels.py, ~10 kernels a layer, not ~50);
    # false: the plain PyTorch ops. The CPU always runs the plain ops.
    fused_kernels: bool = True
    # LoRA adapters loaded at once (their static buffers are allocated at start-up); 0 = none, the plain step
    max_loras: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    max_lora_rank: Annotated[int, msgspec.Meta(ge=1, le=256)] = 16  # an adapter of a higher rank is refused

    def __post_init__(self) -> None:
        # messages start with "field: " so the loader can name stages.talker.<field>
        if self.kv_cache_tokens is None:
            msgspec.structs.force_setattr(self, "kv_cache_tokens", self.max_batch_size * self.max_model_len)
        elif self.kv_cache_tokens < self.max_model_len:
            raise ValueError(f"kv_cache_tokens: must be >= max_model_len ({self.max_model_len}) so at least one "
                             f"KV cache row fits, got {self.kv_cache_tokens}")

    @property
    def num_cache_rows(self) -> int:
        """KV cache rows (one per running request); concurrency is min(max_batch_size, num_cache_rows)."""
        assert self.kv_cache_tokens is not None
        return self.kv_cache_tokens // self.max_model_len


class Code2WavStageConfig(_Config):
    """Stage 1: the batched streaming speech-tokenizer decoder (codes -> audio)."""
    device: Device
    dtype: DType = "float32"
    max_batch_size: PositiveInt = 32  # requests whose chunks decode together in one step
    # codec frames one decoder call may take (summed over its rows), in each lane; None = measured at start-up
    frame_budget: PositiveInt | None = None
    threads: PositiveInt | None = None  # torch CPU threads of the stage process; None = a share of the cores
    # decoder calls that run at once, each on its own thread with `threads` torch threads, each within the frame
    # budget; None = 1, plus a lane per code2wav-sized share of the talker's cores when both stages use the CPU
    lanes: PositiveInt | None = None
    # CUDA: decoder calls replay CUDA graphs captured at start-up (one lane); true runs them eagerly (as on the CPU)
    enforce_eager: bool = False


class StagesConfig(_Config):
    talker: TalkerStageConfig
    code2wav: Code2WavStageConfig

    def by_name(self) -> dict[str, TalkerStageConfig | Code2WavStageConfig]:
        """The stages in pipeline order, by the names their processes and messages use."""
        return {"talker": self.talker, "code2wav": self.code2wav}


class ConnectorConfig(_Config):
    """The chunk connector between talker and code2wav; a frame is one step's 16 codes.

    kind shm: a shared-memory ring (both stages on this host). kind tcp: one TCP connection that code2wav binds at
    tcp_host:tcp_port, so it can run on another host; ring_slots then bounds the chunks in flight the same way.
    kind local: the fused layout, both stages in one process (code2wav on a thread and, on a GPU, a CUDA stream of
    its own) and chunks handed over in memory; ring_slots bounds them the same way.
    """
    # chunk sizes (chunk_schedule.py), one of: the doubling (chunk_schedule unset) from initial_codec_chunk_frames
    # (default 2) up to codec_chunk_frames (default 25); a named profile (latency, load; auto picks one per request by
    # the talker's load); or a list of frames, its last repeated. A request's own first chunk wins in every case.
    chunk_schedule: ChunkSchedule = None
    initial_codec_chunk_frames: InitialChunkFrames | None = None  # first chunk: low time-to-first-audio
    codec_chunk_frames: Annotated[int, msgspec.Meta(ge=1, le=256)] | None = None
    # chunk_schedule auto: a request that finds this many requests in the talker (running, parked or waiting) gets
    # the load profile, fewer the latency one. A first guess (Nari switches between 10 and 12 requests/s), to be
    # tuned by the GPU benchmark
    auto_load_requests: PositiveInt = 8
    ring_slots: Annotated[int, msgspec.Meta(ge=2, le=65536)] = 256  # chunks in flight (released by code2wav)
    ring_slot_frames: PositiveInt = 64  # capacity of one slot; a chunk never spans slots
    kind: Literal["shm", "tcp", "local"] = "shm"
    tcp_host: str | None = None  # kind tcp: an IP address of code2wav's host; None = 127.0.0.1
    tcp_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None  # kind tcp: None or 0 = a free port

    def __post_init__(self) -> None:
        self._check_chunk_schedule()
        if self.kind != "tcp":
            for name in ("tcp_host", "tcp_port"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: only used with kind: tcp (kind is {self.kind})")
            return
        if self.tcp_host is None:
            msgspec.structs.force_setattr(self, "tcp_host", "127.0.0.1")
        if self.tcp_port is None:
            msgspec.structs.force_setattr(self, "tcp_port", 0)
        try:
            ipaddress.ip_address(self.tcp_host)
        except ValueError:  # zmq binds an address, not a name
            raise ValueError(f"tcp_host: must be an IP address, got {self.tcp_host!r}") from None

    def _check_chunk_schedule(self) -> None:
        doubling = ("initial_codec_chunk_frames", "codec_chunk_frames")
        if self.chunk_schedule is None:
            for name, default in zip(doubling, DOUBLING_DEFAULTS):
                if getattr(self, name) is None:
                    msgspec.structs.force_setattr(self, name, default)
                self.check_chunk_frames(name, getattr(self, name))
            return
        for name in doubling:
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: not used with chunk_schedule (the schedule sets every chunk; a request "
                                 f"may still set its first)")
        if isinstance(self.chunk_schedule, list):
            if not self.chunk_schedule:
                raise ValueError("chunk_schedule: an empty list; give the chunks' frames, the last repeated")
            for frames in self.chunk_schedule:
                self.check_chunk_frames("chunk_schedule", frames)
            return
        check_profiles_fit(self.chunk_schedule, self.ring_slot_frames)

    def chunk_frames(self, first: int | None, num_requests: int) -> tuple[int, ...]:
        """The frames of a request's chunks, the last repeated; first: its own first chunk, if it sets one;
        num_requests: those the talker holds as it starts (chunk_schedule auto)."""
        if self.chunk_schedule is None:
            assert self.initial_codec_chunk_frames is not None and self.codec_chunk_frames is not None
            return doubling_frames(first or self.initial_codec_chunk_frames, self.codec_chunk_frames)
        return scheduled_frames(self.chunk_schedule, first, num_requests, self.auto_load_requests)

    @property
    def max_chunk_frames(self) -> int:
        """The largest chunk the schedule cuts but a request's own first (code2wav sizes its decoder calls by it)."""
        return max(max(self.chunk_frames(None, 0)), max(self.chunk_frames(None, self.auto_load_requests)))

    def check_chunk_frames(self, name: str, frames: int) -> None:
        """ValueError `name: …` unless chunks of `frames` (a stage config's, or a request's first chunk) can be made
        and each fits in one ring slot."""
        if frames < 1:
            raise ValueError(f"{name}: must be >= 1, got {frames}")
        if frames > self.ring_slot_frames:
            raise ValueError(f"{name}: must be <= ring_slot_frames ({self.ring_slot_frames}) so a chunk fits in one "
                             f"ring slot, got {frames}")


class AlignerStageConfig(_Config):
    """The forced-aligner stage (word timestamps), when the server has an aligner (`--forced-aligner`): its own
    process, off the audio path, restarted on its own."""
    device: Device = "cpu"
    dtype: DType = "float32"
    max_batch_size: PositiveInt = 16  # segments aligned together in one forward
    threads: PositiveInt = 1  # torch CPU threads of the process (it runs below the TTS stages' priority)
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0  # a segment not aligned by then gets no timestamps
    # process: a process of its own (restarted alone); code2wav: a thread in code2wav's process, on its device and
    # its threads (one CUDA context less; it restarts with the pipeline)
    placement: Literal["process", "code2wav"] = "process"


class PipelineConfig(_Config):
    """The whole serving layout: one config per stage, the connector between them, sampling defaults, and the
    forced aligner's stage."""
    stages: StagesConfig
    connector: ConnectorConfig = msgspec.field(default_factory=ConnectorConfig)
    aligner: AlignerStageConfig = msgspec.field(default_factory=AlignerStageConfig)
    # server-wide sampling defaults (requests override them), with the bounds a request's fields have
    sampling: SamplingDefaults = msgspec.field(default_factory=SamplingDefaults)


# ---- loading ---------------------------------------------------------------------------------------------------

def available_stage_configs() -> list[str]:
    """Names of the shipped configs (`omni_tts/stage_configs/<name>.yaml`)."""
    return sorted(p.stem for p in STAGE_CONFIG_DIR.glob("*.yaml"))


def default_stage_config_path(name: str) -> str:
    """A shipped config's path from its name ("cpu_tiny"); an explicit path (has a '/' or a .yaml/.yml suffix) is
    returned unchanged."""
    if "/" in name or "\\" in name or name.endswith((".yaml", ".yml")):
        return name
    path = STAGE_CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        raise StageConfigError(name, None, f"no such stage config in {STAGE_CONFIG_DIR}; available: "
                                           f"{', '.join(available_stage_configs()) or '(none)'}")
    return str(path)


def load_stage_config(path: str) -> PipelineConfig:
    """Read and check a stage config file; `path` may also be a shipped config's name ("cpu_tiny")."""
    path = default_stage_config_path(str(path))
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise StageConfigError(path, None, "file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise StageConfigError(path, None, f"cannot read: {e}") from None
    return parse_stage_config(text, path)


def parse_stage_config(text: str, source: str = "<string>") -> PipelineConfig:
    """Check YAML text; `source` names it in errors."""
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise StageConfigError(source, None, f"invalid YAML{where}: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise StageConfigError(source, None, f"invalid YAML: {e}") from None
    if data is None:
        raise StageConfigError(source, None, "empty config: expected a mapping with a 'stages' key")
    return stage_config_from_dict(data, source)


def stage_config_from_dict(data: Any, source: str = "<dict>") -> PipelineConfig:
    """Check already-parsed builtins (e.g. `msgspec.to_builtins(config)` with overrides applied)."""
    try:
        return msgspec.convert(data, PipelineConfig)
    except msgspec.ValidationError as e:
        key, reason = _explain(str(e), data)
        raise StageConfigError(source, key, reason) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key repeated in one mapping (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, str):
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key '{key}'", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


# ---- msgspec ValidationError -> (dotted key, reason) ---------------------------------------------------------------

_AT = re.compile(r"^(?P<msg>.*?)(?: - at (?P<key>`key` in )?`(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]*)`$")
_FIELD_MSG = re.compile(r"^(?P<name>[a-z_][a-z0-9_]*): (?P<reason>.+)$", re.S)


def _explain(message: str, data: Any) -> tuple[str | None, str]:
    m = _AT.match(message)
    assert m is not None
    msg, parts = m["msg"], _split_path(m["path"] or "$")
    where = ".".join(parts) or None
    if m["key"]:
        return where, f"keys must be strings, got {_show(_bad_key(_value_at(data, parts)))}"
    info = _type_at(parts)
    if (u := _UNKNOWN.match(msg)) is not None:
        allowed = ", ".join(f.name for f in info.fields) if isinstance(info, msgspec.inspect.StructType) else "?"
        return _join(where, u["name"]), f"unknown key; allowed keys: {allowed}"
    if (u := _MISSING.match(msg)) is not None:
        return _join(where, u["name"]), "missing required key"
    if (u := _FIELD_MSG.match(msg)) is not None and isinstance(info, msgspec.inspect.StructType):
        return _join(where, u["name"]), u["reason"]  # a cross-field check in __post_init__
    if info is None:
        return where, msg
    return where, f"{'' if where else 'the top level '}must be {_describe(info)}, got {_show(_value_at(data, parts))}"


_LITERAL_ORDER = {frozenset(get_args(DType)): get_args(DType)}


def _split_path(path: str) -> list[str]:
    # "$.stages.talker.dtype" -> ["stages", "talker", "dtype"]; a list's item stays one part ("chunk_schedule[0]")
    return [p for p in path.removeprefix("$").split(".") if p]


def _join(where: str | None, name: str) -> str:
    return f"{where}.{name}" if where else name


def _type_at(parts: list[str]) -> msgspec.inspect.Type | None:
    info: msgspec.inspect.Type | None = msgspec.inspect.type_info(PipelineConfig)
    for part in parts:
        info = _strip(info)
        if not isinstance(info, msgspec.inspect.StructType):
            return None
        info = next((f.type for f in info.fields if f.name == part), None)
    return _strip(info)


def _strip(info: msgspec.inspect.Type | None) -> msgspec.inspect.Type | None:
    return info.type if isinstance(info, msgspec.inspect.Metadata) and isinstance(
        info.type, msgspec.inspect.StructType) else info


def _value_at(data: Any, parts: list[str]) -> Any:
    for part in parts:
        data = data.get(part) if isinstance(data, dict) else None
    return data


def _bad_key(mapping: Any) -> Any:
    return next((k for k in mapping if not isinstance(k, str)), None) if isinstance(mapping, dict) else None


def _describe(info: msgspec.inspect.Type) -> str:
    ins = msgspec.inspect
    if isinstance(info, ins.UnionType):
        kinds = [_describe(t) for t in info.types if not isinstance(t, ins.NoneType)]
        return " or ".join(kinds) + (" or null" if len(kinds) < len(info.types) else "")
    if isinstance(info, ins.Metadata):
        description = (info.extra_json_schema or {}).get("description")
        return description or _describe(info.type)
    if isinstance(info, ins.LiteralType):
        values = _LITERAL_ORDER.get(frozenset(info.values), info.values)  # msgspec.inspect sorts them
        return "one of " + ", ".join(str(v) for v in values)
    if isinstance(info, ins.IntType):
        return "an integer" + _bounds(info)
    if isinstance(info, ins.FloatType):
        return "a number" + _bounds(info)
    if isinstance(info, ins.StrType):
        return "a string" + (f" matching {info.pattern!r}" if info.pattern else "")
    if isinstance(info, ins.ListType):
        return f"a list ({_describe(info.item_type)} each)"
    if isinstance(info, ins.StructType):
        return "a mapping with keys " + ", ".join(f.name for f in info.fields)
    return type(info).__name__.removesuffix("Type").lower()


def _bounds(info: Any) -> str:
    def bound(value: Any, *marks: str) -> tuple[Any, ...] | None:
        return None if value is None else (f"{value:g}" if isinstance(value, float) else value, *marks)
    low = bound(info.ge, "[", ">=") or bound(info.gt, "(", ">")
    high = bound(info.le, "]", "<=") or bound(info.lt, ")", "<")
    if low and high:
        if isinstance(info, msgspec.inspect.IntType) and low[1] == "[" and high[1] == "]":
            return f" in {low[0]}..{high[0]}"
        return f" in {low[1]}{low[0]}, {high[0]}{high[1]}"
    either = low or high
    return f" {either[2]} {either[0]}" if either else ""


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)
