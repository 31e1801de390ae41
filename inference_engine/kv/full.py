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
            # A whole-slab store reads every slot each step: grow in quarters, not doublings.
            grown = -(-self.capacity * 5 // 4 // 64) * 64 if self.store.whole_slab_reads else 2 * self.capacity
            self._resize(max(need, grown))
        return np.arange(self.next_position, need, dtype=np.int64)

    def exact_step_room(self) -> int:
        # A whole-slab store's key count is its capacity: a step that grows it would read more
        # columns than one-token steps before the growth did.
        return max(1, self.capacity - self.next_position) if self.store.whole_slab_reads else super().exact_step_room()

    def _key_count(self, t: int) -> int:
        return self.next_position + t
