"""SinkWindowCache: attention sink + sliding window in a bounded slab."""
from __future__ import annotations

import numpy as np

from inference_engine.kv.layout import CacheGeometry, SinkShift
from inference_engine.kv.slot_cache import CacheState, SlotKVCache
from inference_engine.kv.strategy import KVStrategy


class SinkWindowCache(SlotKVCache):
    """Attention sink + sliding window in a slab of sink + window + min(max_step, 16) slots.

    Slots are reused once their position can no longer be seen by any future query, so
    memory never grows between steps. A step longer than the spare room (a prefill chunk)
    grows the slab for that step only; the commit moves the resident rows to the front and
    gives the room back, so `nbytes` between steps is constant and `peak_nbytes` records
    the transient. Key order inside the slab is not chronological; masks go by position.

    Past the model's trained context (`max_context`), absolute distances to the sink would
    leave the trained range, so a query at p >= max_context sees the sink as if it sat
    immediately before its window: the sink is scored as if the query stood at position
    sink + window - 1 (StreamingLLM's cache-position layout). Window keys keep their true
    positions; RoPE only sees their distance to the query, which is < window.
    """

    STEP_ROOM = 16  # spare slots kept between steps: decode and speculative verify steps fit
    # Steps that fit the spare room put position p >= sink at slot sink + (p - sink) mod ring (the
    # slab past the sink), so a position's key column never depends on how the tokens were grouped
    # into steps: a speculative verify block reads its keys in the same order sequential decode
    # steps do, which row-exact attention needs to reproduce them bit for bit.
    RING = True

    def __init__(self, strategy: KVStrategy, geometry: CacheGeometry, max_step: int, max_context: int, extra_resident: int = 0):
        self.sink, self.window, self.max_step, self.max_context = strategy.sink, strategy.window, max_step, max_context
        self.base_capacity = self.sink + self.window + extra_resident + min(max_step, self.STEP_ROOM)
        super().__init__(strategy, geometry, self.base_capacity)
        self.base_capacity = self.capacity  # as the store allocated it (an int8 store rounds up)

    def _allocate(self, t: int) -> np.ndarray:
        if t > self.max_step:
            raise ValueError(f"a step of {t} tokens exceeds this cache's max step of {self.max_step}; prefill in smaller chunks")
        if self.RING and self.capacity == self.base_capacity:
            slots = self._ring_slots(np.arange(self.next_position, self.next_position + t))
            if t <= self.base_capacity - self.sink - self.window and not (self.store.pos[slots] >= 0).any():
                return slots
        free = self.store.free_slots(t)
        if free.size < t:
            self._resize(self.capacity + t - free.size)
            free = self.store.free_slots(t)
        return free

    def exact_step_room(self) -> int:
        return max(1, self.base_capacity - self.sink - self.window) if self.RING else 1

    def load_state(self, state: CacheState) -> None:
        super().load_state(state)
        if self.RING:  # a state saved before ring placement (or by a grown slab): put its rows on the ring
            live = self.store.pos[self.store.occupied()]
            if not np.array_equal(self.store.occupied(), self._ring_slots(live)):
                self.store.relocate(max(self.capacity, self.base_capacity), self._ring_slots(live))

    def _ring_slots(self, positions: np.ndarray) -> np.ndarray:
        ring = self.base_capacity - self.sink
        return np.where(positions < self.sink, positions, self.sink + (positions - self.sink) % ring)

    def _settle(self) -> None:
        if self.capacity > self.base_capacity:  # resident rows (< sink + window) always fit
            if self.RING:
                self.store.relocate(self.base_capacity, self._ring_slots(self.store.pos[self.store.occupied()]))
            else:
                self._resize(self.base_capacity)

    def _key_count(self, t: int) -> int:
        return self.capacity

    def _allowed(self, qp: np.ndarray, kp: np.ndarray) -> np.ndarray:
        return (kp >= 0) & (kp <= qp) & ((kp < self.sink) | (kp > qp - self.window))

    def _evict_dead(self) -> int:
        # The next query sits at next_position and sees (next_position - window, next_position].
        return self._evict_through(self.next_position - self.window)

    def _evict_through(self, upto: int, keep: np.ndarray | None = None) -> int:
        """Free the slots of positions in [sink, upto], except positions listed in `keep`."""
        pos = self.store.pos
        dead = (pos >= self.sink) & (pos <= upto)
        if keep is not None and keep.size:
            dead &= ~np.isin(pos, keep)
        slots = np.flatnonzero(dead)
        if slots.size:
            self.store.release(slots)
        return int(slots.size)

    def _sink_shift(self) -> SinkShift | None:
        return SinkShift(self.max_context, self.sink, self.sink + self.window - 1)
