"""Per-session resident KV caches: one slot-addressed protocol for every strategy.

A forward pass over T new tokens is three calls:

    layout = cache.prepare(positions)          # pick slots, build attention masks
    k_all, v_all = cache.update_and_fetch(layer, k, v)   # once per layer
    cache.commit(n_keep)                       # keep the first n_keep tokens, roll back the rest

Tokens written by `prepare`/`update_and_fetch` are provisional until `commit`, which is
what makes speculative rollback exact: slots of positions that left the window are only
reused after a commit, so a rejected verify step leaves the previous state intact.

Attention of a query at position p sees exactly the keys its strategy allows:
  full:        every position <= p
  sink_window: positions < sink, and positions in (p - window, p]
intersected with the model's own per-layer window (Gemma 3 local layers). The result
therefore does not depend on how the history was split into chunks.

Invariants (ADR 0008 §2.8) are checked at every mutation and raise `CacheInvariantError`:
INV-1 every layer holds exactly as many K/V rows as there are resident positions;
INV-2 positions are appended contiguously and never go backwards.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_engine.errors import CacheInvariantError


@dataclass(frozen=True)
class KVStrategy:
    """Which positions a query may attend to; `sink`/`window` only apply to `sink_window`."""

    name: str = "full"
    sink: int = 4
    window: int = 1020

    def __post_init__(self):
        if self.name not in ("full", "sink_window"):
            raise ValueError(f"unknown kv strategy {self.name!r}; choose 'full' or 'sink_window'")
        if self.name == "sink_window" and (self.sink < 0 or self.window < 1):
            raise ValueError(f"sink_window needs sink >= 0 and window >= 1, got sink={self.sink} window={self.window}")

    @property
    def bounded(self) -> bool:
        return self.name != "full"


@dataclass
class AttentionLayout:
    """What one forward pass needs from the cache: where new tokens go and who sees whom."""

    positions: torch.Tensor  # (T,) positions of the new tokens
    slots: torch.Tensor  # (T,) cache slots they are written to
    key_positions: torch.Tensor  # (N,) position held by each of the first N slots, -1 = empty
    masks: dict  # layer window (int | None) -> (T, N) bool, True = attend
    # Past the trained context, sink keys are scored as if the query stood at a fixed
    # virtual position (see SinkWindowCache); None = never.
    sink_shift: "SinkShift | None" = None


@dataclass(frozen=True)
class SinkShift:
    from_position: int  # queries at or past this position use the virtual query position for sink keys
    sink: int  # keys at positions < sink are the sink
    virtual_query_position: int


@dataclass(frozen=True)
class CacheGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_windows: tuple  # per layer: model sliding window or None
    dtype: torch.dtype = torch.float32
    device: str = "cpu"


class SlotKVCache:
    """Shared machinery: per-layer K/V slabs (Hkv, capacity, D) addressed by slot."""

    def __init__(self, geometry: CacheGeometry, capacity: int):
        self.geometry = geometry
        self.capacity = capacity
        g = geometry
        self.k = [torch.zeros(g.num_kv_heads, capacity, g.head_dim, dtype=g.dtype, device=g.device) for _ in range(g.num_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.pos = torch.full((capacity,), -1, dtype=torch.long, device=g.device)
        self.next_position = 0  # committed tokens == next position to write
        self.dropped_total = 0  # positions that left attention for good
        self._layer_rows = [0] * g.num_layers  # K/V rows written per layer (INV-1)
        self._layout: AttentionLayout | None = None

    # -- protocol --------------------------------------------------------------------
    def prepare(self, positions: torch.Tensor) -> AttentionLayout:
        t = int(positions.numel())
        expected = self.next_position
        first = int(positions[0]) if t else expected
        if t == 0 or first != expected or int(positions[-1]) != expected + t - 1:
            raise CacheInvariantError(
                "inv2", f"new positions must continue at {expected} contiguously, got {first}..{int(positions[-1]) if t else first}"
            )
        if self._layout is not None:
            raise CacheInvariantError("inv1", "prepare() called while a previous step is uncommitted")
        slots = self._allocate(t)
        self._rows_before = list(self._layer_rows)
        self.pos[slots] = positions
        n = self._key_count()
        key_pos = self.pos[:n]
        masks = {w: self._mask(positions, key_pos, w) for w in set(self.geometry.layer_windows)}
        self._layout = AttentionLayout(positions, slots, key_pos, masks, self._sink_shift())
        return self._layout

    def update_and_fetch(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        # k, v: (Hkv, T, D)
        layout = self._layout
        if layout is None or k.shape[1] != layout.slots.numel():
            raise CacheInvariantError("inv1", f"layer {layer} update does not match the prepared step")
        self.k[layer].index_copy_(1, layout.slots, k)
        self.v[layer].index_copy_(1, layout.slots, v)
        self._layer_rows[layer] += k.shape[1]
        n = layout.key_positions.numel()
        return self.k[layer][:, :n], self.v[layer][:, :n]

    def commit(self, n_keep: int | None = None) -> int:
        """Keep the first n_keep new tokens (all if None); returns positions dropped from attention."""
        layout = self._layout
        if layout is None:
            raise CacheInvariantError("inv1", "commit() without a prepared step")
        t = layout.slots.numel()
        n_keep = t if n_keep is None else n_keep
        if not 0 <= n_keep <= t:
            raise ValueError(f"n_keep must be in [0, {t}], got {n_keep}")
        self._layout = None
        if n_keep < t:
            self._release(layout.slots[n_keep:])
        self._layer_rows = [r - (t - n_keep) for r in self._layer_rows]
        self.next_position += n_keep
        dropped = self._evict_dead()
        self.dropped_total += dropped
        self._layer_rows = [r - dropped for r in self._layer_rows]
        self.check_inv1()
        return dropped

    def abort(self) -> None:
        """Drop an uncommitted step entirely (the forward failed part-way)."""
        layout = self._layout
        if layout is None:
            return
        self._layout = None
        self._release(layout.slots)
        self._layer_rows = list(self._rows_before)

    def check_inv1(self) -> None:
        resident = self.resident_positions
        bad = [i for i, r in enumerate(self._layer_rows) if r != resident]
        if bad:
            raise CacheInvariantError("inv1", f"layers {bad} hold {[self._layer_rows[i] for i in bad]} rows for {resident} resident positions")

    @property
    def resident_positions(self) -> int:
        return int((self.pos >= 0).sum())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    # -- strategy hooks ----------------------------------------------------------------
    def _allocate(self, t: int) -> torch.Tensor:
        raise NotImplementedError

    def _key_count(self) -> int:
        raise NotImplementedError

    def _release(self, slots: torch.Tensor) -> None:
        self.pos[slots] = -1

    def _evict_dead(self) -> int:
        return 0

    def _sink_shift(self) -> SinkShift | None:
        return None

    def _allowed(self, qp: torch.Tensor, kp: torch.Tensor) -> torch.Tensor:
        return (kp >= 0) & (kp <= qp)

    def _mask(self, positions, key_pos, layer_window):
        qp = positions[:, None]
        kp = key_pos[None, :]
        m = self._allowed(qp, kp)
        if layer_window is not None:
            m = m & (kp > qp - layer_window)
        return m


class FullKVCache(SlotKVCache):
    """Unbounded cache (the oracle): slots are positions; capacity doubles when full."""

    def __init__(self, geometry: CacheGeometry, initial_capacity: int = 256):
        super().__init__(geometry, initial_capacity)

    def _allocate(self, t: int) -> torch.Tensor:
        need = self.next_position + t
        if need > self.capacity:
            new_cap = max(need, 2 * self.capacity)
            grow = new_cap - self.capacity
            self.k = [torch.cat([x, x.new_zeros(x.shape[0], grow, x.shape[2])], 1) for x in self.k]
            self.v = [torch.cat([x, x.new_zeros(x.shape[0], grow, x.shape[2])], 1) for x in self.v]
            self.pos = torch.cat([self.pos, self.pos.new_full((grow,), -1)])
            self.capacity = new_cap
        return torch.arange(self.next_position, need, device=self.pos.device)

    def _key_count(self) -> int:
        return self.next_position + self._layout_t

    def prepare(self, positions):
        self._layout_t = int(positions.numel())
        return super().prepare(positions)


class SinkWindowCache(SlotKVCache):
    """Attention sink + sliding window in a fixed slab of sink + window + max_step slots.

    Slots are reused once their position can no longer be seen by any future query, so
    memory never grows. Key order inside the slab is not chronological; masks go by
    position. Past the model's trained context (`max_context`), absolute distances to the
    sink would leave the trained range, so a query at p >= max_context sees the sink as if
    it sat immediately before its window: the sink is scored as if the query stood at
    position sink + window - 1 (StreamingLLM's cache-position layout). Window keys keep
    their true positions; RoPE only sees their distance to the query, which is < window.
    """

    def __init__(self, geometry: CacheGeometry, sink: int, window: int, max_step: int, max_context: int):
        super().__init__(geometry, sink + window + max_step)
        self.sink, self.window, self.max_step, self.max_context = sink, window, max_step, max_context

    def _allocate(self, t: int) -> torch.Tensor:
        if t > self.max_step:
            raise ValueError(f"a step of {t} tokens exceeds this cache's max step of {self.max_step}; prefill in smaller chunks")
        free = torch.nonzero(self.pos < 0).flatten()
        if free.numel() < t:  # unreachable while commit evicts dead positions
            raise CacheInvariantError("inv1", f"{free.numel()} free slots for a step of {t}")
        return free[:t]

    def _key_count(self) -> int:
        return self.capacity

    def _allowed(self, qp, kp):
        return (kp >= 0) & (kp <= qp) & ((kp < self.sink) | (kp > qp - self.window))

    def _evict_dead(self) -> int:
        # The next query sits at next_position and sees (next_position - window, next_position].
        dead = (self.pos >= self.sink) & (self.pos <= self.next_position - self.window)
        n = int(dead.sum())
        if n:
            self.pos[dead] = -1
        return n

    def _sink_shift(self) -> SinkShift | None:
        return SinkShift(self.max_context, self.sink, self.sink + self.window - 1)


def make_cache(strategy: KVStrategy, geometry: CacheGeometry, *, max_step: int, max_context: int) -> SlotKVCache:
    if strategy.name == "full":
        return FullKVCache(geometry)
    return SinkWindowCache(geometry, strategy.sink, strategy.window, max_step, max_context)
