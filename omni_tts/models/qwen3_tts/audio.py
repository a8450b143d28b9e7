"""Reference-audio reading and resampling for the Base (voice clone) front end.

Both follow the reference exactly (model doc §9): files decode to float32 the way `soundfile` does (int16 / 32768),
several channels are averaged to mono, and other sample rates go through `librosa.resample`'s default path — soxr
at quality HQ, then zero-padded or trimmed to librosa's output length (see `resampled_length`). librosa itself is
not a dependency; the few lines it runs are reproduced here.
"""
from __future__ import annotations

import io
import math
import os
from typing import Union

import numpy as np
import soundfile as sf
import soxr

AudioSource = Union[str, os.PathLike, bytes, bytearray, memoryview]

SAMPLE_RATE = 24000  # the model's audio rate, in (reference audio) and out (speech)
_READ_FRAMES = 1 << 16   # frames decoded per block


def load_audio(source: AudioSource, max_samples: int | None = None) -> tuple[np.ndarray, int]:
    """Decode a file path or in-memory audio file (wav, flac, ogg, … — whatever libsndfile reads).

    Returns `(mono float32 samples, sample rate)`. `max_samples` stops decoding after that many samples (per
    channel), whatever the header claims (compressed formats may not know their length, or lie about it). Raises
    `ValueError` for audio that cannot be decoded (the message carries libsndfile's text: log it, do not show it to
    clients), is empty, or holds non-finite samples; `FileNotFoundError` for a missing path.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise ValueError("reference audio is empty (0 bytes)")
        handle: object = io.BytesIO(bytes(source))
        name = "in-memory audio"
    else:
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"reference audio not found: {path}")
        handle, name = path, path
    remaining = math.inf if max_samples is None else max_samples
    blocks = []
    try:
        with sf.SoundFile(handle) as f:
            sr = f.samplerate
            # block by block, mixed to mono as it comes: memory follows the audio actually decoded, never the
            # header's frame count (unknown-length streams report 2**63 - 1 frames)
            while remaining > 0:
                # float32 read scales integer PCM exactly as the reference's soundfile/librosa read does (/ 32768)
                wanted = int(min(_READ_FRAMES, remaining))
                block = f.read(wanted, dtype="float32", always_2d=True)
                remaining -= block.shape[0]
                # the reference averages channels in float32 (row by row: the same values as one whole-array mean)
                blocks.append(block[:, 0] if block.shape[1] == 1 else block.mean(axis=1, dtype=np.float32))
                if block.shape[0] < wanted:  # a short block is the end: no read past it
                    break
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise ValueError(f"could not decode {name} as audio: {e}") from None
    wav = np.ascontiguousarray(np.concatenate(blocks), dtype=np.float32)
    if wav.shape[0] == 0:
        raise ValueError(f"{name} holds no audio samples")
    if not np.all(np.isfinite(wav)):
        raise ValueError(f"{name} contains non-finite samples")
    return wav, int(sr)


def resampled_length(n: int, sr: int, target_sr: int = SAMPLE_RATE) -> int:
    """Output length of `resample_to`: librosa's `int(np.ceil(n * (target / sr)))` with the float ratio.

    This is ceil(n * target / sr) except where that quotient is an integer and the float product lands just above
    it: at 22.05 / 44.1 / 11.025 kHz every multiple of 147 samples (1 s at 22.05 kHz → 24001, not 24000). The
    reference gets the extra zero sample, which can add a code frame, so it is kept here.
    """
    return int(np.ceil(n * (float(target_sr) / sr)))


def resample_to(wav: np.ndarray, sr: int, target_sr: int = SAMPLE_RATE) -> np.ndarray:
    """Resample mono audio as `librosa.resample(wav, orig_sr=sr, target_sr=target_sr)` does with its defaults.

    A bare soxr call is one sample short for about half of the lengths at 22.05/44.1 kHz, which moves the x-vector by
    ~1e-3; librosa fixes the length afterwards, so this does too. Same rate: the input is returned unchanged.
    """
    wav = np.asarray(wav)
    if wav.ndim != 1:
        raise ValueError(f"resample_to expects mono audio of shape [samples], got shape {wav.shape}")
    if wav.size == 0:
        raise ValueError("cannot resample empty audio")
    if sr <= 0 or target_sr <= 0 or not math.isfinite(sr) or not math.isfinite(target_sr):
        raise ValueError(f"sample rates must be positive, got {sr} -> {target_sr}")
    if not np.all(np.isfinite(wav)):
        raise ValueError("audio contains non-finite samples")
    if sr == target_sr:
        return wav
    n_out = resampled_length(wav.shape[0], sr, target_sr)
    out = soxr.resample(wav, sr, target_sr, quality=soxr.HQ)
    if out.shape[0] > n_out:
        out = out[:n_out]
    elif out.shape[0] < n_out:
        out = np.pad(out, (0, n_out - out.shape[0]))  # zeros at the end, as librosa's fix_length
    return np.asarray(out, dtype=wav.dtype)


def load_audio_24k(source: AudioSource) -> np.ndarray:
    """`load_audio` then `resample_to` 24 kHz: the input both the speaker encoder and the Mimi encoder take."""
    wav, sr = load_audio(source)
    return resample_to(wav, sr, SAMPLE_RATE)
