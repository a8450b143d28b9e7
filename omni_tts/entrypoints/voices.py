"""Uploaded voices (Base voice cloning): one folder per voice under the voices dir, restored at start-up.

Layout: `<root>/<name lower-cased>/meta.json` plus the clip exactly as uploaded, `clip-<version><ext>` (the
extension follows the decoded container, never the client's file name). A write puts the clip under a fresh
version name and then swaps `meta.json` with an atomic rename, so a crash leaves either the old or the new voice,
never a half-written one; unreferenced clips and temp files are cleaned at start-up.

Names: 1–64 characters of `[A-Za-z0-9_.-]`, not starting with `.`. A name is stored and listed as given, but
lookup, overwrite and delete are case-insensitive ("Fox" and "fox" are the same voice), so names never collide on
case-insensitive file systems.

Uploads are untrusted: the container is sniffed from the bytes (libsndfile), never taken from the client's file
name or MIME type, and only wav, flac, ogg/opus and mp3 are kept; `ref_text` is at most `MAX_REF_TEXT_CHARS`
characters, refused at upload rather than failing every later use.

Versions: `load` looks a voice up and pins its clip in one step and returns an immutable `VoiceRecord` with the
samples, so a request gets the version it looked up, whole, even if the voice is replaced or deleted meanwhile.
Decoded samples are cached (LRU bounded by bytes). A replaced or deleted clip is removed from disk at once, or,
when a `load` is reading it, as soon as that read ends: the disk holds the live voices and nothing else. The clips
of all live voices together stay within `quota_bytes`. `created_at` is in integer unix seconds (as OpenAI's and
vllm-omni's voice objects have it) and increases strictly across the whole store: an upload within the same second
as the one before, or after a clock step back, takes the previous value + 1 (as vllm-omni does), so a burst of
uploads may run a few seconds ahead of the clock, and `(name, created_at)` identifies one version of a voice for any
cache. Voices stored with fractional `created_at` (before it was an integer) are restored rounded up.

Threads: `list` only takes a short in-memory lock and never touches the disk, so the event loop may call it. `add`
(decodes audio, writes files), `delete` and `load` are blocking: call them in an executor. Disk writes are
serialised by a second lock that `list` never waits for.

Status codes (`VoiceError.status`): 400 bad name / ref_text too long / empty / undecodable / duration outside
1–30 s, 413 larger than `max_bytes` or the store's quota, 415 audio in a container outside the allow-list, 409 voice
limit reached, 500 a stored clip that can no longer be read (the detail goes to the log).
"""
from __future__ import annotations

import collections
import json
import logging
import math
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np

from omni_tts.audio.ref_audio import MAX_SECONDS, MIN_SECONDS, RefAudioError, decode_reference

logger = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")
_CLIP_FILE = re.compile(r"clip-[0-9a-f-]+\.(wav|flac|ogg|mp3)")
META = "meta.json"
_TMP_PREFIX = ".tmp-"
# libsndfile container → (file extension, canonical MIME type); anything else is refused with 415
_CONTAINERS = {"WAV": (".wav", "audio/wav"), "WAVEX": (".wav", "audio/wav"), "RF64": (".wav", "audio/wav"),
               "FLAC": (".flac", "audio/flac"), "OGG": (".ogg", "audio/ogg"), "MP3": (".mp3", "audio/mpeg")}
# a transcript of a clip of at most 30 s is a few hundred characters in any language; the talker's limit in tokens
# is checked where the prompt is tokenized
MAX_REF_TEXT_CHARS = 1024
MAX_CONSENT_CHARS = 1024
QUOTA_BYTES = 1024 ** 3      # all stored clips together (the default of --voices-quota-mb)
_NAME_RULE = "voice name must be 1–64 characters of letters, digits, '_', '.' or '-', not starting with '.'"


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
    sample_rate: int         # sample rate of the clip as uploaded (load() gives 24 kHz)
    path: str                # the stored clip

    @property
    def key(self) -> str:
        return self.name.lower()

    @property
    def version_key(self) -> str:
        """Names this version's clip for caches of what is derived from it (the talker's voice features)."""
        return f"{self.key}@{self.created_at!r}"

    def to_json(self) -> dict:
        """The API view: the `openai` SDK's `Voice` (id, object, type, name, created_at) and vllm-omni's uploaded
        voice (name, created_at, ref_text, consent, file_size, mime_type), plus duration_s. The id is the name:
        what DELETE /v1/audio/voices/{id} and a speech request's `voice` take."""
        return {"id": self.name, "object": "audio.voice", "type": "audio_sample", "name": self.name,
                "created_at": self.created_at, "ref_text": self.ref_text, "consent": self.consent,
                "file_size": self.file_size, "mime_type": self.mime_type, "duration_s": self.duration_s}


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: str, data: bytes) -> None:
    """Write `data` to `path` via a temp file in the same folder, fsync, rename."""
    folder = os.path.dirname(path)
    tmp = os.path.join(folder, f"{_TMP_PREFIX}{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class VoiceStore:
    def __init__(self, root_dir: str, max_voices: int = 1000, max_bytes: int = 10 * 1024 * 1024,
                 quota_bytes: int = QUOTA_BYTES, cache_bytes: int = 256 * 1024 * 1024,
                 min_seconds: float = MIN_SECONDS, max_seconds: float = MAX_SECONDS) -> None:
        self.root = os.path.abspath(root_dir)
        self.max_voices, self.max_bytes, self.quota_bytes, self.cache_bytes = (max_voices, max_bytes, quota_bytes,
                                                                               cache_bytes)
        self.min_seconds, self.max_seconds = min_seconds, max_seconds
        os.makedirs(self.root, exist_ok=True)
        self._lock = threading.Lock()          # in-memory state: _voices, _cache, _last_created, _pins, _doomed
        self._write_lock = threading.Lock()    # disk mutations (add / delete / clip removal), taken before _lock
        self._voices: dict[str, VoiceRecord] = {}
        self._cache: collections.OrderedDict[tuple[str, int], np.ndarray] = collections.OrderedDict()
        self._cached_bytes = 0
        self._last_created = 0
        self._pins: collections.Counter[str] = collections.Counter()  # clip path → loads reading it now
        self._doomed: set[str] = set()   # replaced/deleted clips a load still reads: removed when the last one ends
        self._restore()

    # --- start-up --------------------------------------------------------------------------------------------
    def _restore(self) -> None:
        for entry in sorted(os.listdir(self.root)):
            folder = os.path.join(self.root, entry)
            if entry.startswith(".") or not os.path.isdir(folder):
                continue
            meta_path = os.path.join(folder, META)
            if not os.path.exists(meta_path):
                self._remove_leftovers(folder, keep=None)  # a voice deleted while a load read its clip
                continue
            try:
                record = self._read_meta(entry, meta_path)
            except (OSError, ValueError, TypeError, KeyError) as e:
                logger.warning("voices: skipping corrupt voice folder %s: %s", folder, e)
                continue
            self._voices[record.key] = record
            self._last_created = max(self._last_created, record.created_at)
            self._remove_leftovers(folder, keep=os.path.basename(record.path))
        if self._voices:
            logger.info("voices: restored %d uploaded voice(s) from %s", len(self._voices), self.root)
        if len(self._voices) > self.max_voices:
            logger.warning("voices: %d stored voices exceed max_voices=%d; uploads of new names are refused",
                           len(self._voices), self.max_voices)

    def _read_meta(self, entry: str, meta_path: str) -> VoiceRecord:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        if not isinstance(meta, dict):
            raise ValueError("meta.json is not an object")
        name = meta["name"]
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name.lower() != entry:
            raise ValueError(f"name {name!r} does not match the folder")
        for field in ("ref_text", "consent"):
            if meta.get(field) is not None and not isinstance(meta[field], str):
                raise ValueError(f"{field} is not a string")
        created, duration = meta["created_at"], meta["duration_s"]
        size, rate, mime, clip = meta["file_size"], meta["sample_rate"], meta["mime_type"], meta["file"]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                   for v in (created, duration)):
            raise ValueError("created_at / duration_s are not numbers")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (size, rate)):
            raise ValueError("file_size / sample_rate are not positive integers")
        if not isinstance(mime, str) or not isinstance(clip, str) or not _CLIP_FILE.fullmatch(clip):
            raise ValueError("mime_type / file are invalid")
        path = os.path.join(self.root, entry, clip)
        actual = os.path.getsize(path)  # OSError when missing
        if actual != size:
            raise ValueError(f"{clip} has {actual} bytes, meta.json says {size}")
        return VoiceRecord(name=name, ref_text=meta.get("ref_text"), created_at=math.ceil(created), file_size=size,
                           mime_type=mime, duration_s=float(duration), consent=meta.get("consent"),
                           sample_rate=rate, path=path)

    @staticmethod
    def _remove_leftovers(folder: str, keep: str | None) -> None:
        """Delete this store's own stale files (old clip versions, temp files) from a voice folder."""
        try:
            names = os.listdir(folder)
        except OSError:
            return
        for name in names:
            if name != keep and (name.startswith(_TMP_PREFIX) or _CLIP_FILE.fullmatch(name)):
                try:
                    os.unlink(os.path.join(folder, name))
                except OSError as e:
                    logger.warning("voices: could not remove %s: %s", os.path.join(folder, name), e)
        if keep is None:
            try:
                os.rmdir(folder)  # only when empty
            except OSError:
                pass

    # --- names -----------------------------------------------------------------------------------------------
    @staticmethod
    def validate_name(name: str) -> str:
        """The name unchanged if valid; `VoiceError` (a ValueError, status 400, param 'name') otherwise."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise VoiceError(_NAME_RULE, 400, "name")
        return name

    # --- reads (non-blocking: fine on the event loop) ----------------------------------------------------------
    def list(self) -> list[VoiceRecord]:
        """All voices, sorted by name (case-insensitively)."""
        with self._lock:
            records = list(self._voices.values())
        return sorted(records, key=lambda r: (r.key, r.name))

    def __len__(self) -> int:
        with self._lock:
            return len(self._voices)

    def __contains__(self, name: object) -> bool:
        """Whether a voice is called `name` (case-insensitive)."""
        if not isinstance(name, str):
            return False
        with self._lock:
            return name.lower() in self._voices

    # --- blocking operations (call in an executor) ---------------------------------------------------------------
    def add(self, name: str, audio_bytes: bytes, ref_text: str | None, consent: str | None) -> VoiceRecord:
        """Validate and store a clip, replacing a voice of the same name (case-insensitive). Blocking."""
        self.validate_name(name)
        audio_bytes = bytes(audio_bytes)
        if len(audio_bytes) > self.max_bytes:
            raise VoiceError(f"audio_sample is larger than the {self.max_bytes}-byte limit "
                             f"({self.max_bytes / 2**20:g} MiB)", 413)
        if not audio_bytes:
            raise VoiceError("audio_sample is empty (0 bytes)")
        if ref_text is not None:
            if not isinstance(ref_text, str):
                raise VoiceError("ref_text must be a string", 400, "ref_text")
            ref_text = ref_text.strip() or None
            if ref_text is not None and len(ref_text) > MAX_REF_TEXT_CHARS:
                raise VoiceError(f"ref_text is longer than {MAX_REF_TEXT_CHARS} characters", 400, "ref_text")
        if consent is not None and not isinstance(consent, str):
            raise VoiceError("consent must be a string", 400, "consent")
        if consent is not None and len(consent) > MAX_CONSENT_CHARS:
            raise VoiceError(f"consent is longer than {MAX_CONSENT_CHARS} characters", 400, "consent")
        try:
            clip = decode_reference(audio_bytes, min_seconds=self.min_seconds, max_seconds=self.max_seconds,
                                    label="audio_sample")
        except RefAudioError as e:
            raise VoiceError(str(e), e.status) from None
        if clip.format not in _CONTAINERS:
            raise VoiceError(f"audio_sample is {clip.format} audio; upload wav, flac, ogg or mp3", 415)
        extension, canonical_mime = _CONTAINERS[clip.format]
        samples = clip.samples
        samples.flags.writeable = False
        key = name.lower()
        folder = os.path.join(self.root, key)
        with self._write_lock:
            with self._lock:
                previous = self._voices.get(key)
                if previous is None and len(self._voices) >= self.max_voices:
                    raise VoiceError(f"voice limit reached ({self.max_voices} uploaded voices); delete one first",
                                     409, "name")
                stored = sum(r.file_size for r in self._voices.values()) - (previous.file_size if previous else 0)
                if stored + len(audio_bytes) > self.quota_bytes:
                    # 413, not 507: the client's upload exceeds what this server lets it store (SDKs retry 5xx)
                    raise VoiceError(f"the voice store is full (quota {self.quota_bytes / 2**20:g} MiB); delete a "
                                     "voice first", 413)
                created = max(int(time.time()), self._last_created + 1)
                self._last_created = created
            clip_file = f"clip-{time.time_ns():x}-{uuid.uuid4().hex[:8]}{extension}"
            record = VoiceRecord(name=name, ref_text=ref_text, created_at=created, file_size=len(audio_bytes),
                                 mime_type=canonical_mime, duration_s=round(clip.duration_s, 3), consent=consent,
                                 sample_rate=clip.source_rate, path=os.path.join(folder, clip_file))
            meta = {"name": name, "ref_text": ref_text, "created_at": created, "file_size": record.file_size,
                    "mime_type": canonical_mime, "duration_s": record.duration_s, "consent": consent,
                    "sample_rate": record.sample_rate, "file": clip_file, "format": clip.format,
                    "subtype": clip.subtype, "version": 1}
            try:
                os.makedirs(folder, exist_ok=True)
                _write_atomic(record.path, audio_bytes)
                _write_atomic(os.path.join(folder, META), json.dumps(meta, ensure_ascii=False).encode("utf-8"))
                _fsync_dir(folder)
            except OSError as e:
                try:
                    os.unlink(record.path)
                except OSError:
                    pass
                logger.error("voices: could not store voice %r: %s", name, e)
                raise VoiceError(f"could not store voice '{name}'; see the server log", 500, None) from None
            with self._lock:
                self._voices[key] = record
                if previous is not None:
                    self._forget(previous)
                self._remember((key, created), samples)
            if previous is not None:
                self._retire(previous.path)
        return record

    def delete(self, name: str) -> VoiceRecord | None:
        """Remove the voice called `name` (case-insensitive) and its clip; the removed voice, None when there is
        none. Blocking."""
        if not isinstance(name, str) or not name.isascii():
            return None
        key = name.lower()
        with self._write_lock:
            with self._lock:
                record = self._voices.pop(key, None)
                if record is None:
                    return None
                self._forget(record)
            try:
                os.unlink(os.path.join(self.root, key, META))
            except OSError as e:
                logger.warning("voices: could not remove %s's metadata: %s", record.name, e)
            self._retire(record.path)
        return record

    def load(self, name: str) -> tuple[VoiceRecord, np.ndarray] | None:
        """The voice called `name` (case-insensitive) and its 24 kHz float32 samples, or None. Blocking on a miss.

        Lookup and pin happen under one lock, so a replace or delete landing while the clip is read removes the old
        file only after this read ends: the caller gets the version it looked up, whole. The array is shared with
        the cache and read-only. `VoiceError` 500 when the stored clip can no longer be read.
        """
        if not isinstance(name, str) or not name.isascii():
            return None
        with self._lock:
            record = self._voices.get(name.lower())
            if record is None:
                return None
            cached = self._cache.get((record.key, record.created_at))
            if cached is not None:
                self._cache.move_to_end((record.key, record.created_at))
                return record, cached
            self._pins[record.path] += 1
        try:
            samples = self._decode_stored(record)
        finally:
            self._unpin(record.path)
        with self._lock:
            current = self._voices.get(record.key)
            if current is not None and current.created_at == record.created_at:  # cache current versions only
                self._remember((record.key, record.created_at), samples)
        return record, samples

    # --- internals -------------------------------------------------------------------------------------------
    def _remember(self, cache_key: tuple[str, int], samples: np.ndarray) -> None:
        """Insert into the LRU (caller holds _lock); one entry larger than the budget is kept alone."""
        old = self._cache.pop(cache_key, None)
        if old is not None:
            self._cached_bytes -= old.nbytes
        self._cache[cache_key] = samples
        self._cached_bytes += samples.nbytes
        while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
            _, evicted = self._cache.popitem(last=False)
            self._cached_bytes -= evicted.nbytes

    def _forget(self, record: VoiceRecord) -> None:
        evicted = self._cache.pop((record.key, record.created_at), None)
        if evicted is not None:
            self._cached_bytes -= evicted.nbytes

    @staticmethod
    def _decode_stored(record: VoiceRecord) -> np.ndarray:
        try:
            with open(record.path, "rb") as f:
                data = f.read()
            samples = decode_reference(data, min_seconds=0.0, max_seconds=math.inf, label="stored voice").samples
        except (OSError, RefAudioError) as e:
            logger.error("voices: the clip of voice %r (%s) cannot be read: %s", record.name, record.path, e)
            raise VoiceError(f"voice '{record.name}' could not be read; see the server log", 500, "voice") from None
        samples.flags.writeable = False
        return samples

    def _retire(self, path: str) -> None:
        """Remove a replaced or deleted clip now, or when the last load reading it ends (caller holds _write_lock)."""
        with self._lock:
            if self._pins[path]:
                self._doomed.add(path)
                return
        self._remove_clip(path)

    def _unpin(self, path: str) -> None:
        with self._lock:
            self._pins[path] -= 1
            if self._pins[path]:
                return
            del self._pins[path]
            if path not in self._doomed:
                return
            self._doomed.discard(path)
        with self._write_lock:  # after _lock is released: the lock order is _write_lock, then _lock
            self._remove_clip(path)

    def _remove_clip(self, path: str) -> None:
        """Unlink a clip, and its folder once no live voice uses it (caller holds _write_lock)."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("voices: could not remove old clip %s: %s", path, e)
        folder = os.path.dirname(path)
        with self._lock:
            live = os.path.basename(folder) in self._voices
        if not live:
            try:
                os.rmdir(folder)  # only when empty
            except OSError:
                pass

    def cache_info(self) -> dict:
        with self._lock:
            return {"entries": len(self._cache), "bytes": self._cached_bytes, "limit_bytes": self.cache_bytes}
