"""meta.json, the directory store's (voices/store.py) record of a voice's current version, and the voice file it names.

Layout: `<root>/<name lower-cased>/meta.json` plus the voice file: the clip exactly as uploaded,
`clip-<version><ext>` (the extension follows the decoded container, never the client's file name), or an embedding
voice's x-vector as raw little-endian float32, `embedding-<version>.f32`; `<root>/.lock` is the writers' lock and
`<root>/.created_at` the highest `created_at` handed out. A write puts the clip under a fresh version name and then
swaps `meta.json` with an atomic rename, so a crash leaves either the old or the new voice, never a half-written one.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from typing import NoReturn

import numpy as np

from omni_tts.audio.ref_audio import RefAudioError, decode_reference
from omni_tts.voices.backend import VoiceError, VoiceRecord, voice_key

logger = logging.getLogger("omni_tts.voices.store")   # the store's log lines, under one name

META = "meta.json"
EMBEDDING_FORMAT = ("EMBEDDING", "FLOAT32")   # meta.json's format and subtype of an embedding voice's file
_VOICE_FILE = re.compile(r"clip-[0-9a-f-]+\.(wav|flac|ogg|mp3)|embedding-[0-9a-f-]+\.f32")


def is_voice_file(file_name: str) -> bool:
    """A voice file's name, as the store writes them (`clip-<version><ext>`, `embedding-<version>.f32`)."""
    return _VOICE_FILE.fullmatch(file_name) is not None


def meta_bytes(record: VoiceRecord, container: str, subtype: str) -> bytes:
    """The meta.json of a new version; `record.path` names its file, of libsndfile's `container` and `subtype`
    (EMBEDDING_FORMAT for an embedding voice)."""
    return json.dumps({"name": record.name, "ref_text": record.ref_text, "created_at": record.created_at,
                       "file_size": record.file_size, "mime_type": record.mime_type,
                       "duration_s": record.duration_s, "consent": record.consent,
                       "speaker_description": record.speaker_description, "embedding_dim": record.embedding_dim,
                       "sample_rate": record.sample_rate, "prompt": record.prompt,
                       "design_model": record.design_model, "file": os.path.basename(record.path),
                       "format": container, "subtype": subtype, "version": 1},
                      ensure_ascii=False).encode("utf-8")


def parse_meta(root: str, entry: str, raw: bytes) -> VoiceRecord:
    """The version meta.json `raw` of folder `entry` records; ValueError/TypeError/KeyError when it is corrupt, OSError
    when its clip is missing."""
    meta = json.loads(raw)
    if not isinstance(meta, dict):
        raise ValueError("meta.json is not an object")
    name = meta["name"]
    if voice_key(name) != entry:
        raise ValueError(f"name {name!r} does not match the folder")
    for field in ("ref_text", "consent", "speaker_description", "prompt", "design_model"):
        if meta.get(field) is not None and not isinstance(meta[field], str):
            raise ValueError(f"{field} is not a string")
    created, duration = meta["created_at"], meta["duration_s"]
    size, rate, mime, file = meta["file_size"], meta["sample_rate"], meta["mime_type"], meta["file"]
    dim = meta.get("embedding_dim")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
               for v in (created, duration)):
        raise ValueError("created_at / duration_s are not numbers")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
               for v in (size, rate if dim is None else dim)):
        raise ValueError("file_size / sample_rate / embedding_dim are not positive integers")
    if not isinstance(mime, str) or not isinstance(file, str) or not is_voice_file(file) \
            or file.startswith("embedding-") != (dim is not None) or (dim is not None and size != 4 * dim):
        raise ValueError("mime_type / file / embedding_dim are invalid")
    path = os.path.join(root, entry, file)
    actual = os.path.getsize(path)  # OSError when missing
    if actual != size:
        raise ValueError(f"{file} has {actual} bytes, meta.json says {size}")
    return VoiceRecord(name=name, ref_text=meta.get("ref_text"), created_at=math.ceil(created), file_size=size,
                       mime_type=mime, duration_s=float(duration), consent=meta.get("consent"),
                       sample_rate=rate, path=path, speaker_description=meta.get("speaker_description"),
                       embedding_dim=dim, prompt=meta.get("prompt"), design_model=meta.get("design_model"))


def unreadable(record: VoiceRecord, error: Exception) -> NoReturn:
    """A stored voice whose file cannot be read: logged, and VoiceError 500 (the detail stays in the log)."""
    logger.error("voices: the file of voice %r (%s) cannot be read: %s", record.name, record.path, error)
    raise VoiceError(f"voice '{record.name}' could not be read; see the server log", 500, "voice")


def decode_voice_file(record: VoiceRecord, data: bytes) -> np.ndarray:
    """A stored voice file's bytes → what `load` gives, read-only: 24 kHz float32 samples, or an embedding voice's
    float32 x-vector."""
    if record.embedding_dim is not None:
        loaded = np.frombuffer(data, dtype="<f4").astype(np.float32)
    else:
        try:
            loaded = decode_reference(data, min_seconds=0.0, max_seconds=math.inf, label="stored voice").samples
        except RefAudioError as e:
            unreadable(record, e)
    loaded.flags.writeable = False
    return loaded
