"""Consent recordings (OpenAI's voice consents): a speaker recorded consenting to a voice made from their voice, which
an uploaded voice names by id (its `consent`, `cons_<32 hex>`). Kept beside the voices, in `<voices dir>/.consents/`
(the voice store skips dot folders), with the voice store's discipline (voices/store.py): one writer at a time
across replicas (the folder's own `.lock`), atomic writes, every call reading the folder afresh (no replica trusts
what it read before), and bounds: at most `max_consents` recordings of at most `max_bytes` each, all of them within
`quota_bytes`.

Layout: `<id>.json` (name, language, created_at, the recording's file, size and MIME type) and the recording exactly
as uploaded, `<id><ext>` (the extension follows the sniffed container, as a voice clip's). An add writes the
recording, then the json; an update swaps the json; a delete removes the json, then the recording. Leftovers of a
crash (a recording no json names) are swept under the lock once older than ORPHAN_GRACE_S. Every method blocks on
the disk: call them in an executor.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import threading
import time
import uuid
from typing import Iterator

from omni_tts.config.settings import ApiSettings
from omni_tts.voices.backend import MAX_UPLOAD_BYTES, VoiceError, check_audio, container_file
from omni_tts.voices.shared_dir import LockTimeout, exclusive, fsync_dir, read_if_exists, remove_stale, write_atomic
from omni_tts.voices.store import LOCK_FILE, LOCK_TIMEOUT_S, ORPHAN_GRACE_S

logger = logging.getLogger(__name__)

SUBDIRECTORY = ".consents"
MAX_CONSENTS = 1000
MAX_CONSENT_NAME_CHARS = 256
_ID = re.compile(r"cons_[0-9a-f]{32}")
_RECORDING = re.compile(r"cons_[0-9a-f]{32}\.(wav|flac|ogg|mp3)")
_LANGUAGE = re.compile(r"[A-Za-z]{2,3}(-[A-Za-z0-9]{1,8}){0,4}")   # a BCP 47 tag's shape: en, en-US, zh-Hans-CN


def is_consent_id(value: object) -> bool:
    """Whether `value` has the shape of a consent recording's id (an uploaded voice's `consent` that names one)."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None


@dataclasses.dataclass(frozen=True)
class ConsentRecord:
    """One consent recording, as its json records it."""
    id: str
    name: str
    language: str
    created_at: int
    file: str          # the recording's file name in the folder
    file_size: int
    mime_type: str

    def to_json(self) -> dict:
        """OpenAI's VoiceConsent."""
        return {"id": self.id, "object": "audio.voice_consent", "name": self.name, "language": self.language,
                "created_at": self.created_at}


def check_name(name: object) -> str:
    """A consent recording's label: 1..MAX_CONSENT_NAME_CHARS characters, not blank; VoiceError naming `name`."""
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_CONSENT_NAME_CHARS:
        raise VoiceError(f"name must be 1 to {MAX_CONSENT_NAME_CHARS} characters, not blank", 400, "name")
    return name


def _parse(raw: bytes) -> ConsentRecord:
    """A consent json → its record; ValueError/TypeError/KeyError when it is corrupt."""
    meta = json.loads(raw)
    record = ConsentRecord(**{field.name: meta[field.name] for field in dataclasses.fields(ConsentRecord)})
    if not (is_consent_id(record.id) and _RECORDING.fullmatch(record.file) and record.file.startswith(record.id)
            and isinstance(record.name, str) and isinstance(record.language, str)
            and isinstance(record.created_at, int) and isinstance(record.file_size, int)):
        raise ValueError("fields of the wrong shape")
    return record


class ConsentStore:
    """The consent recordings of one voices directory (the module docstring has the layout and the bounds)."""

    def __init__(self, voices_dir: str, max_consents: int = MAX_CONSENTS, max_bytes: int = MAX_UPLOAD_BYTES,
                 quota_bytes: int = ApiSettings().voices_quota_bytes, lock_timeout: float = LOCK_TIMEOUT_S) -> None:
        self.root = os.path.join(os.path.abspath(voices_dir), SUBDIRECTORY)
        self.max_consents, self.max_bytes, self.quota_bytes = max_consents, max_bytes, quota_bytes
        self.lock_timeout = lock_timeout
        self._write_lock = threading.Lock()   # this process's writers, taken before the replicas' flock
        os.makedirs(self.root, exist_ok=True)
        with self._exclusive():
            self._sweep(self._scan())

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def get(self, consent_id: str) -> ConsentRecord | None:
        """The recording `consent_id` names now, or None (an id of another shape, a corrupt json: warned)."""
        if not is_consent_id(consent_id):
            return None
        raw = read_if_exists(self._path(f"{consent_id}.json"))
        if raw is None:
            return None
        try:
            return _parse(raw)
        except (ValueError, TypeError, KeyError) as e:
            logger.warning("consents: skipping corrupt %s.json: %s", consent_id, e)
            return None

    def _scan(self) -> list[ConsentRecord]:
        entries = [entry[:-5] for entry in os.listdir(self.root) if entry.endswith(".json")]
        return [record for entry in entries if (record := self.get(entry)) is not None]

    def list(self) -> list[ConsentRecord]:
        """Every recording now, oldest first (by id: its first half is the time it was made, in ns)."""
        return sorted(self._scan(), key=lambda r: r.id)

    def add(self, name: str, language: str, recording: bytes) -> ConsentRecord:
        """Check and keep a recording under a new id; VoiceError naming the field when refused."""
        check_name(name)
        if not isinstance(language, str) or not _LANGUAGE.fullmatch(language):
            raise VoiceError("language must be a BCP 47 language tag, such as en-US", 400, "language")
        clip = check_audio(recording, max_bytes=self.max_bytes, field="recording")
        extension, mime_type = container_file(clip)
        now = time.time_ns()
        consent_id = f"cons_{now:016x}{uuid.uuid4().hex[:16]}"   # ids sort as they were made (on this clock)
        record = ConsentRecord(id=consent_id, name=name, language=language, created_at=now // 10**9,
                               file=consent_id + extension, file_size=len(recording), mime_type=mime_type)
        with self._exclusive():
            stored = self._scan()
            if len(stored) >= self.max_consents:
                raise VoiceError(f"consent recording limit reached ({self.max_consents}); delete one first", 409,
                                 None)
            if sum(r.file_size for r in stored) + len(recording) > self.quota_bytes:
                raise VoiceError(f"the consent recordings are full (quota {self.quota_bytes / 2**20:g} MiB); delete "
                                 "one first", 413, "recording")
            self._write(record, recording)
            self._sweep(stored + [record])
        return record

    def rename(self, consent_id: str, name: str) -> ConsentRecord | None:
        """The recording with its new label, None when there is none."""
        check_name(name)
        with self._exclusive():
            record = self.get(consent_id)
            if record is None:
                return None
            record = dataclasses.replace(record, name=name)
            self._write(record, None)
        return record

    def delete(self, consent_id: str) -> ConsentRecord | None:
        """Remove a recording; the removed one, None when there is none."""
        with self._exclusive():
            record = self.get(consent_id)
            if record is None:
                return None
            try:
                os.unlink(self._path(f"{consent_id}.json"))
            except OSError as e:
                logger.error("consents: could not delete %s: %s", consent_id, e)
                raise VoiceError(f"could not delete consent recording '{consent_id}'; see the server log", 500,
                                 None) from None
            with contextlib.suppress(OSError):   # else a leftover: the next write's sweep removes it
                os.unlink(self._path(record.file))
        return record

    def _write(self, record: ConsentRecord, recording: bytes | None) -> None:
        """The recording (when given), then the json that names it, each atomically (caller holds _exclusive)."""
        try:
            if recording is not None:
                write_atomic(self._path(record.file), recording)
            write_atomic(self._path(f"{record.id}.json"), json.dumps(dataclasses.asdict(record)).encode())
            fsync_dir(self.root)
        except OSError as e:
            logger.error("consents: could not store %s: %s", record.id, e)
            raise VoiceError("could not store the consent recording; see the server log", 500, None) from None

    def _sweep(self, records: list[ConsentRecord]) -> None:
        """Remove recordings no json names, once older than the grace period (caller holds _exclusive)."""
        for failure in remove_stale(self.root, lambda name: _RECORDING.fullmatch(name) is not None,
                                    {r.file for r in records}, ORPHAN_GRACE_S,
                                    remove_folder=False):
            logger.warning("consents: could not remove %s", failure)

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        try:
            with exclusive(self._path(LOCK_FILE), self.lock_timeout, self._write_lock):
                yield
        except LockTimeout as e:
            logger.warning("consents: %s", e)
            raise VoiceError("the voices directory is busy (another replica holds it); retry shortly", 503,
                             None) from None
