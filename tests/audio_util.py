"""Decoding helpers for the output-format tests: FFmpeg (PyAV) decodes, and G.711's quantisation error."""
import io

import av
import numpy as np

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
