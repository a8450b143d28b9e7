"""Batch-size buckets shared by the talker's and the decoder's static shapes (one CUDA graph per bucket)."""
from __future__ import annotations


def batch_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_rows (padding wastes at most 7 rows of a large batch)."""
    small = [b for b in (1, 2, 4, 8) if b < max_rows]
    return small + list(range(16, max_rows, 8)) + [max_rows]


def bucket(buckets: list[int], n: int) -> int:
    """The smallest bucket that holds n."""
    return next(b for b in buckets if b >= n)
