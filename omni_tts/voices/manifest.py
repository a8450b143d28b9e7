"""--voices-manifest FILE: voices prepared offline, loaded and checked once at start-up, read-only while the server
runs.

The file (JSON, or YAML when it ends in .yaml / .yml) lists the voices:

    {"voices": [{"name": "narrator", "audio": "clips/narrator.wav", "ref_text": "...", "consent": "..."},
                {"name": "mixed", "embedding": [0.01, -0.2, ...]}]}

Each entry has one source: `audio`, a clip (a path relative to the manifest's folder, or absolute), or
`embedding`, the speaker encoder's vector (as `GET /v1/audio/voices/{name}/embedding` gives it: x-vector-only
cloning). `ref_text` (a clip's transcript: in-context cloning, else x-vector), `consent` and `speaker_description`
are optional. Each entry passes the checks an upload passes (`backend.check_upload` for a clip: name, size,
container, 1–30 s, text lengths; `prompt.check_speaker_embedding` against the served checkpoint for a vector), and
names are unique case-insensitively; the first entry that fails stops the server with one line naming it. Base
checkpoints only.

`VoicesWithManifest` serves them through the voice store interface (`VoiceStoreBackend`) in front of the uploaded
voices' store, if any: listed with them (marked `read_only`), spoken by name as they are, and never replaced or
deleted (409). A manifest voice hides an uploaded voice of the same name. The clips' samples stay in memory
(~94 KiB per second of clip).
"""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Annotated

import msgspec
import msgspec.yaml
import numpy as np

from omni_tts.voices.backend import (EMBEDDING_MIME_TYPE, MAX_UPLOAD_BYTES, UPLOADS_DISABLED, VoiceDesign,
                                                VoiceError, VoiceRecord, VoiceStoreBackend, check_embedding_upload,
                                                check_upload, voice_key)
from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
from omni_tts.models.qwen3_tts.prompt import RequestError, check_speaker_embedding

logger = logging.getLogger(__name__)

MAX_MANIFEST_VOICES = 1000


class ManifestEntry(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    audio: str | None = None
    embedding: list[float] | None = None
    ref_text: str | None = None
    consent: str | None = None
    speaker_description: str | None = None


class Manifest(msgspec.Struct, forbid_unknown_fields=True):
    voices: Annotated[list[ManifestEntry], msgspec.Meta(max_length=MAX_MANIFEST_VOICES)]


@dataclass(frozen=True, kw_only=True)
class ManifestVoice(VoiceRecord):
    """A manifest voice: its version is its clip's content, so no cache can take it for an uploaded version."""
    digest: str   # sha256 of the clip, hex

    @property
    def voice_version(self) -> str:
        return f"{self.key}@manifest-{self.digest[:16]}"

    def to_json(self, embedding_dim: int | None = None) -> dict:
        return super().to_json(embedding_dim) | {"read_only": True}


# key → the voice and its 24 kHz float32 samples (read-only)
VoiceManifest = dict[str, tuple[ManifestVoice, np.ndarray]]


def load_voices_manifest(path: str, config: Qwen3TTSConfig) -> VoiceManifest:
    """The manifest's voices, each checked against the served checkpoint's `config`; ValueError, one line naming
    the file and the entry, for the first problem."""
    where = f"--voices-manifest {path}"
    if config.tts_model_type != "base":
        raise ValueError(f"{where}: manifest voices need a Base (voice clone) checkpoint; this one is "
                         f"{config.tts_model_type}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
            created_at = int(os.fstat(f.fileno()).st_mtime)  # listed as the voices' created_at
    except OSError as e:
        raise ValueError(f"{where}: cannot read it: {e.strerror}") from None
    decode = msgspec.yaml.decode if path.lower().endswith((".yaml", ".yml")) else msgspec.json.decode
    try:
        manifest = decode(raw, type=Manifest)
    except msgspec.DecodeError as e:  # a YAML parser's message spans lines
        raise ValueError(f"{where}: {' '.join(str(e).split())}") from None
    folder = os.path.dirname(os.path.abspath(path))
    voices: VoiceManifest = {}
    for index, entry in enumerate(manifest.voices):
        label = f"{where}: voices[{index}] ({entry.name!r})"
        try:
            if (entry.audio is None) == (entry.embedding is None):
                raise ValueError("give one source: audio (a clip) or embedding (a speaker encoder vector)")
            voice = (_clip_voice(entry, folder, created_at) if entry.audio is not None else
                     _embedding_voice(entry, config, path, created_at))
        except (ValueError, VoiceError) as e:
            raise ValueError(f"{label}: {e}") from None
        key = voice_key(entry.name)
        if key in voices:
            raise ValueError(f"{label}: the name is given twice (names are case-insensitive)")
        voices[key] = voice
    logger.info("voices: %d read-only voice(s) from %s", len(voices), path)
    return voices


def _clip_voice(entry: ManifestEntry, folder: str, created_at: int) -> tuple[ManifestVoice, np.ndarray]:
    clip_path = os.path.join(folder, entry.audio)
    try:
        with open(clip_path, "rb") as f:
            audio = f.read()
    except OSError as e:
        raise ValueError(f"cannot read audio {entry.audio!r}: {e.strerror}") from None
    upload = check_upload(entry.name, audio, entry.ref_text, entry.consent, entry.speaker_description,
                          max_bytes=MAX_UPLOAD_BYTES)
    record = ManifestVoice(name=entry.name, ref_text=upload.ref_text, created_at=created_at, file_size=len(audio),
                           mime_type=upload.mime_type, duration_s=upload.duration_s, consent=upload.consent,
                           sample_rate=upload.sample_rate, path=clip_path,
                           speaker_description=upload.speaker_description, digest=hashlib.sha256(audio).hexdigest())
    return record, upload.samples


def _embedding_voice(entry: ManifestEntry, config: Qwen3TTSConfig, path: str,
                     created_at: int) -> tuple[ManifestVoice, np.ndarray]:
    try:
        vector = check_speaker_embedding(config, entry.embedding, ref_audio=False, ref_text=entry.ref_text is not None)
    except RequestError as e:
        raise ValueError(str(e)) from None
    vector, consent, description = check_embedding_upload(entry.name, vector, entry.consent, entry.speaker_description)
    data = vector.astype("<f4").tobytes()
    record = ManifestVoice(name=entry.name, ref_text=None, created_at=created_at, file_size=len(data),
                           mime_type=EMBEDDING_MIME_TYPE, duration_s=0.0, consent=consent, sample_rate=0, path=path,
                           speaker_description=description, embedding_dim=vector.shape[0],
                           digest=hashlib.sha256(data).hexdigest())
    return record, vector


class VoicesWithManifest:
    """`VoiceStoreBackend`: the manifest's voices, read-only, in front of the uploaded voices' store (None: uploads
    are disabled)."""

    def __init__(self, manifest: VoiceManifest, store: VoiceStoreBackend | None) -> None:
        self.manifest, self.store = manifest, store
        self.max_bytes = store.max_bytes if store is not None else MAX_UPLOAD_BYTES

    def list(self) -> list[VoiceRecord]:
        uploaded = [r for r in self.store.list() if r.key not in self.manifest] if self.store is not None else []
        return sorted([record for record, _ in self.manifest.values()] + uploaded, key=lambda r: (r.key, r.name))

    def __contains__(self, name: object) -> bool:
        return voice_key(name) in self.manifest or (self.store is not None and name in self.store)

    def add(self, name: str, audio_bytes: bytes, ref_text: str | None, consent: str | None,
            speaker_description: str | None = None, design: VoiceDesign | None = None) -> VoiceRecord:
        return self._writable(name).add(name, audio_bytes, ref_text, consent, speaker_description, design)

    def add_embedding(self, name: str, embedding: np.ndarray, consent: str | None,
                      speaker_description: str | None = None) -> VoiceRecord:
        return self._writable(name).add_embedding(name, embedding, consent, speaker_description)

    def _writable(self, name: str) -> VoiceStoreBackend:
        """The store that takes a new version of `name`: refused for a manifest voice, or when uploads are off."""
        self._refuse_read_only(name, "replaced")
        if self.store is None:
            raise VoiceError(UPLOADS_DISABLED, 404, None)
        return self.store

    def delete(self, name: str) -> VoiceRecord | None:
        self._refuse_read_only(name, "deleted")
        return self.store.delete(name) if self.store is not None else None

    def load(self, name: str) -> tuple[VoiceRecord, np.ndarray] | None:
        found = self.manifest.get(voice_key(name))
        if found is not None:
            return found
        return self.store.load(name) if self.store is not None else None

    def _refuse_read_only(self, name: str, verb: str) -> None:
        found = self.manifest.get(voice_key(name))
        if found is not None:
            raise VoiceError(f"voice '{found[0].name}' comes from --voices-manifest and is read-only: it cannot be "
                             f"{verb} (edit the manifest and restart the server)", 409, "name")
