"""An LRU of numpy arrays bounded by their bytes: the voice store's decoded voices, the API's voice embeddings."""
from __future__ import annotations

import collections
import threading
from collections.abc import Hashable

import numpy as np


class ArrayLRU:
    """Arrays by key, the least recently used leaving first once they hold more than `limit_bytes` together (one
    array larger than the limit is kept alone). Thread-safe."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.nbytes = 0
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[Hashable, np.ndarray] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> np.ndarray | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: Hashable, value: np.ndarray) -> None:
        with self._lock:
            self._pop(key)
            self._entries[key] = value
            self.nbytes += value.nbytes
            while self.nbytes > self.limit_bytes and len(self._entries) > 1:
                _, evicted = self._entries.popitem(last=False)
                self.nbytes -= evicted.nbytes

    def pop(self, key: Hashable) -> None:
        with self._lock:
            self._pop(key)

    def _pop(self, key: Hashable) -> None:
        evicted = self._entries.pop(key, None)
        if evicted is not None:
            self.nbytes -= evicted.nbytes
