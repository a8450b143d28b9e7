"""Audio made and read by tests: tones, encoded files, headers that lie; FFmpeg (PyAV) decodes and G.711's
quantisation error for the output-format tests."""
import io

import av
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

G711 = {"ulaw": ("pcm_mulaw", 7), "alaw": ("pcm_alaw", 6)}  # FFmpeg decoder, WAV format tag


def g711_decode(fmt: str, data: bytes) -> np.ndarray:
    """G.711 bytes → int16 through FFmpeg's own decoder (pcm_mulaw / pcm_alaw)."""
    ctx = av.CodecContext.create(G711[fmt][0], "r")
    ctx.sample_rate, ctx.layout = 8000, "mono"
    return np.concatenate([f.to_ndarray().reshape(-1) for f in ctx.decode(av.Packet(data))])


def g711_bound(reference: np.ndarray) -> np.ndarray:
    """A bound on G.711's error at each 16-bit sample: its steps are 1/16 to 1/32 of the magnitude (the smallest set
    by mu-law's bias of 132), an error is within one step (half of one but at segment ends and the clip near full
    scale), so (|x| + 132) / 16 holds for every value (tests/audio checks all 65536)."""
    return (np.abs(reference.astype(np.int64)) + 132) / 16


def decode(data: bytes):
    with av.open(io.BytesIO(data)) as c:
        rate = c.streams.audio[0].sample_rate
        return np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)]), rate


def assert_same_audio(got: bytes, expected: bytes, fmt: str = "pcm") -> None:
    """Equal audio (pcm, or G.711 `ulaw` / `alaw` bytes), up to the rounding of one sample: the code2wav scheduler
    cuts a stream's chunks into pieces by playback deadline, so with the machine's timing the decoder's float32 sums
    can round a 16-bit sample 1 LSB apart (rare: most runs are byte-equal), and G.711 then one step apart."""
    assert len(got) == len(expected)
    if got == expected:
        return
    if fmt == "pcm":
        got_samples, samples = (np.frombuffer(data, "<i2").astype(np.int64) for data in (got, expected))
        assert np.abs(got_samples - samples).max() <= 1
    else:
        got_samples, samples = (g711_decode(fmt, data).astype(np.int64) for data in (got, expected))
        assert np.all(np.abs(got_samples - samples) <= g711_bound(samples) + 1)
