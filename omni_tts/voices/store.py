"""Uploaded voices (Base voice cloning): `VoiceStore`, the default voice store, a directory that every replica of
the server shares. The interface it implements, and the contract any store owes the server (consistency across
replicas, atomic versioned writes, `created_at`, names, upload checks, status codes), is voices/backend.py's
`VoiceStoreBackend`; its names are re-exported here. Layout and the atomic write: voices/meta.py. Replicas share
the directory: a local disk for replicas on one host, a network file system for several hosts (shared_dir.py says
what the file system must provide).

Consistency, and its cost (figures: docs/benchmarks.md, "Voice store"). No replica trusts what it read before;
each call reads the directory again:
- `load` reads the voice's meta.json (one open and read of a few hundred bytes) and compares the bytes with those
  behind its cached record: the same bytes → the cached record and decoded samples; other bytes → parsed, the new
  version; no file → the voice is gone. Reading rather than stat-ing costs a syscall more and buys exactness: the
  bytes hold `created_at`, so they name the version exactly, where an mtime has the file system's timestamp
  granularity and inode numbers are reused; and an open makes an NFS client revalidate with the server
  (close-to-open), where a stat may answer from its attribute cache.
- `in` is one stat of the voice's meta.json (the server asks it in its read pool, before admission); a hint only:
  `load` decides, and a voice deleted in between is answered as unknown, as it would have been a moment later.
- `list` (and `len`) read every voice's meta.json and parse the changed ones: N small reads and no TTL, so a
  listing is never stale. Blocking.
- `add` and `delete` take an exclusive `flock` on `.lock`, one writer at a time across all replicas, held while
  every voice is read afresh and the clip and meta.json are written and synced; uploads are rare, so the voice
  limit and the quota count every replica's voices exactly; a writer waits `lock_timeout` at most (then 503). A load
  whose clip a writer replaced removes it if the lock is free, else leaves it to a sweep: reads never wait on a
  writer (the server runs them in pools of their own, api/state.py). `created_at` is max(now,
  `.created_at` + 1, the newest voice + 1), written to `.created_at` before the voice's meta.json; in a burst or
  after a clock step back it runs a few seconds ahead of the clock, as vllm-omni's does.

Voice files (a clip, or an embedding voice's x-vector): a replaced or deleted one is removed by its writer at once,
or, when a `load` in the writer's process reads it, as soon as that read ends (touched meanwhile, so other replicas'
sweeps leave it alone). Another replica's load that has it open reads on (a local disk keeps an unlinked file while
it is open); one whose file vanished first (between its meta.json read and the file's open, or mid-read on NFS)
reads meta.json again and takes the version now current, or answers None when the voice is gone: a request gets one
version whole, the one current when it looked or a later one. The files of all live voices together stay within
`quota_bytes`, plus those still being read. Leftovers (temp files, voice files no meta.json names) are swept under
the lock at start-up and in a voice's folder at each write of it, once older than `ORPHAN_GRACE_S` (a younger one
may be another replica's, still being read). A folder whose meta.json cannot be parsed is skipped with a warning
and never swept. Voices stored with fractional `created_at` (before it was an integer) are read rounded up.
Loaded voices are cached per version (LRU bounded by bytes). Every method but `in` and `cache_info` blocks on the disk.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from typing import Iterator

import numpy as np

from omni_tts.audio.ref_audio import MAX_SECONDS, MIN_SECONDS
from omni_tts.config.settings import ApiSettings
from omni_tts.voices.array_lru import ArrayLRU
from omni_tts.voices.shared_dir import (LockTimeout, exclusive, fsync_dir, read_if_exists, remove_stale, touch,
                                             write_atomic)
from omni_tts.voices.backend import (EMBEDDING_MIME_TYPE, MAX_CONSENT_CHARS, MAX_DESCRIPTION_CHARS,
                                                MAX_EMBEDDING_VALUES, MAX_REF_TEXT_CHARS, MAX_UPLOAD_BYTES,
                                                CheckedUpload, VoiceDesign, VoiceError, VoiceRecord, VoiceStoreBackend,
                                                check_embedding_upload, check_upload, validate_name, voice_key)
from omni_tts.voices.meta import (EMBEDDING_FORMAT, META, decode_voice_file, is_voice_file, meta_bytes,
                                             parse_meta, unreadable)

__all__ = ["CLOCK_FILE", "LOCK_FILE", "MAX_CONSENT_CHARS", "MAX_DESCRIPTION_CHARS", "MAX_EMBEDDING_VALUES",
           "MAX_REF_TEXT_CHARS", "ORPHAN_GRACE_S", "CheckedUpload", "VoiceDesign", "VoiceError", "VoiceRecord",
           "VoiceStore", "VoiceStoreBackend", "check_embedding_upload", "check_upload", "validate_name", "voice_key"]

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"
CLOCK_FILE = ".created_at"
# a sweep leaves younger leftovers alone: another replica's clip may still be read (reads take milliseconds), and
# file times come from the file server, so this also covers clock skew between hosts
ORPHAN_GRACE_S = 60.0
LOCK_TIMEOUT_S = 10.0  # a writer's wait for another replica's lock: writes take milliseconds, a longer hold is a fault
# a clip that vanishes under a load is a replacement or delete elsewhere: look again, a few times at most
_LOAD_ATTEMPTS = 3


class VoiceStore:
    """The directory store (`VoiceStoreBackend`); the module docstring has the layout and the consistency model."""

    def __init__(self, root_dir: str, max_voices: int = 1000, max_bytes: int = MAX_UPLOAD_BYTES,
                 quota_bytes: int = ApiSettings().voices_quota_bytes, cache_bytes: int = 256 * 1024 * 1024,
                 min_seconds: float = MIN_SECONDS, max_seconds: float = MAX_SECONDS,
                 lock_timeout: float = LOCK_TIMEOUT_S) -> None:
        """lock_timeout: how long a writer waits for another replica's lock before it gives up (VoiceError 503)."""
        self.root = os.path.abspath(root_dir)
        self.lock_timeout = lock_timeout
        self.max_voices, self.max_bytes, self.quota_bytes, self.cache_bytes = (max_voices, max_bytes, quota_bytes,
                                                                               cache_bytes)
        self.min_seconds, self.max_seconds = min_seconds, max_seconds
        os.makedirs(self.root, exist_ok=True)
        self._lock = threading.Lock()          # in-memory state: _voices, _seen, _last_created, _pins, _doomed
        self._write_lock = threading.Lock()    # this process's writers, taken before the replicas' flock, then _lock
        self._voices: dict[str, VoiceRecord] = {}  # key → the version last read from disk
        self._seen: dict[str, bytes] = {}      # key → the meta.json bytes _voices[key] came from (absent: corrupt)
        self._cache = ArrayLRU(cache_bytes)   # (key, created_at) → what `load` gives
        self._last_created = 0
        self._pins: collections.Counter[str] = collections.Counter()  # clip path → loads reading it now
        self._doomed: set[str] = set()   # replaced/deleted clips a load still reads: removed when the last one ends
        with self._exclusive():
            for entry in sorted(os.listdir(self.root)):
                if not entry.startswith("."):
                    self._sweep(entry)
            self._report(remove_stale(self.root, lambda _: False, set(), ORPHAN_GRACE_S, remove_folder=False))
        voices = self._scan()
        if voices:
            logger.info("voices: found %d uploaded voice(s) in %s", len(voices), self.root)
        if len(voices) > self.max_voices:
            logger.warning("voices: %d stored voices exceed max_voices=%d; uploads of new names are refused",
                           len(voices), self.max_voices)

    # --- reading the directory ---------------------------------------------------------------------------------
    def _meta_path(self, key: str) -> str:
        return os.path.join(self.root, key, META)

    def _current(self, key: str) -> VoiceRecord | None:
        """The version of `key` on disk now (None: no voice, or a corrupt one, warned about once per content), and
        the in-memory index brought up to date with it."""
        for attempt in range(_LOAD_ATTEMPTS):
            try:
                raw = read_if_exists(self._meta_path(key))
            except OSError as e:
                logger.warning("voices: cannot read %s: %s", self._meta_path(key), e)
                return None
            with self._lock:
                if raw is not None and raw == self._seen.get(key):
                    return self._voices.get(key)
            if raw is None:
                with self._lock:
                    self._install(key, None, None)
                return None
            try:
                record = parse_meta(self.root, key, raw)
            except OSError as e:  # its clip is missing: corrupt, unless meta.json moved on meanwhile
                if attempt + 1 < _LOAD_ATTEMPTS and read_if_exists(self._meta_path(key)) != raw:
                    continue
                problem: Exception = e
            except (ValueError, TypeError, KeyError) as e:
                problem = e
            else:
                with self._lock:
                    self._install(key, raw, record)
                return record
            logger.warning("voices: skipping corrupt voice folder %s: %s", os.path.join(self.root, key), problem)
            with self._lock:
                self._install(key, raw, None)
            return None
        return None

    def _install(self, key: str, raw: bytes | None, record: VoiceRecord | None) -> None:
        """Index what disk says of `key` (caller holds _lock); a version no longer current leaves the cache."""
        old = self._voices.pop(key, None)
        if old is not None and (record is None or record.created_at != old.created_at):
            self._cache.pop((old.key, old.created_at))
        if raw is None:
            self._seen.pop(key, None)
            return
        self._seen[key] = raw
        if record is not None:
            self._voices[key] = record
            self._last_created = max(self._last_created, record.created_at)

    def _scan(self) -> dict[str, VoiceRecord]:
        """Every voice on disk now, by key; the index forgets the ones that are gone."""
        entries = [e for e in os.listdir(self.root) if not e.startswith(".")]
        voices = {key: record for key in entries if (record := self._current(key)) is not None}
        with self._lock:
            for key in set(self._seen).union(self._voices).difference(entries):
                self._install(key, None, None)
        return voices

    # --- the protocol --------------------------------------------------------------------------------------------
    def list(self) -> list[VoiceRecord]:
        """All voices on disk now, sorted by name (case-insensitively). Blocking: reads every meta.json."""
        return sorted(self._scan().values(), key=lambda r: (r.key, r.name))

    def __len__(self) -> int:
        return len(self._scan())

    def __contains__(self, name: object) -> bool:
        """Whether a voice is called `name` (case-insensitive): one stat (a hang on NFS holds a pool thread only)."""
        key = voice_key(name)
        return key is not None and os.path.isfile(self._meta_path(key))

    def add(self, name: str, audio_bytes: bytes, ref_text: str | None, consent: str | None,
            speaker_description: str | None = None, design: VoiceDesign | None = None) -> VoiceRecord:
        """Check and store a clip, replacing a voice of the same name (case-insensitive). Blocking."""
        upload = check_upload(name, audio_bytes, ref_text, consent, speaker_description, max_bytes=self.max_bytes,
                              min_seconds=self.min_seconds, max_seconds=self.max_seconds, design=design)
        draft = VoiceRecord(name=name, ref_text=upload.ref_text, created_at=0, file_size=len(upload.audio),
                            mime_type=upload.mime_type, duration_s=upload.duration_s, consent=upload.consent,
                            sample_rate=upload.sample_rate, path="", speaker_description=upload.speaker_description,
                            prompt=design and design.prompt, design_model=design and design.model)
        return self._store(draft, f"clip{{}}{upload.extension}", upload.audio, upload.samples,
                           (upload.container, upload.subtype))

    def add_embedding(self, name: str, embedding: np.ndarray, consent: str | None,
                      speaker_description: str | None = None) -> VoiceRecord:
        """Store a speaker embedding (checked against the served checkpoint by the caller: prompt.py's
        `check_speaker_embedding`) as a voice without audio, replacing a voice of the same name. Blocking."""
        vector, consent, description = check_embedding_upload(name, embedding, consent, speaker_description)
        data = vector.astype("<f4").tobytes()
        draft = VoiceRecord(name=name, ref_text=None, created_at=0, file_size=len(data), duration_s=0.0,
                            mime_type=EMBEDDING_MIME_TYPE, consent=consent, sample_rate=0, path="",
                            speaker_description=description, embedding_dim=vector.shape[0])
        return self._store(draft, "embedding{}.f32", data, vector, EMBEDDING_FORMAT)

    def _store(self, draft: VoiceRecord, file_name: str, data: bytes, loaded: np.ndarray,
               file_format: tuple[str, str]) -> VoiceRecord:
        """Store `draft` (a new version but its created_at and path) with `data` as its file `file_name` ({}: the
        version) and swap its meta.json in; `loaded` is what `load` gives for it."""
        name = draft.name
        key = name.lower()
        folder = os.path.join(self.root, key)
        with self._exclusive():
            voices = self._scan()  # every replica's voices as they are now: the limits count them all
            previous = voices.get(key)
            if previous is None and len(voices) >= self.max_voices:
                raise VoiceError(f"voice limit reached ({self.max_voices} uploaded voices); delete one first", 409,
                                 "name")
            stored = sum(r.file_size for r in voices.values()) - (previous.file_size if previous else 0)
            if stored + len(data) > self.quota_bytes:
                # 413, not 507: the client's upload exceeds what this server lets it store (SDKs retry 5xx)
                raise VoiceError(f"the voice store is full (quota {self.quota_bytes / 2**20:g} MiB); delete a voice "
                                 "first", 413)
            created = max(int(time.time()), self._last_given() + 1)
            version = f"-{time.time_ns():x}-{uuid.uuid4().hex[:8]}"
            record = dataclasses.replace(draft, created_at=created,
                                         path=os.path.join(folder, file_name.format(version)))
            meta = meta_bytes(record, *file_format)
            try:
                # the high-water mark first: a crash after it wastes a number, one before the meta.json could not
                # hand this version's created_at out again once the voice is deleted
                write_atomic(os.path.join(self.root, CLOCK_FILE), str(created).encode())
                os.makedirs(folder, exist_ok=True)
                write_atomic(record.path, data)
                write_atomic(os.path.join(folder, META), meta)
                fsync_dir(folder)
            except OSError as e:
                try:
                    os.unlink(record.path)
                except OSError:
                    pass
                logger.error("voices: could not store voice %r: %s", name, e)
                raise VoiceError(f"could not store voice '{name}'; see the server log", 500, None) from None
            with self._lock:
                self._install(key, meta, record)
                self._cache.put((key, created), loaded)
            if previous is not None:
                self._retire(previous.path)
            self._sweep(key)
        return record

    def delete(self, name: str) -> VoiceRecord | None:
        """Remove the voice called `name` (case-insensitive) and its clip; the removed voice, None when there is
        none. Blocking."""
        key = voice_key(name)
        if key is None:
            return None
        with self._exclusive():
            record = self._current(key)
            if record is None:
                return None
            try:
                os.unlink(self._meta_path(key))
            except OSError as e:  # the voice stays whole rather than losing its clip under its meta.json
                logger.error("voices: could not delete voice %r: %s", record.name, e)
                raise VoiceError(f"could not delete voice '{record.name}'; see the server log", 500, None) from None
            with self._lock:
                self._install(key, None, None)
            self._retire(record.path)
            self._sweep(key)
        return record

    def load(self, name: str) -> tuple[VoiceRecord, np.ndarray] | None:
        """The voice called `name` (case-insensitive) as it is on disk now, and its 24 kHz float32 samples, or None.
        Blocking: reads meta.json, and the clip on a cache miss.

        The clip is pinned while it is read, so a replace or delete through this process removes it only after the
        read; one replaced or deleted through another replica meanwhile makes the load look again. The array is
        shared with the cache and read-only. `VoiceError` 500 when the current version's clip cannot be read.
        """
        key = voice_key(name)
        if key is None:
            return None
        for attempt in range(_LOAD_ATTEMPTS):
            record = self._current(key)
            if record is None:
                return None
            cached = self._cache.get((key, record.created_at))
            if cached is not None:
                return record, cached
            with self._lock:
                self._pins[record.path] += 1
            try:
                with open(record.path, "rb") as f:
                    data = f.read()
            except OSError as e:
                latest = self._current(key)
                if latest is None:
                    return None  # deleted elsewhere while we looked
                if latest.created_at != record.created_at and attempt + 1 < _LOAD_ATTEMPTS:
                    continue     # replaced elsewhere while we looked: read the new version
                unreadable(record, e)
            finally:
                self._unpin(record.path)
            samples = decode_voice_file(record, data)
            with self._lock:
                current = self._voices.get(key)
                if current is not None and current.created_at == record.created_at:  # cache current versions only
                    self._cache.put((key, record.created_at), samples)
            return record, samples
        return None

    def cache_info(self) -> dict:
        return {"entries": len(self._cache), "bytes": self._cache.nbytes, "limit_bytes": self.cache_bytes}

    # --- internals -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _exclusive(self, timeout: float | None = None) -> Iterator[None]:
        """One writer at a time (this process's, then every replica's); VoiceError 503 after `timeout` s of waiting."""
        try:
            with exclusive(os.path.join(self.root, LOCK_FILE), self.lock_timeout if timeout is None else timeout,
                           self._write_lock):
                yield
        except LockTimeout as e:
            logger.warning("voices: %s", e)
            raise VoiceError("the voices directory is busy (another replica holds it); retry shortly", 503, None) from None

    def _last_given(self) -> int:
        """The highest created_at this store has handed out, in any replica (caller holds _exclusive)."""
        try:
            clock = int(read_if_exists(os.path.join(self.root, CLOCK_FILE)) or 0)
        except (OSError, ValueError) as e:
            logger.warning("voices: ignoring unreadable %s: %s", CLOCK_FILE, e)
            clock = 0
        with self._lock:
            return max(clock, self._last_created)  # _last_created: the newest voice just scanned

    def _sweep(self, key: str) -> None:
        """Remove a voice folder's leftovers older than the grace period (caller holds _exclusive). A folder whose
        meta.json cannot be read keeps everything: its files are nobody's to judge."""
        folder = os.path.join(self.root, key)
        try:
            raw = read_if_exists(os.path.join(folder, META))
            keep = set() if raw is None else {json.loads(raw)["file"]}
        except (OSError, ValueError, TypeError, KeyError):
            return
        self._report(remove_stale(folder, is_voice_file, keep, ORPHAN_GRACE_S, remove_folder=raw is None))

    @staticmethod
    def _report(failures: list[str]) -> None:
        for failure in failures:
            logger.warning("voices: could not remove %s", failure)

    def _retire(self, path: str) -> None:
        """Remove a replaced or deleted clip now, or when the last load reading it ends (caller holds _exclusive)."""
        with self._lock:
            deferred = bool(self._pins[path])
            if deferred:
                self._doomed.add(path)
        if deferred:
            touch(path)  # young again: other replicas' sweeps leave it to us
        else:
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
        # after _lock (the lock order is _exclusive, then _lock); a load never waits: a busy lock leaves it to a sweep
        with contextlib.suppress(VoiceError), self._exclusive(timeout=0.0):
            self._remove_clip(path)

    @staticmethod
    def _remove_clip(path: str) -> None:
        """Unlink a clip, and its folder when that leaves it empty (caller holds _exclusive, so no writer is about
        to fill the folder again)."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("voices: could not remove old clip %s: %s", path, e)
        try:
            os.rmdir(os.path.dirname(path))  # only when empty
        except OSError:
            pass

