"""K/V rows at fixed device addresses, so a whole step can be captured as one CUDA graph (row_graphs.py).

A captured graph replays the kernels it recorded on the tensors it recorded: a session's K/V must stay
at one address for its life, and every session a step batches must be reachable from the same graph.
The arena holds, per layer, one (S + 1, Hkv, R, D) slab for K and one for V: slot s is a session's rows
0..R-1, and the last slot is scratch, where a graph's padding rows write. A session's store
(`ArenaStore`, the backend's store for `CacheGeometry.make_store`) is a SlabStore whose per-layer slabs
are views of its slot, so every strategy's bookkeeping (kv/) runs unchanged over it: writes, reads,
growth up to R rows, compaction and state all go through the views. A store that must outgrow R rows,
or a cache built when every slot is taken, gets its own slabs (the ordinary SlabStore) and its steps take
the piecewise path. A slot returns to the arena when its store is garbage-collected.
"""
from __future__ import annotations

import logging
import threading
import weakref

import torch

from inference_engine.kv.stores import SlabStore, SlotStore, make_store

log = logging.getLogger("kakeya")


class KVArena:
    """S session slots of R rows per layer (plus one scratch slot), K and V, in the model's dtype."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, sessions: int, rows: int,
                 dtype: torch.dtype, device: str | torch.device):
        self.sessions, self.rows, self.dtype, self.device = sessions, rows, dtype, torch.device(device)
        shape = (sessions + 1, num_kv_heads, rows, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.scratch = sessions  # padding rows of a graph write here
        self._free = list(range(sessions - 1, -1, -1))
        self._lock = threading.Lock()
        self.fallbacks = 0  # caches that got their own slabs (arena full, or asked for more than R rows)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def claim(self) -> int | None:
        with self._lock:
            return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def make_store(self, compressor: str, q_range: int, *, num_layers: int, num_kv_heads: int, head_dim: int,
                   capacity: int, dtype: torch.dtype, device: str | torch.device) -> SlotStore:
        """stores.make_store's signature: uncompressed rows of this dtype and device up to R rows live in a
        slot of the arena; anything else (a codec, int8 rows, a longer cache, no free slot) as make_store builds it."""
        if compressor == "identity" and dtype == self.dtype and torch.device(device) == self.device and capacity <= self.rows:
            slot = self.claim()
            if slot is not None:
                return ArenaStore(self, slot, num_kv_heads, head_dim, capacity)
        self.fallbacks += 1
        return make_store(compressor, q_range, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          capacity=capacity, dtype=dtype, device=device)


class ArenaStore(SlabStore):
    """A SlabStore whose slabs are views of one arena slot (rows 0..capacity-1); `slot` is None once it
    left the arena (grown past R rows, or loaded from a longer state): then it is a plain SlabStore."""

    def __init__(self, arena: KVArena, slot: int, num_kv_heads: int, head_dim: int, capacity: int):
        SlotStore.__init__(self, capacity, arena.device)  # no slabs of its own
        self.arena: KVArena | None = arena
        self.slot: int | None = slot
        self._finalizer = weakref.finalize(self, arena.release, slot)
        self._zero(0, capacity)  # rows a previous session left
        self._view(capacity)

    def _view(self, capacity: int) -> None:
        assert self.arena is not None and self.slot is not None
        self.k = [a[self.slot, :, :capacity] for a in self.arena.k]
        self.v = [a[self.slot, :, :capacity] for a in self.arena.v]

    def _zero(self, start: int, end: int) -> None:
        assert self.arena is not None and self.slot is not None
        for a in (*self.arena.k, *self.arena.v):
            a[self.slot, :, start:end].zero_()

    def _leave(self) -> None:
        """Copy the rows out to slabs of its own and give the slot back."""
        if self.slot is None:
            return
        self.k = [x.clone() for x in self.k]
        self.v = [x.clone() for x in self.v]
        self.slot, self.arena = None, None
        self._finalizer()

    def _grow(self, capacity: int) -> None:
        if self.arena is not None and capacity <= self.arena.rows:
            self._zero(self.capacity, capacity)
            self._view(capacity)
            return
        self._leave()
        super()._grow(capacity)

    def _move(self, src: torch.Tensor, dst: torch.Tensor, capacity: int) -> None:
        if self.arena is None or capacity > self.arena.rows:
            self._leave()
            super()._move(src, dst, capacity)
            return
        rows_k = [x.index_select(1, src) for x in self.k]  # copies: source and destination share the slot
        rows_v = [x.index_select(1, src) for x in self.v]
        self._zero(0, capacity)
        self._view(capacity)
        for x, r in zip(self.k, rows_k):
            x.index_copy_(1, dst, r)
        for x, r in zip(self.v, rows_v):
            x.index_copy_(1, dst, r)

    def _load_payload(self, payload: dict) -> None:
        capacity = payload["k"].shape[2]
        if self.arena is None or capacity > self.arena.rows:
            self._leave()
            super()._load_payload(payload)
            return
        self._view(capacity)
        for x, t in zip(self.k, payload["k"].unbind(0)):
            x.copy_(t)
        for x, t in zip(self.v, payload["v"].unbind(0)):
            x.copy_(t)
