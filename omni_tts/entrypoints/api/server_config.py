"""What the API server is told at start-up (`omni-tts serve` builds it from its options)."""
from __future__ import annotations

from dataclasses import dataclass

from omni_tts.audio.url_fetch import UrlPolicy
from omni_tts.orchestrator.aligner_client import AlignerClient
from omni_tts.orchestrator.segmenter import NARRATION_WINDOW, SEGMENT_CHARS
from omni_tts.entrypoints.api.names import accepted_model_names
from omni_tts.voices.store import QUOTA_BYTES
from omni_tts.voices.manifest import VoiceManifest


@dataclass
class ServerConfig:
    served_model_names: tuple[str, ...]        # the `model` values clients send; the first is the primary
    openai_model_aliases: bool = True          # also answer to OpenAI's TTS model names (names.OPENAI_TTS_MODELS)
    default_voice: str | None = None           # CustomVoice: the voice of a request that names none (None: the
                                               # checkpoint's first speaker)
    strict_fields: bool = False                # a speech request's unknown field is a 400, not ignored
    max_queue: int = 256                       # admitted requests (running + waiting); beyond → 429
    voices_dir: str | None = None
    voices_manifest: VoiceManifest | None = None   # --voices-manifest's voices, loaded and checked
    allowed_local_media_path: str | None = None
    ref_audio_urls: UrlPolicy | None = None    # where http(s) ref_audio may lead; None: URLs are refused
    voices_quota_bytes: int = QUOTA_BYTES      # all uploaded clips together; beyond → 413
    api_key: str | None = None                 # when set, every route but openapi.OPEN_PATHS needs the key
    allowed_origins: tuple[str, ...] = ()      # CORS: browser origins that may call the API ("*": any)
    body_read_timeout: float = 30.0            # seconds for a request body to arrive; beyond → 408
    first_audio_timeout: float = 120.0         # seconds from admission to first audio; beyond → 503 (overloaded)
    request_timeout: float = 1800.0            # seconds from admission to the last audio; beyond → 504 / cut stream
    aligner: AlignerClient | None = None       # the forced aligner (word_timestamps), started with the app; None:
                                               # the field is refused
    max_input_chars: int = 200_000             # a speech request's input; a longer one is a 400
    segment_chars: int = SEGMENT_CHARS                   # a narrated input's segments: at most this many characters each
    narration_window: int = NARRATION_WINDOW                  # a narration's segments in flight (the one delivered included)
    stream_idle_timeout: float = 30.0          # WS /v1/audio/speech/stream: seconds between messages, and of a
                                               # token-mode request without text, beyond which the session ends

    @property
    def model_names(self) -> tuple[str, ...]:
        return accepted_model_names(self.served_model_names, self.openai_model_aliases)
