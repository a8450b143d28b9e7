"""The server's and the narrator's settings, one dataclass per concern, each default, help and bound stated once:
`omni-tts serve`'s, `serve-ray`'s and `narrate`'s options are made from them (options.py), the API server's config
is `ApiSettings` (entrypoints/api/server_config.py), and the orchestrator's defaults read them. Torch-free, so
every layer may import them."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated

import msgspec

from .options import port_number, setting
from .stage_config import PositiveInt

MIB = 2**20
# OpenAI Realtime: the sentences of `instructions` that ask a voice LLM to read the text as it is (what this server
# does anyway), dropped from the style prompt
VERBATIM_PATTERN = (r"verbatim|word[- ]for[- ]word|exactly as (written|given|provided)|nothing else|"
                    r"as (it is )?written|do not (add|change|alter|paraphrase|reword)|"
                    r"\b(read|say|speak|repeat)( it| this| them)?( aloud| out loud)? "
                    r"(back|exactly|only|what|the (following|user|text|input|message))")
# a speech request's input, narrated when longer than one segment: --max-input-chars is checked against it; the
# request schema's bound, which stops a body's string before it is decoded whole
MAX_INPUT_CHARS = 4_000_000
MAX_PAUSE_MS = 10_000      # a narration's pauses, as the CLI and a request may set them
MIN_SEGMENT_CHARS = 20     # a narration's segments: a shorter limit would cut most sentences into words
PauseMs = Annotated[int, msgspec.Meta(ge=0, le=MAX_PAUSE_MS)]
SegmentChars = Annotated[int, msgspec.Meta(ge=MIN_SEGMENT_CHARS)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]


@dataclass(kw_only=True)
class NarrationSettings:
    """Long-form narration (orchestrator/narration.py): `omni-tts narrate`'s options, the defaults of a narrated
    speech request and of the server's narration options."""
    sentence_pause_ms: PauseMs = setting(250, "silence after a segment that ends a sentence")
    paragraph_pause_ms: PauseMs = setting(750, "silence after a paragraph")
    segment_chars: SegmentChars = setting(300, "segments (one talker request each) hold at most this many "
                                               "characters")
    window: PositiveInt = setting(3, "segments in flight at once, the one being written included")


@dataclass(kw_only=True)
class ListenerSettings:
    """Where `omni-tts serve` listens, and how long its connections may idle."""
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "TCP port to listen on; 0 = any free port", type=port_number)
    keepalive_timeout: Seconds = setting(30.0, "seconds an idle connection stays open, and the most a request's "
                                               "headers may take to arrive (a client that never finishes them is cut "
                                               "off)")


@dataclass(kw_only=True)
class ApiSettings:
    """What the HTTP API takes and how long it waits (the API server's config, entrypoints/api/config.py, is these
    and what the server made of its other options)."""
    openai_aliases: bool = setting(True, "do not answer to OpenAI's TTS model names (tts-1, tts-1-hd, "
                                         "gpt-4o-mini-tts, gpt-4o-mini-tts-2025-12-15), as the server does by default",
                                   flag="--no-openai-aliases")
    default_voice: str | None = setting(None, "CustomVoice: the voice of requests that name none, a speaker or an "
                                              "OpenAI voice name (default: the checkpoint's first speaker)")
    strict_fields: bool = setting(False, "answer 400 to a speech request field the server does not know (default: "
                                         "ignore it, log one warning and name it in the x-omni-tts-ignored-fields "
                                         "response header)")
    max_queue: PositiveInt = setting(256, "admitted requests beyond which the server answers 429")
    voices_dir: str | None = setting(None, "where uploaded voices are kept (enables POST /v1/audio/voices); "
                                           "replicas given the same directory share them (default: none: no uploads)")
    allowed_local_media_path: str | None = setting(None, "directory ref_audio may name local files in (default: "
                                                         "none: no local files)")
    voices_quota_mb: PositiveInt = setting(1024, "total size of the uploaded voices' clips, in MiB; uploads beyond "
                                                 "are answered 413")
    allowed_origins: tuple[str, ...] = setting((), "browser origins (scheme://host[:port], or *) that may call the "
                                                   "API across origins (CORS); default: none",
                                               nargs="+", metavar="ORIGIN")
    body_read_timeout: Seconds = setting(30.0, "seconds a request body may take to arrive before the server answers "
                                               "408")
    first_audio_timeout: Seconds = setting(120.0, "seconds an admitted request may wait for its first audio before a "
                                                  "503")
    request_timeout: Seconds = setting(1800.0, "seconds a request may run before it is ended (504, or a cut stream)")
    max_input_chars: Annotated[int, msgspec.Meta(ge=1, le=MAX_INPUT_CHARS)] = setting(
        200_000, "the longest speech input, in characters; an input longer than one segment is narrated")
    segment_chars: SegmentChars = setting(NarrationSettings.segment_chars, "a narrated input's segments (one talker "
                                          "request each) hold at most this many characters")
    narration_window: PositiveInt = setting(NarrationSettings.window, "a narration's segments in flight at once, the "
                                            "one being delivered included")
    stream_idle_timeout: Seconds = setting(30.0, "WS /v1/audio/speech/stream: seconds without a message (or, in "
                                                 "token mode, without text for an unfinished utterance) before the "
                                                 "session ends")
    realtime_verbatim_pattern: str = setting(VERBATIM_PATTERN, "OpenAI Realtime: a regular expression (case-"
                                             "insensitive); the sentences of a session's instructions it matches "
                                             "(by default, those asking to read the text verbatim) are dropped "
                                             "before the rest becomes the style prompt; '' keeps them all",
                                             metavar="REGEX")

    def __post_init__(self) -> None:
        try:
            re.compile(self.realtime_verbatim_pattern)
        except re.error as e:
            raise ValueError(f"--realtime-verbatim-pattern is not a regular expression: {e}") from None

    @property
    def voices_quota_bytes(self) -> int:
        return self.voices_quota_mb * MIB


@dataclass(frozen=True, kw_only=True)
class SupervisionSettings:
    """How stage processes, the pipeline's and the forced aligner's, are watched and restarted
    (orchestrator/processes.py)."""
    startup_timeout: float = 300.0   # seconds a stage process may take to load (to report Ready)
    heartbeat_timeout: Seconds = setting(5.0, "seconds without a heartbeat before a stage counts as hung and the "
                                              "pipeline restarts (the forced aligner: it alone restarts)",
                                         flag="--stage-heartbeat-timeout")
    step_timeout: float = 120.0      # seconds one loop iteration of a stage may take (a deadlocked step)
    # seconds the talker's connector may have every slot held with chunks waiting (slots lost, or code2wav not
    # reading) before the pipeline counts as hung and restarts (a restart gets the slots back)
    connector_stall_timeout: float = 20.0
    # seconds a request may go without audio once stage 0 made its last frame: its last chunk lost, it fails then
    last_audio_timeout: float = 30.0
    restart_window: float = 600.0    # seconds over which restarts are counted against max_restarts
    max_restarts: Annotated[int, msgspec.Meta(ge=0)] = setting(
        5, f"pipeline restarts within {restart_window / 60:g} minutes beyond which the server gives up and exits 1 "
           "(serve-ray: the replica fails its health checks, and Ray replaces it); the forced aligner, beyond as many "
           "restarts of its own, stays down (no word timestamps)")
    max_backoff: float = 30.0        # seconds before a start that follows failed ones: 1, 2, 4, … up to this

    def backoff(self, failed_starts: int) -> float:
        """Seconds to wait before a start: none after a failure, then doubling from 1 s with each start that
        failed."""
        return 0.0 if failed_starts == 0 else min(2.0 ** (failed_starts - 1), self.max_backoff)
