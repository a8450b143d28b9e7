"""G.711 (ITU-T) mu-law and A-law: 8-bit telephony samples from 16-bit PCM.

The encoders follow G.711's decision levels as the ITU reference code (G.191's g711.c) states them: mu-law on the
top 14 bits with a bias of 33, A-law on the top 13 bits; each is one 65536-entry table indexed by the int16 sample,
built once at import (64 KiB each), so a chunk costs one lookup per sample.
"""
from __future__ import annotations

import numpy as np

# the last magnitude of each segment, as the reference code's seg_uend / seg_aend
_ULAW_SEGMENT_ENDS = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
_ALAW_SEGMENT_ENDS = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])
_ULAW_BIAS, _ULAW_CLIP = 0x21, 8159


def _ulaw_table() -> np.ndarray:
    v = np.arange(-32768, 32768, dtype=np.int32) >> 2
    negative = v < 0
    magnitude = np.minimum(np.abs(v), _ULAW_CLIP) + _ULAW_BIAS
    segment = np.searchsorted(_ULAW_SEGMENT_ENDS, magnitude)
    step = np.minimum(segment, 7)
    code = np.where(segment >= 8, 0x7F, (step << 4) | ((magnitude >> (step + 1)) & 0xF))
    return (code ^ np.where(negative, 0x7F, 0xFF)).astype(np.uint8)


def _alaw_table() -> np.ndarray:
    v = np.arange(-32768, 32768, dtype=np.int32) >> 3
    negative = v < 0
    magnitude = np.where(negative, -v - 1, v)
    segment = np.searchsorted(_ALAW_SEGMENT_ENDS, magnitude)
    step = np.minimum(segment, 7)
    code = np.where(segment >= 8, 0x7F, (step << 4) | ((magnitude >> np.maximum(step, 1)) & 0xF))
    return (code ^ np.where(negative, 0x55, 0xD5)).astype(np.uint8)


_ULAW = _ulaw_table()
_ALAW = _alaw_table()


def ulaw_bytes(pcm16: np.ndarray) -> bytes:
    """int16 samples → G.711 mu-law bytes, one per sample."""
    return _ULAW[pcm16.astype(np.int32) + 32768].tobytes()


def alaw_bytes(pcm16: np.ndarray) -> bytes:
    """int16 samples → G.711 A-law bytes, one per sample."""
    return _ALAW[pcm16.astype(np.int32) + 32768].tobytes()
