"""Messages between the orchestrator and the stage processes (pyzmq frames, msgspec msgpack), defined once."""
from __future__ import annotations

import bisect
import enum

import msgspec

from omni_tts.config.stage_config import Code2WavStageConfig, PipelineConfig, TalkerStageConfig
from omni_tts.connectors.kinds import ConnectorSpec
from omni_tts.models.qwen3_tts.prompt import RequestError, TalkerPrompt
from omni_tts.models.qwen3_tts.sampling import ResolvedSampling


# --- orchestrator → stages -------------------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag=True):
    """Stage 0: one prepared request (the input processor's output): its tokenized, validated prompt, resolved
    sampling and token limit; the stage adds the voice features and embeds it."""
    request_id: str
    prompt: TalkerPrompt
    sampling: ResolvedSampling       # a dataclass: msgspec encodes and decodes it as is
    max_tokens: int
    ref_audio: bytes | None = None   # Base: float32 mono samples at 24 kHz
    speaker_embedding: bytes | None = None   # Base, instead of ref_audio: the x-vector as float32 [enc_dim]
    ref_codes: bytes | None = None   # ICL reference codes given as codes (int32 [T, num_code_groups]), not the clip's
    initial_codec_chunk_frames: int | None = None   # its first chunk; None = the connector schedule's
    voice_version: str | None = None  # an uploaded voice's version (VoiceRecord.voice_version): its features are cached
    text_open: bool = False          # more text ids follow in AppendText (streaming layout); max_tokens is then
                                     # the limit for the text so far
    return_codes: bool = False       # its TalkerDone carries the generated codes
    lora: str | None = None          # the LoRA adapter (a loaded one's name) it runs with; None = the base model


class AppendText(msgspec.Struct, tag=True):
    """Stage 0: the next text ids of a request added with text_open; `done` ends its text."""
    request_id: str
    text_ids: list[int]
    max_tokens: int                  # the token limit for the text so far (with done: the request's)
    done: bool


class EmbedVoice(msgspec.Struct, tag=True):
    """Stage 0: the x-vector of a clip, answered with a VoiceEmbedding: computed as a request's would be (the same
    worker and device), so the vector sent back as `speaker_embedding` gives the clip's x-vector-only audio."""
    request_id: str
    ref_audio: bytes                 # float32 mono samples at 24 kHz
    voice_version: str | None = None  # an uploaded voice's version: the features cache shares it with requests


class LoadLoRA(msgspec.Struct, tag=True):
    """Stage 0: read a PEFT adapter directory (beside the loop) and load it under `name`; answered by LoRALoaded."""
    name: str
    path: str


class UnloadLoRA(msgspec.Struct, tag=True):
    """Stage 0: free a loaded adapter; refused while requests hold it. Answered by LoRAUnloaded."""
    name: str


class Register(msgspec.Struct, tag=True):
    """Stage 1: allocate the request's decoder state before its first chunk."""
    request_id: str


class Abort(msgspec.Struct, tag=True):
    request_id: str


class GetStats(msgspec.Struct, tag=True):
    pass


class Shutdown(msgspec.Struct, tag=True):
    # a talker unloaded while code2wav runs on: it waits (at most this long) until code2wav has given back every
    # connector slot, so no release of its chunks reaches the talker that loads after it
    release_wait: float = 0.0


StageCommand = (AddRequest | AppendText | EmbedVoice | LoadLoRA | UnloadLoRA | Register | Abort | GetStats
                | Shutdown)


class AlignSpan(msgspec.Struct, tag=True):
    """The aligner stage: word times of one span, a finished piece of a request's audio (a sentence, a narration
    segment, or all of it)."""
    request_id: str
    span: int
    text: str
    language: str | None
    pcm: bytes                       # float32 mono samples at `sample_rate`
    sample_rate: int


class DropSpan(msgspec.Struct, tag=True):
    """The aligner stage: skip this span if it still waits; nobody waits for its words any more (its response
    gave up on it, stopped waiting or ended)."""
    request_id: str
    span: int


AlignerCommand = AlignSpan | DropSpan | Abort | Shutdown


# --- stages → orchestrator -------------------------------------------------------------------------------------
class FailureKind(enum.StrEnum):
    BAD_INPUT = "bad_input"   # the request's own fault: the same request fails the same way again
    INTERNAL = "internal"     # the stage's: another try may get past it


class RequestFailure(msgspec.Struct):
    """Why a stage failed one request (the others go on): bad input names the request's field (`param`), which the
    orchestrator raises as RequestError (HTTP 400, never retried); an internal failure is RequestFailed (500)."""
    kind: FailureKind
    message: str
    param: str | None = None

    @classmethod
    def of(cls, error: Exception) -> "RequestFailure":
        """The kind of an exception met inside a stage, decided where it was raised: a RequestError is bad input,
        any other exception internal."""
        if isinstance(error, RequestError):
            return cls(FailureKind.BAD_INPUT, str(error), error.param)
        return cls(FailureKind.INTERNAL, f"{type(error).__name__}: {error}")


class Ready(msgspec.Struct, tag=True):
    stage: str
    pid: int


class TalkerDone(msgspec.Struct, tag=True):
    """Stage 0 finished a request: its frame count and why, or the failure that stopped it."""
    request_id: str
    num_frames: int
    finish_reason: str
    num_prompt_rows: int = 0
    num_reference_frames: int = 0    # an ICL voice clone's reference codes in the prompt (its audio input tokens)
    failure: RequestFailure | None = None
    codes: bytes | None = None       # AddRequest.return_codes: the num_frames generated frames, int32 [T, groups]


class VoiceEmbedding(msgspec.Struct, tag=True):
    """Stage 0's answer to an EmbedVoice: the x-vector as float32 bytes, or why the clip gave none."""
    request_id: str
    embedding: bytes = b""
    failure: RequestFailure | None = None


class LoRALoaded(msgspec.Struct, tag=True):
    """Stage 0's answer to a LoadLoRA: loaded (requests may name it from now on), or why not (bad input: the
    adapter's files, param `lora_path`; the name or the slots, `lora_name`)."""
    name: str
    failure: RequestFailure | None = None


class LoRAUnloaded(msgspec.Struct, tag=True):
    """Stage 0's answer to an UnloadLoRA: its slot is free, or why not (unknown, or held by requests)."""
    name: str
    failure: RequestFailure | None = None


class AudioEvent(msgspec.Struct, tag=True):
    """Stage 1 decoded some of a request's audio (the engine's `AudioOutput`, on the wire)."""
    request_id: str
    pcm: bytes                       # float32 samples at 24 kHz
    finished: bool
    failure: RequestFailure | None = None   # code2wav refused the request (finished is then True)


# bucket bounds (seconds) of the stages' histograms: an engine step takes ~1–20 ms on a GPU, 20 ms–1 s on a CPU; a
# chunk crosses the connector in microseconds unless the receiving loop is busy with a step
STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
CONNECTOR_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class DurationHistogram(msgspec.Struct):
    """Durations counted since the stage process started, in fixed buckets: counts[i] holds those ≤ bounds[i] (and
    above the bound before), the last count those above every bound; the API process exposes them as a Prometheus
    histogram."""
    bounds: list[float]
    counts: list[int]
    sum: float = 0.0

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> "DurationHistogram":
        return cls(list(bounds), [0] * (len(bounds) + 1))

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds


class StageStats(msgspec.Struct, tag=True):
    stage: str
    pid: int                         # the stage process these cumulative figures belong to
    request_ids: list[str]
    num_steps: int
    cpu_seconds: float               # the process's CPU time (the fused layout: both stages' together)
    step_durations: DurationHistogram          # time inside each engine step
    connector_chunks: int = 0                  # code2wav: connector chunks received
    connector_latencies: DurationHistogram | None = None   # code2wav: the talker's put() → the chunk taken
    unknown_chunks: int = 0              # code2wav: chunks for no registered request (aborted, or not ours),
                                         # dropped without state
    prompts_waiting_for_text: int = 0    # talker: requests with open text not yet prefilled (an ICL prefill holds
                                         # as many text tokens as the reference has frames)
    rows_waiting_for_text: int = 0       # talker: rows parked until their next text row arrives
    connector_waiting: int = 0           # talker: chunks put but waiting for a free connector slot
    connector_slots_in_use: int = 0      # talker: connector slots written and not yet released by code2wav
    connector_slot_stalls: int = 0       # talker: times every slot was held while chunks waited
    deferred_admissions: int = 0         # talker: admissions put off a step for a stream about to run dry


class StageFailed(msgspec.Struct, tag=True):
    """The stage's main loop raised; sent before the process exits."""
    stage: str
    error: str                       # the traceback, for the log
    message: str                     # "ExceptionType: text", for the failure reason users see


class Heartbeat(msgspec.Struct, tag=True):
    """Sent every HEARTBEAT_INTERVAL by a thread of each stage: the process runs (a stopped one sends none),
    and its loop is not stuck (busy_seconds: time inside the current iteration, 0 while it waits for work)."""
    stage: str
    busy_seconds: float
    connector_stalled_seconds: float = 0.0   # talker: its connector has had no free slot for this long


class SpanAligned(msgspec.Struct, tag=True):
    """The aligner stage's answer to an AlignSpan: (word, start_ms, end_ms) within the span, in text order,
    or why there are none."""
    request_id: str
    span: int
    words: list[tuple[str, int, int]] = []
    error: str | None = None


StageEvent = (Ready | TalkerDone | VoiceEmbedding | LoRALoaded | LoRAUnloaded | AudioEvent | StageStats | StageFailed
              | Heartbeat)
AlignerEvent = Ready | SpanAligned | StageFailed | Heartbeat


class AlignerLaunch(msgspec.Struct):
    """What the aligner stage process needs."""
    stage: str                       # "aligner"
    model_dir: str
    device: str
    dtype: str
    threads: int
    max_batch_size: int
    command_address: str             # the stage binds a PULL here
    event_address: str               # the orchestrator's PULL; the stage connects a PUSH
    log_level: int = 20


def stage_kind(stage: str) -> str:
    """"talker" or "code2wav": what a stage named `stage` runs. A server of several models runs a talker per model
    and a code2wav per distinct decoder; the ones past the first are named `<kind>:<model>` (`talker:base`)."""
    return stage.partition(":")[0]


class StageLaunch(msgspec.Struct):
    """Everything a stage process needs; passed as msgpack bytes to the spawned process. Its device, sizes and
    chunking are the stage config's (`config`); the supervisor adds what it works out from it."""
    stage: str                       # "talker" | "code2wav", or `<kind>:<model>` (stage_kind)
    model_dir: str
    pipeline: PipelineConfig
    max_batch_size: int              # requests run together (the talker's also bounded by its KV cache rows)
    threads: int                     # torch intra-op threads (omni_tts.config.threads)
    command_address: str             # the stage binds a PULL here
    event_address: str               # the orchestrator's PULL; the stage connects a PUSH
    connector: ConnectorSpec          # the talker → code2wav chunk connector, of the configured kind
    # code2wav of several talkers (one per model): every talker's connector, read alike (else `connector` alone)
    connectors: list[ConnectorSpec] = []
    lanes: int = 1                   # code2wav: decoder calls run at once (omni_tts.config.threads.code2wav_lanes)
    log_level: int = 20              # the omni_tts loggers' level in the stage process (logging.INFO)
    aligner: AlignerLaunch | None = None   # code2wav: the forced aligner to run on a thread of its process
    loras: dict[str, str] = {}       # talker: LoRA adapters loaded at start-up, name → PEFT directory

    @property
    def config(self) -> TalkerStageConfig | Code2WavStageConfig:
        return self.pipeline.stages.by_name()[stage_kind(self.stage)]

    @property
    def readers(self) -> list[ConnectorSpec]:
        """code2wav: the connectors whose chunks it decodes."""
        return self.connectors or [self.connector]
