"""The voice store interface: what the server asks of the store that keeps uploaded voices (Base voice cloning),
whatever keeps them. `VoiceStore` (voices/store.py), a directory every replica shares, is the default implementation.

The server uses a store only through `VoiceStoreBackend` (a typing.Protocol): `list`, `in`, `add`,
`add_embedding`, `delete`, `load` and `max_bytes`. A voice is a clip (`add`) or a speaker embedding, the speaker
encoder's x-vector, without audio (`add_embedding`). An implementation owes every replica this contract:
- every call sees the store as it is when the call starts, whichever replica wrote it: a voice uploaded, replaced
  or deleted through one replica is usable, updated or gone on every other on its next request; a `load` never
  returns a version that was replaced or deleted before the load began, and returns one version whole;
- a write is atomic and versioned: readers see the old version or the new one, whole; two writers of one name
  leave one of their versions, whole, and nothing of the other;
- `created_at` (integer unix seconds, as OpenAI's and vllm-omni's voice objects have it) increases strictly across
  the whole store, every replica's uploads together, so `(name, created_at)` — `VoiceRecord.voice_version` — names
  one version for any cache (each replica's talker caches a voice's features under it);
- names follow `validate_name` and are case-insensitive ("Fox" and "fox" are one voice; `voice_key` folds them),
  uploads pass `check_upload` (the same rules whatever keeps them), and refusals raise `VoiceError` with the
  statuses below;
- every method may block and is called in an executor (`__contains__`, `load` and `list` in the server's read pool,
  which a writer waiting on a lock never holds up; `__contains__`, asked before a request is admitted, should be
  quick).
Another store (an object store such as S3) plugs in by implementing the protocol and being constructed where
`ServerState` (api/state.py) builds the directory store. On an object store the version swap is a conditional put of
the voice's metadata object (If-Match on the ETag read, If-None-Match for a new name), `load` revalidates a cached
voice against that ETag, and `created_at` comes from a counter object advanced the same way.

Names: 1–64 characters of `[A-Za-z0-9_.-]`, not starting with `.`. A name is stored and listed as given.

Uploads are untrusted: the container is sniffed from the bytes (libsndfile), never taken from the client's file
name or MIME type, and only wav, flac, ogg/opus and mp3 are kept; `ref_text` is at most `MAX_REF_TEXT_CHARS`
characters, refused at upload rather than failing every later use; `consent` and `speaker_description` (free text
kept with the voice and listed) at most `MAX_CONSENT_CHARS` and `MAX_DESCRIPTION_CHARS`. An embedding is checked
against the served checkpoint by the server before it reaches a store (models/qwen3_tts/prompt.py,
`check_speaker_embedding`): a store keeps any finite float32 vector of 1..`MAX_EMBEDDING_VALUES` values.

Status codes (`VoiceError.status`): 400 bad name / ref_text too long / empty / undecodable / duration outside
1–30 s, 413 larger than `max_bytes` or the store's quota, 415 audio in a container outside the allow-list, 409 voice
limit reached, 500 a clip that cannot be stored, deleted or read back (the detail goes to the log).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from omni_tts.audio.ref_audio import MAX_SECONDS, MIN_SECONDS, DecodedClip, RefAudioError, decode_reference

_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")
_NAME_RULE = "voice name must be 1–64 characters of letters, digits, '_', '.' or '-', not starting with '.'"
# libsndfile container → (file extension, canonical MIME type); anything else is refused with 415
_CONTAINERS = {"WAV": (".wav", "audio/wav"), "WAVEX": (".wav", "audio/wav"), "RF64": (".wav", "audio/wav"),
               "FLAC": (".flac", "audio/flac"), "OGG": (".ogg", "audio/ogg"), "MP3": (".mp3", "audio/mpeg")}
# a transcript of a clip of at most 30 s is a few hundred characters in any language; the talker's limit in tokens
# is checked where the prompt is tokenized
MAX_REF_TEXT_CHARS = 1024
MAX_CONSENT_CHARS = 1024
MAX_UPLOAD_BYTES = 10 * 1024 * 1024   # one clip, as uploaded (the default of a store's max_bytes)
UPLOADS_DISABLED = "voice uploads are disabled (start the server with --voices-dir)"
MAX_DESCRIPTION_CHARS = 1024
MAX_PROMPT_CHARS = 2000   # a designed voice's description: OpenAI's bound
MAX_EMBEDDING_VALUES = 8192    # vllm-omni's bound; the checkpoints' x-vectors have 1024 (0.6B) or 2048 (1.7B)
EMBEDDING_MIME_TYPE = "application/octet-stream"   # an embedding voice's file: raw float32, little-endian


class VoiceError(ValueError):
    """A refused voice operation; `status` is the HTTP status, `param` the request field to blame."""

    def __init__(self, message: str, status: int = 400, param: str | None = "audio_sample") -> None:
        super().__init__(message)
        self.status, self.param = status, param


@dataclass(frozen=True)
class VoiceRecord:
    """An immutable snapshot of one version of an uploaded voice."""
    name: str                # as uploaded (lookup is case-insensitive)
    ref_text: str | None     # transcript of the clip; None → x-vector-only cloning
    created_at: int          # unix seconds, strictly increasing across the store: the voice's version
    file_size: int           # bytes of the clip as uploaded
    mime_type: str           # canonical type of the decoded container (audio/wav, audio/flac, audio/ogg, audio/mpeg)
    duration_s: float        # clip duration
    consent: str | None      # as given by the uploader
    sample_rate: int         # sample rate of the clip as uploaded (load() gives 24 kHz); 0 for an embedding voice
    path: str                # where the store keeps the clip or the embedding (a file for VoiceStore, an object
                             # key elsewhere)
    speaker_description: str | None = None   # free text from the uploader
    embedding_dim: int | None = None   # an embedding voice (no audio): its vector's length; None: a clip voice
    prompt: str | None = None          # a designed voice (type "prompt"): the description its clip was spoken from
    design_model: str | None = None    # ... and the served VoiceDesign model that spoke it

    @property
    def embedding_source(self) -> str:
        """Where the voice's x-vector comes from: its clip ("audio") or the upload itself ("embedding")."""
        return "audio" if self.embedding_dim is None else "embedding"

    @property
    def key(self) -> str:
        return self.name.lower()

    @property
    def voice_version(self) -> str:
        """Names this version's clip for caches of what is derived from it (the talker's voice features, the
        x-vector GET /v1/audio/voices/{name}/embedding answers)."""
        return f"{self.key}@{self.created_at!r}"

    def to_json(self, embedding_dim: int | None = None) -> dict:
        """The API view: the `openai` SDK's `Voice` (id, object, type, name, created_at) and vllm-omni's uploaded
        voice (name, created_at, ref_text, consent, file_size, mime_type, speaker_description, embedding_source,
        embedding_dim), plus duration_s (None for an embedding voice); a designed voice's `prompt` and
        `design_model` too. The id is the name: what DELETE /v1/audio/voices/{id} and a speech request's `voice`
        take. embedding_dim: the served checkpoint's, shown for a clip voice (the length of the x-vector its clip
        gives)."""
        audio = self.embedding_dim is None
        kind = "prompt" if self.prompt is not None else "audio_sample" if audio else "speaker_embedding"
        designed = {"prompt": self.prompt, "design_model": self.design_model} if self.prompt is not None else {}
        return {"id": self.name, "object": "audio.voice", "type": kind,
                "name": self.name, "created_at": self.created_at, "ref_text": self.ref_text,
                "consent": self.consent, "speaker_description": self.speaker_description,
                "file_size": self.file_size, "mime_type": self.mime_type,
                "duration_s": self.duration_s if audio else None, "embedding_source": self.embedding_source,
                "embedding_dim": embedding_dim if audio else self.embedding_dim} | designed


@runtime_checkable
class VoiceStoreBackend(Protocol):
    """What the server asks of a voice store; the contract every implementation owes is the module docstring's
    "Interface". Every method may block: the server calls them in an executor."""

    max_bytes: int  # the largest clip `add` takes: the server stops reading an upload's body past it

    def list(self) -> list[VoiceRecord]:
        """Every voice in the store now, sorted by name case-insensitively."""
        ...

    def __contains__(self, name: object) -> bool:
        """Whether a voice is called `name` (case-insensitive) now, quickly (asked before admission); a hint only:
        `load` decides."""
        ...

    def add(self, name: str, audio_bytes: bytes, ref_text: str | None, consent: str | None,
            speaker_description: str | None = None, design: VoiceDesign | None = None) -> VoiceRecord:
        """Check (`check_upload`) and store a clip as a new version of the voice `name`, replacing any voice of
        that name (case-insensitive); `VoiceError` when refused. `design`: the clip was designed (type "prompt")."""
        ...

    def add_embedding(self, name: str, embedding: np.ndarray, consent: str | None,
                      speaker_description: str | None = None) -> VoiceRecord:
        """Check (`check_embedding_upload`) and store a speaker embedding (the x-vector, already checked against
        the served checkpoint) as a new version of the voice `name`, as `add` stores a clip."""
        ...

    def delete(self, name: str) -> VoiceRecord | None:
        """Remove the voice called `name` (case-insensitive); the removed version, None when there is none."""
        ...

    def load(self, name: str) -> tuple[VoiceRecord, np.ndarray] | None:
        """The voice's current version and its 24 kHz float32 samples (read-only) or, for an embedding voice
        (`embedding_dim` set), its float32 x-vector; None when there is none. `VoiceError` 500 when its file
        cannot be read."""
        ...


@dataclass(frozen=True)
class VoiceDesign:
    """Where a designed voice's clip comes from: the description it was spoken from, by the VoiceDesign model."""
    prompt: str
    model: str


@dataclass(frozen=True)
class CheckedUpload:
    """An upload that passed every check, ready for a store to keep."""
    name: str
    audio: bytes             # the clip exactly as uploaded
    ref_text: str | None     # stripped; None when blank
    consent: str | None
    speaker_description: str | None
    samples: np.ndarray      # 24 kHz mono float32, read-only
    sample_rate: int         # of the clip as uploaded
    duration_s: float
    container: str           # libsndfile's format and subtype
    subtype: str

    @property
    def extension(self) -> str:
        return _CONTAINERS[self.container][0]

    @property
    def mime_type(self) -> str:
        return _CONTAINERS[self.container][1]


def validate_name(name: str) -> str:
    """The name unchanged if valid; `VoiceError` (a ValueError, status 400, param 'name') otherwise."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise VoiceError(_NAME_RULE, 400, "name")
    return name


def _check_text(field: str, value: str | None, limit: int, strip: bool = False) -> str | None:
    """A free-text field of an upload: a string of at most `limit` characters (stripped, blank → None, when
    `strip`), or VoiceError naming it."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise VoiceError(f"{field} must be a string", 400, field)
    if strip:
        value = value.strip() or None
    if value is not None and len(value) > limit:
        raise VoiceError(f"{field} is longer than {limit} characters", 400, field)
    return value


def check_embedding_upload(name: str, embedding: np.ndarray, consent: str | None,
                           speaker_description: str | None) -> tuple[np.ndarray, str | None, str | None]:
    """What a store checks of an embedding voice: (the vector as read-only float32, consent, description), or
    VoiceError. Its length and values against the checkpoint are the server's to check before."""
    validate_name(name)
    vector = np.array(embedding, dtype=np.float32)
    if vector.ndim != 1 or not 1 <= vector.shape[0] <= MAX_EMBEDDING_VALUES or not np.isfinite(vector).all():
        raise VoiceError(f"speaker_embedding must be 1 to {MAX_EMBEDDING_VALUES} finite numbers", 400,
                         "speaker_embedding")
    vector.flags.writeable = False
    return (vector, _check_text("consent", consent, MAX_CONSENT_CHARS),
            _check_text("speaker_description", speaker_description, MAX_DESCRIPTION_CHARS))


def check_audio(audio_bytes: bytes, *, max_bytes: int, min_seconds: float = MIN_SECONDS,
                max_seconds: float = MAX_SECONDS, field: str = "audio_sample") -> DecodedClip:
    """An uploaded clip's checks (size, duration, an allowed container), its samples read-only; `VoiceError`
    naming `field` with the status to answer. Blocking (decodes the clip)."""
    _check_size(audio_bytes, max_bytes, field)
    try:
        clip = decode_reference(audio_bytes, min_seconds=min_seconds, max_seconds=max_seconds, label=field)
    except RefAudioError as e:
        raise VoiceError(str(e), e.status, field) from None
    if clip.format not in _CONTAINERS:
        raise VoiceError(f"{field} is {clip.format} audio; upload wav, flac, ogg or mp3", 415, field)
    clip.samples.flags.writeable = False
    return clip


def _check_size(audio_bytes: bytes, max_bytes: int, field: str) -> None:
    if len(audio_bytes) > max_bytes:
        raise VoiceError(f"{field} is larger than the {max_bytes}-byte limit ({max_bytes / 2**20:g} MiB)", 413,
                         field)
    if not audio_bytes:
        raise VoiceError(f"{field} is empty (0 bytes)", 400, field)


def container_file(clip: DecodedClip) -> tuple[str, str]:
    """A checked clip's (file extension, canonical MIME type), from its sniffed container."""
    return _CONTAINERS[clip.format]


def check_upload(name: str, audio_bytes: bytes, ref_text: str | None, consent: str | None,
                 speaker_description: str | None = None, *, max_bytes: int, min_seconds: float = MIN_SECONDS,
                 max_seconds: float = MAX_SECONDS, design: VoiceDesign | None = None) -> CheckedUpload:
    """Every check an upload passes before any store keeps it; `VoiceError` with the status to answer. Blocking
    (decodes the clip)."""
    validate_name(name)
    audio_bytes = bytes(audio_bytes)
    _check_size(audio_bytes, max_bytes, "audio_sample")
    ref_text = _check_text("ref_text", ref_text, MAX_REF_TEXT_CHARS, strip=True)
    consent = _check_text("consent", consent, MAX_CONSENT_CHARS)
    speaker_description = _check_text("speaker_description", speaker_description, MAX_DESCRIPTION_CHARS)
    if design is not None:
        _check_text("prompt", design.prompt, MAX_PROMPT_CHARS)
    clip = check_audio(audio_bytes, max_bytes=max_bytes, min_seconds=min_seconds, max_seconds=max_seconds)
    return CheckedUpload(name=name, audio=audio_bytes, ref_text=ref_text, consent=consent,
                         speaker_description=speaker_description, samples=clip.samples,
                         sample_rate=clip.source_rate, duration_s=round(clip.duration_s, 3), container=clip.format,
                         subtype=clip.subtype)


def voice_key(name: object) -> str | None:
    """What a voice name is looked up by (case-folded), or None for anything that is not a valid name: a store
    touches nothing for those."""
    return name.lower() if isinstance(name, str) and _NAME.fullmatch(name) else None
