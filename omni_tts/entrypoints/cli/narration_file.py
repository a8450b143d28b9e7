"""`omni-tts narrate`'s output: one file written by one stream encoder, and beside it a sidecar
(`FILE.narration.json`) that makes a cut narration resumable.

The sidecar holds what the audio depends on (the input's hash and the options that change the audio) and, per
segment delivered whole, its index, audio_offset, duration and the file's byte length after it. After each segment
the file's bytes reach the disk first, then the sidecar is replaced atomically, so whenever the process ends (an
error, Ctrl-C, a kill) the sidecar describes a prefix of the file. A run with the same identity truncates the file
to its last listed segment and continues with the next one, appending a new stream of the same format: the header
the first run wrote stays (a WAV header is rewritten with the final length at the end), and the new stream's own
header is dropped. That gives one file only for formats whose frames stand alone (`RESUMABLE`: MP3 frames
concatenate; a cut MP3 stream loses the encoder's look-ahead, a few ms of the pause, and the new one starts with
its encoder delay); an Ogg or FLAC stream cannot be continued, so those are refused (--restart starts again). The
sidecar is removed once the file is whole.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO

import numpy as np

from omni_tts.audio.encoding import create_stream_encoder
from omni_tts.audio.pcm import StreamEncoder, wav_header
from omni_tts.voices.shared_dir import write_atomic

SIDECAR_SUFFIX = ".narration.json"
SIDECAR_VERSION = 1
RESUMABLE = ("mp3", "pcm", "wav")   # formats whose stream can be continued after a cut, in one file
RESTART_HINT = "run with --restart to start it again"


@dataclass(frozen=True)
class Delivered:
    """A segment written whole: where its audio lies in the narration, and the file's length after it."""
    index: int
    audio_offset: float   # seconds of the narration's audio before it
    duration: float       # seconds of its own audio (the pause after it not included)
    bytes: int            # the output's byte length after it and its pause


def sidecar_path(out: str) -> str:
    return out + SIDECAR_SUFFIX


class NarrationFile:
    """The output file, its encoder and its sidecar. `identity`: what the audio depends on (JSON values): a
    partial output is continued only under the same identity."""

    def __init__(self, out: str, fmt: str, identity: dict[str, Any], restart: bool) -> None:
        """Open `out`: continued from its sidecar's last segment when there is one for `identity` (ValueError, one
        line, when there is one for another identity or it cannot be continued), else written afresh."""
        self.out, self.fmt, self.identity = out, fmt, identity
        self.sidecar = sidecar_path(out)
        self.delivered: list[Delivered] = [] if restart else self._read_sidecar()
        self.encoder: StreamEncoder = create_stream_encoder(fmt)
        if self.delivered:
            if fmt not in RESUMABLE:
                raise ValueError(f"{out} is a partial {fmt} narration, which cannot be continued after a cut (only "
                                 f"{', '.join(RESUMABLE)} can); {RESTART_HINT}")
            size = os.path.getsize(out) if os.path.isfile(out) else -1
            if size < self.delivered[-1].bytes:
                raise ValueError(f"{out} is shorter than {self.sidecar} records ({max(size, 0)} of "
                                 f"{self.delivered[-1].bytes} bytes); {RESTART_HINT}")
            self.file: BinaryIO = open(out, "r+b")
            self.file.truncate(self.delivered[-1].bytes)
            self.file.seek(0, os.SEEK_END)
            self.encoder.start()   # the file holds the first run's header already
        else:
            self.file = open(out, "wb")
            self._write_sidecar()

    @property
    def next_segment(self) -> int:
        """The first segment not yet in the file."""
        return self.delivered[-1].index + 1 if self.delivered else 0

    def write(self, audio: np.ndarray) -> None:
        self.file.write(self.encoder.encode(audio))

    def commit(self, index: int, audio_offset: float, duration: float, last: bool) -> None:
        """Segment `index` and its pause are written: on disk, then listed in the sidecar. `last`: the encoder's
        tail goes out first, so the last entry covers the whole stream."""
        if last:
            self.file.write(self.encoder.finish())
        self.file.flush()
        os.fsync(self.file.fileno())
        self.delivered.append(Delivered(index, audio_offset, duration, self.file.tell()))
        self._write_sidecar()

    def finish(self) -> None:
        """Every segment is in: a WAV header states the final length, the file is closed, the sidecar removed."""
        if self.fmt == "wav":
            header = len(wav_header(self.encoder.sample_rate, 0))
            samples = (self.file.seek(0, os.SEEK_END) - header) // 2
            self.file.seek(0)
            self.file.write(wav_header(self.encoder.sample_rate, samples))
        self.file.close()
        os.remove(self.sidecar)

    def close(self) -> None:
        """Leave the file as it is (the sidecar tells what of it is whole)."""
        self.encoder.close()
        self.file.close()

    def _read_sidecar(self) -> list[Delivered]:
        """The segments a partial output holds under this identity; [] without a sidecar."""
        try:
            with open(self.sidecar, encoding="utf-8") as f:
                saved = json.load(f)
            delivered = [Delivered(**entry) for entry in saved["segments"]]
            identity, version = saved["identity"], saved["version"]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{self.sidecar} cannot be read ({e}); {RESTART_HINT}") from None
        if version != SIDECAR_VERSION or [d.index for d in delivered] != list(range(len(delivered))):
            raise ValueError(f"{self.sidecar} is not a sidecar this version writes; {RESTART_HINT}")
        if identity != self.identity and delivered:   # nothing written whole: nothing to keep
            changed = [key for key in sorted(set(identity) | set(self.identity))
                       if identity.get(key) != self.identity.get(key)]
            what = "another input" if "text_sha256" in changed else "other options"
            raise ValueError(f"{self.out} is a partial narration of {what} ({', '.join(changed)} changed); "
                             f"{RESTART_HINT}")
        return delivered

    def _write_sidecar(self) -> None:
        saved = {"version": SIDECAR_VERSION, "identity": self.identity,
                 "segments": [asdict(d) for d in self.delivered]}
        write_atomic(self.sidecar, json.dumps(saved, indent=1).encode())
