"""meta.json, the directory store's (voices.py) record of a voice's current version, and the clip file it names.

Layout: `<root>/<name lower-cased>/meta.json` plus the clip exactly as uploaded, `clip-<version><ext>` (the
extension follows the decoded container, never the client's file name); `<root>/.lock` is the writers' lock and
`<root>/.created_at` the highest `created_at` handed out. A write puts the clip under a fresh version name and then
swaps `meta.json` with an atomic rename, so a crash leaves either the old or the new voice, never a half-written one.
"""
from __future__ import annotations

import json
import math
import os
import re

from omni_tts.entrypoints.voice_backend import CheckedUpload, VoiceRecord, voice_key

META = "meta.json"
_CLIP_FILE = re.compile(r"clip-[0-9a-f-]+\.(wav|flac|ogg|mp3)")


def is_clip(file_name: str) -> bool:
    """A clip file's name, as the store writes them (`clip-<version><ext>`)."""
    return _CLIP_FILE.fullmatch(file_name) is not None


def meta_bytes(record: VoiceRecord, upload: CheckedUpload) -> bytes:
    """The meta.json of a new version; `record.path` names its clip."""
    return json.dumps({"name": record.name, "ref_text": record.ref_text, "created_at": record.created_at,
                       "file_size": record.file_size, "mime_type": record.mime_type,
                       "duration_s": record.duration_s, "consent": record.consent,
                       "sample_rate": record.sample_rate, "file": os.path.basename(record.path),
                       "format": upload.container, "subtype": upload.subtype, "version": 1},
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
    if not isinstance(mime, str) or not isinstance(clip, str) or not is_clip(clip):
        raise ValueError("mime_type / file are invalid")
    path = os.path.join(root, entry, clip)
    actual = os.path.getsize(path)  # OSError when missing
    if actual != size:
        raise ValueError(f"{clip} has {actual} bytes, meta.json says {size}")
    return VoiceRecord(name=name, ref_text=meta.get("ref_text"), created_at=math.ceil(created), file_size=size,
                       mime_type=mime, duration_s=float(duration), consent=meta.get("consent"),
                       sample_rate=rate, path=path)
