"""Uploaded voices (Base voice cloning): one folder per voice under the voices dir, restored at start-up.

Each voice keeps the clip as uploaded plus `meta.json`. `get` returns an immutable snapshot, so a request that
looked a voice up keeps a usable record even if the voice is deleted or replaced right after (lookup and
validation are atomic with respect to deletion). Decoded 24 kHz samples are cached, bounded by bytes.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from omni_tts.audio.ref_audio import RefAudioError, decode_clip

logger = logging.getLogger(__name__)
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_EXTENSIONS = {".wav": "audio/wav", ".flac": "audio/flac", ".ogg": "audio/ogg", ".mp3": "audio/mpeg"}


class VoiceError(ValueError):
    def __init__(self, message: str, status: int = 400, param: str = "audio_sample") -> None:
        super().__init__(message)
        self.status, self.param = status, param


@dataclass(frozen=True)
class VoiceRecord:
    name: str
    ref_text: str | None
    created_at: float
    file_size: int
    mime_type: str
    duration_s: float
    consent: str | None
    path: str

    def to_json(self) -> dict:
        data = asdict(self)
        data.pop("path")
        return data


class VoiceStore:
    def __init__(self, root_dir: str, max_voices: int = 1000, max_bytes: int = 10 * 1024 * 1024,
                 cache_bytes: int = 256 * 1024 * 1024) -> None:
        self.root, self.max_voices, self.max_bytes, self.cache_bytes = root_dir, max_voices, max_bytes, cache_bytes
        os.makedirs(root_dir, exist_ok=True)
        self._lock = threading.Lock()
        self._voices: dict[str, VoiceRecord] = {}
        self._cache: collections.OrderedDict[tuple[str, float], np.ndarray] = collections.OrderedDict()
        for entry in sorted(os.listdir(root_dir)):
            meta = os.path.join(root_dir, entry, "meta.json")
            try:
                with open(meta, encoding="utf-8") as f:
                    record = VoiceRecord(**json.load(f), path="")
                record = VoiceRecord(**{**asdict(record), "path": os.path.join(root_dir, entry, "clip")})
                if not os.path.isfile(record.path):
                    raise FileNotFoundError(record.path)
                self._voices[record.name.lower()] = record
            except (OSError, ValueError, TypeError) as e:
                if not entry.startswith("."):
                    logger.warning("skipping unreadable voice %s: %s", entry, e)

    @staticmethod
    def validate_name(name: str) -> str:
        if not _NAME.match(name or ""):
            raise VoiceError("voice name must be 1–64 characters of letters, digits, '_', '.', '-' and not start "
                             "with '.' or '-'", param="name")
        return name

    def add(self, name: str, audio: bytes, filename: str, mime_type: str, ref_text: str | None,
            consent: str | None) -> VoiceRecord:
        """Validate and store a clip (replacing a voice of the same name). Runs in an executor: decodes audio."""
        self.validate_name(name)
        if len(audio) > self.max_bytes:
            raise VoiceError(f"audio_sample larger than {self.max_bytes} bytes", 413)
        extension = os.path.splitext(filename or "")[1].lower()
        if extension and extension not in _EXTENSIONS:
            raise VoiceError(f"audio_sample type {extension!r} is not supported; use one of "
                             f"{', '.join(sorted(_EXTENSIONS))}", 415)
        try:
            samples = decode_clip(audio)
        except RefAudioError as e:
            raise VoiceError(str(e).replace("ref_audio", "audio_sample"), e.status) from None
        with self._lock:
            key = name.lower()
            if key not in self._voices and len(self._voices) >= self.max_voices:
                raise VoiceError(f"voice limit reached ({self.max_voices}); delete one first", 409, "name")
            previous = self._voices.get(key)
            created = max(time.time(), (previous.created_at + 1e-6) if previous else 0.0)
            folder = os.path.join(self.root, key)
            staging = tempfile.mkdtemp(prefix=".upload-", dir=self.root)
            record = VoiceRecord(name=name, ref_text=ref_text, created_at=created, file_size=len(audio),
                                 mime_type=_EXTENSIONS.get(extension, mime_type or "application/octet-stream"),
                                 duration_s=round(samples.shape[0] / 24000, 3), consent=consent,
                                 path=os.path.join(folder, "clip"))
            with open(os.path.join(staging, "clip"), "wb") as f:
                f.write(audio)
            with open(os.path.join(staging, "meta.json"), "w", encoding="utf-8") as f:
                json.dump(record.to_json(), f)
            if os.path.isdir(folder):
                shutil.rmtree(folder)
            os.rename(staging, folder)
            self._voices[key] = record
            self._remember((key, created), samples)
            return record

    def get(self, name: str) -> VoiceRecord | None:
        with self._lock:
            return self._voices.get(name.lower())

    def samples(self, record: VoiceRecord) -> np.ndarray:
        """24 kHz samples of a snapshot (cached; decoded from the snapshot's file otherwise)."""
        key = (record.name.lower(), record.created_at)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            with open(record.path, "rb") as f:
                samples = decode_clip(f.read())
        except OSError:
            raise VoiceError(f"voice '{record.name}' was deleted", 404, "voice") from None
        with self._lock:
            self._remember(key, samples)
        return samples

    def _remember(self, key: tuple[str, float], samples: np.ndarray) -> None:
        self._cache[key] = samples
        while sum(s.nbytes for s in self._cache.values()) > self.cache_bytes and len(self._cache) > 1:
            self._cache.popitem(last=False)

    def delete(self, name: str) -> bool:
        with self._lock:
            record = self._voices.pop(name.lower(), None)
            if record is None:
                return False
            shutil.rmtree(os.path.dirname(record.path), ignore_errors=True)
            return True

    def list(self) -> list[VoiceRecord]:
        with self._lock:
            return sorted(self._voices.values(), key=lambda r: r.name.lower())
