"""--voices-manifest FILE: voices prepared offline, loaded and checked once at start-up, read-only while the server
runs.

The file (JSON, or YAML when it ends in .yaml / .yml) lists the voices:

    {"voices": [{"name": "narrator", "audio": "clips/narrator.wav", "ref_text": "...", "consent": "..."}]}

`audio` is a path relative to the manifest's folder (or absolute); `ref_text` (the clip's transcript: in-context
cloning, else x-vector) and `consent` are optional. Each entry passes the checks an upload passes
(`voice_backend.check_upload`: name, size, container, 1–30 s, text lengths), and names are unique
case-insensitively; the first entry that fails stops the server with one line naming it. An entry is one object
with one source field, so an `embedding` entry (a speaker-encoder vector instead of a clip) can join `audio` later
without changing the others. Base checkpoints only.

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

from omni_tts.entrypoints.voice_backend import (MAX_UPLOAD_BYTES, UPLOADS_DISABLED, VoiceError, VoiceRecord,
                                                VoiceStoreBackend, check_upload, voice_key)

logger = logging.getLogger(__name__)

MAX_MANIFEST_VOICES = 1000


class ManifestEntry(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    audio: str
    ref_text: str | None = None
    consent: str | None = None


class Manifest(msgspec.Struct, forbid_unknown_fields=True):
    voices: Annotated[list[ManifestEntry], msgspec.Meta(max_length=MAX_MANIFEST_VOICES)]


@dataclass(frozen=True, kw_only=True)
class ManifestVoice(VoiceRecord):
    """A manifest voice: its version is its clip's content, so no cache can take it for an uploaded version."""
    digest: str   # sha256 of the clip, hex

    @property
    def voice_version(self) -> str:
        return f"{self.key}@manifest-{self.digest[:16]}"

    def to_json(self) -> dict:
        return super().to_json() | {"read_only": True}


# key → the voice and its 24 kHz float32 samples (read-only)
VoiceManifest = dict[str, tuple[ManifestVoice, np.ndarray]]


def load_voices_manifest(path: str, model_type: str) -> VoiceManifest:
    """The manifest's voices, each checked; ValueError, one line naming the file and the entry, for the first
    problem."""
    where = f"--voices-manifest {path}"
    if model_type != "base":
        raise ValueError(f"{where}: manifest voices need a Base (voice clone) checkpoint; this one is {model_type}")
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
        clip_path = os.path.join(folder, entry.audio)
        try:
            with open(clip_path, "rb") as f:
                audio = f.read()
        except OSError as e:
            raise ValueError(f"{label}: cannot read audio {entry.audio!r}: {e.strerror}") from None
        try:
            upload = check_upload(entry.name, audio, entry.ref_text, entry.consent, max_bytes=MAX_UPLOAD_BYTES)
        except VoiceError as e:
            raise ValueError(f"{label}: {e}") from None
        key = voice_key(entry.name)
        if key in voices:
            raise ValueError(f"{label}: the name is given twice (names are case-insensitive)")
        record = ManifestVoice(name=entry.name, ref_text=upload.ref_text, created_at=created_at,
                               file_size=len(audio), mime_type=upload.mime_type, duration_s=upload.duration_s,
                               consent=upload.consent, sample_rate=upload.sample_rate, path=clip_path,
                               digest=hashlib.sha256(audio).hexdigest())
        voices[key] = (record, upload.samples)
    logger.info("voices: %d read-only voice(s) from %s", len(voices), path)
    return voices


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

    def add(self, name: str, audio_bytes: bytes, ref_text: str | None, consent: str | None) -> VoiceRecord:
        self._refuse_read_only(name, "replaced")
        if self.store is None:
            raise VoiceError(UPLOADS_DISABLED, 404, None)
        return self.store.add(name, audio_bytes, ref_text, consent)

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
