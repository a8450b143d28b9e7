"""Audio made for tests: tones, encoded files, headers that lie."""
import io

import numpy as np
import soundfile as sf


def encode(samples, sr, fmt, subtype=None) -> bytes:
    buffer = io.BytesIO()
    channels = 1 if samples.ndim == 1 else samples.shape[1]
    with sf.SoundFile(buffer, "w", sr, channels, format=fmt, subtype=subtype) as f:
        for start in range(0, samples.shape[0], sr):  # one big write crashes libsndfile's vorbis encoder
            f.write(samples[start:start + sr])
    return buffer.getvalue()


def tone(seconds, sr=24000, channels=1):
    t = np.arange(int(seconds * sr)) / sr
    wav = (0.1 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    return wav if channels == 1 else np.stack([wav] * channels, axis=1)


def flac_claiming(total_frames: int, seconds: float, rate=8000) -> bytes:
    """A FLAC holding `seconds` of audio whose STREAMINFO header claims `total_frames` (0: length unknown)."""
    data = bytearray(encode(tone(seconds, rate), rate, "FLAC"))
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # STREAMINFO comes first
    # STREAMINFO from byte 8: block sizes (4 bytes), frame sizes (6), then rate:20 channels:3 bits:5 total:36
    fields = int.from_bytes(data[18:26], "big")
    data[18:26] = ((fields & ~(2**36 - 1)) | total_frames).to_bytes(8, "big")
    return bytes(data)
