"""FullKVCache: every position stays resident (the oracle strategy)."""
from __future__ import annotations

import numpy as np

from inference_engine.kv.layout import CacheGeometry
from inference_engine.kv.slot_cache import SlotKVCache
from inference_engine.kv.strategy import KVStrategy


class FullKVCache(SlotKVCache):
    """Unbounded cache: slots are positions; capacity doubles when full."""

    def __init__(self, strategy: KVStrategy, geometry: CacheGeometry, initial_capacity: int = 256):
        super().__init__(strategy, geometry, initial_capacity)

    def _allocate(self, t: int) -> np.ndarray:
        need = self.next_position + t
        if need > self.capacity:
            self._resize(max(need, 2 * self.capacity))
        return np.arange(self.next_position, need, dtype=np.int64)

    def _key_count(self, t: int) -> int:
        return self.next_position + t
