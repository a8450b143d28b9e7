"""What the front end hands its callers: the chunks of a request's audio, its usage, and the errors that end it.
The HTTP layer maps these errors to statuses in one place (`entrypoints/api/errors.py`); `RequestError` (bad input) comes from
the prompt builder and is re-exported here so callers import every pipeline error from one module. A stage reports
a failed request as a `RequestFailure` of a kind; `stage_error` is the one place that kind becomes an error."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omni_tts.models.qwen3_tts.prompt import RequestError
from omni_tts.stages.messages import FailureKind, RequestFailure

__all__ = ["PIPELINE_ERRORS", "EngineShutDown", "PipelineError", "RequestError", "RequestFailed", "RequestTimedOut",
           "SegmentEnd", "SegmentStart", "SpeechChunk", "StageDeadError", "Usage", "stage_error"]


class StageDeadError(RuntimeError):
    """A stage failed (or the pipeline is restarting / shut down): in-flight requests fail with this."""


class EngineShutDown(StageDeadError):
    """The engine is shutting down (or shut down): nothing will serve the request again, so no caller retries it."""


class RequestFailed(RuntimeError):
    """A stage rejected or failed this request (the others keep running)."""


class RequestTimedOut(RequestFailed):
    """No first audio within `first_audio_timeout` (the server is overloaded) or no end within `timeout`."""

    def __init__(self, message: str, before_first_audio: bool) -> None:
        super().__init__(message)
        self.before_first_audio = before_first_audio

    def __reduce__(self):  # pickled whole: serve-ray sends it from a replica to the API process
        return type(self), (str(self), self.before_first_audio)


# the errors that end a request with a message for its client (RequestTimedOut is a RequestFailed); any other
# exception out of the pipeline is a bug
PipelineError = RequestError | StageDeadError | RequestFailed
PIPELINE_ERRORS = (RequestError, StageDeadError, RequestFailed)


def stage_error(failure: RequestFailure) -> RequestError | RequestFailed:
    """A stage's failed request as its caller sees it: bad input is a RequestError naming the field (HTTP 400,
    never retried), an internal failure a RequestFailed (500)."""
    if failure.kind is FailureKind.BAD_INPUT:
        return RequestError(failure.param, failure.message)
    return RequestFailed(failure.message)


@dataclass
class Usage:
    input_tokens: int        # text tokens of the input
    prompt_rows: int         # talker prefill positions
    reference_frames: int    # an ICL voice clone's reference codec frames in the prompt (audio input tokens)
    output_frames: int
    audio_seconds: float
    finish_reason: str       # "stop" | "length"


@dataclass(frozen=True)
class SegmentStart:
    """A narration's segment begins (orchestrator/narration.py): on the chunk with its first audio."""
    index: int
    text: str
    audio_offset: float      # seconds of the narration's audio before it
    total: int | None        # the narration's segments, when known


@dataclass(frozen=True)
class SegmentEnd:
    """A narration's segment is whole: on the chunk after its last audio, which holds the pause that follows it."""
    index: int
    text: str
    audio_offset: float
    duration: float          # seconds of its own audio (the pause not included)
    usage: Usage             # its request's (finish_reason "length": cut at its token limit)
    attempts: int            # 2 when its first try failed and a second one made it


@dataclass
class SpeechChunk:
    """A piece of a request's audio as the front end yields it."""
    audio: np.ndarray        # float32 or int16 samples at 24 kHz
    usage: Usage | None = None   # only on the final chunk (whose audio may be empty)
    codes: np.ndarray | None = None   # generate(return_codes=True), on the final chunk: the generated codes
                                      # [output_frames, 16] int32 that the audio was decoded from (no EOS)
    replica: str | None = None   # serve-ray: the replica that serves the request, on its first chunk
    segment: SegmentStart | SegmentEnd | None = None   # a narration's progress
