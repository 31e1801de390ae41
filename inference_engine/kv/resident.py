"""Per-session resident KV caches: one slot-addressed protocol for every strategy.

A forward pass over T new tokens is three calls:

    layout = cache.prepare(positions, ids)     # pick slots, build attention masks
    k_all, v_all = cache.update_and_fetch(layer, k, v)   # once per layer
    cache.commit(n_keep)                       # keep the first n_keep tokens, roll back the rest

Tokens written by `prepare`/`update_and_fetch` are provisional until `commit`, which is
what makes speculative rollback exact: slots of positions that left the window are only
reused after a commit, so a rejected verify step leaves the previous state intact.

Attention of a query at position p sees exactly the keys its strategy allows:
  full:        every position <= p
  sink_window: positions < sink, and positions in (p - window, p]
  dlm_restore: every position <= p; the cache holds sink_window's positions, the rest
               (the evicted ones) are restored for the step by a RestoreSource (restore.py)
intersected with the model's own per-layer window (Gemma 3 local layers). The result
therefore does not depend on how the history was split into chunks.

Where rows live is the cache's store (stores.py): fp32 slabs, or a KVCompressor per layer
(`compressor="kakeya_d4"` / `"kakeya_e8"`), in which case a step's own K/V are compressed
before its queries read them back, and `nbytes` is the packed bytes of the store.

Invariants (ADR 0008 §2.8) are checked at every mutation and raise `CacheInvariantError`:
INV-1 every layer holds exactly as many K/V rows as there are resident positions;
INV-2 positions are appended contiguously and never go backwards.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_engine.errors import CacheInvariantError
from inference_engine.kv.compressors import COMPRESSOR_NAMES, MAX_Q_RANGE
from inference_engine.kv.restore import RESTORE_FROM, HeldRestore
from inference_engine.kv.stores import make_store

STRATEGY_NAMES = ("full", "sink_window", "dlm_restore")


@dataclass(frozen=True)
class KVStrategy:
    """Which positions a query may attend to and how the resident cache stores them.

    `sink`/`window` apply to the bounded strategies; `restore_from`, `restore_refresh`
    (reuse restored K/V for up to N steps; 1 = recompute every step) and `restore_pin` (keep
    the P evicted positions the proposer restores worst resident) to `dlm_restore`;
    `compressor`/`q_range` to every strategy (identity = uncompressed slabs)."""

    name: str = "full"
    sink: int = 4
    window: int = 1020
    compressor: str = "identity"
    q_range: int = 38
    restore_from: str = "verifier"
    restore_refresh: int = 1
    restore_pin: int = 0

    def __post_init__(self):
        if self.name not in STRATEGY_NAMES:
            raise ValueError(f"unknown kv strategy {self.name!r}; choose one of {', '.join(STRATEGY_NAMES)}")
        if self.bounded and (self.sink < 0 or self.window < 1):
            raise ValueError(f"{self.name} needs sink >= 0 and window >= 1, got sink={self.sink} window={self.window}")
        if self.compressor not in COMPRESSOR_NAMES:
            raise ValueError(f"unknown kv compressor {self.compressor!r}; choose one of {', '.join(COMPRESSOR_NAMES)}")
        if not isinstance(self.q_range, int) or not 1 <= self.q_range <= MAX_Q_RANGE:
            raise ValueError(f"kv q_range must be an int in [1, {MAX_Q_RANGE}], got {self.q_range!r} (38 is the default)")
        if self.restore_from not in RESTORE_FROM:
            raise ValueError(
                f"restore_from {self.restore_from!r} is not available; choose one of {', '.join(RESTORE_FROM)} "
                "(verifier = same-model, drafter = cross-model with --drafter NAME)"
            )
        if not isinstance(self.restore_refresh, int) or self.restore_refresh < 1:
            raise ValueError(f"restore_refresh must be an int >= 1 (1 = restore every step), got {self.restore_refresh!r}")
        if not isinstance(self.restore_pin, int) or self.restore_pin < 0:
            raise ValueError(f"restore_pin must be an int >= 0 (0 = no pinned positions), got {self.restore_pin!r}")
        if self.restore_pin and (self.name != "dlm_restore" or self.restore_from != "drafter"):
            raise ValueError("restore_pin keeps the positions a learned proposer restores worst; it needs "
                             "kv_strategy dlm_restore with restore_from drafter (same-model restoration is exact)")
        if self.restore_pin and self.restore_refresh != 1:
            raise ValueError("restore_pin and restore_refresh > 1 cannot be combined (a held set cannot follow the pins)")

    def describe(self) -> dict:
        """Parameters that shape this strategy, as strings (GetServerInfo reports them as a map)."""
        out = {"compressor": self.compressor}
        if self.compressor != "identity":
            out["q_range"] = str(self.q_range)
        if self.bounded:
            out |= {"sink": str(self.sink), "window": str(self.window)}
        if self.name == "dlm_restore":
            out |= {"restore_from": self.restore_from, "restore_refresh": str(self.restore_refresh),
                    "restore_pin": str(self.restore_pin)}
        return out

    @property
    def bounded(self) -> bool:
        """Resident memory stays bounded whatever the history length."""
        return self.name != "full"

    @property
    def forgets(self) -> bool:
        """Positions leave attention for good (only sink_window; dlm_restore restores them)."""
        return self.name == "sink_window"


@dataclass
class AttentionLayout:
    """What one forward pass needs from the cache: where new tokens go and who sees whom."""

    positions: torch.Tensor  # (T,) positions of the new tokens
    slots: torch.Tensor  # (T,) cache slots they are written to
    key_positions: torch.Tensor  # (N,) position of each key update_and_fetch returns, -1 = empty
    masks: dict  # layer window (int | None) -> (T, N) bool, True = attend
    # Past the trained context, sink keys are scored as if the query stood at a fixed
    # virtual position (see SinkWindowCache); None = never.
    sink_shift: "SinkShift | None" = None
    key_slots: torch.Tensor | None = None  # (N,) slots the keys come from; None = slots 0..N-1
    restore: "RestorePlan | None" = None  # dlm_restore: evicted positions to restore this step


@dataclass
class RestorePlan:
    """Evicted positions a dlm_restore step attends to besides the resident keys."""

    history: torch.Tensor  # (n,) token ids of positions 0 .. last position of the step
    positions: torch.Tensor  # (E,) evicted positions, ascending
    masks: dict  # layer window -> (T, E) bool
    held: "HeldRestore | None" = None  # refresh option: replay these instead of running the proposer
    record: "HeldRestore | None" = None  # refresh option: keep what the proposer returns here

    def open_step(self, source):
        """The RestoreStep for this plan: a replay of held K/V, or `source`'s (recorded if asked)."""
        if self.held is not None:
            return self.held.replay()
        step = source.open_step(self.history, self.positions)
        return self.record.recording(step) if self.record is not None else step


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
    """Shared machinery: per-layer K/V rows in a store, addressed by slot.

    Mutations run under inference mode: the model writes (and grows) the cache inside its
    inference-mode forward, and the engine commits outside it."""

    def __init__(self, geometry: CacheGeometry, capacity: int, *, compressor: str = "identity", q_range: int = 38):
        self.geometry = geometry
        self.capacity = capacity
        g = geometry
        self.store = make_store(compressor, q_range, num_layers=g.num_layers, num_kv_heads=g.num_kv_heads,
                                head_dim=g.head_dim, capacity=capacity, dtype=g.dtype, device=g.device)
        self.pos = torch.full((capacity,), -1, dtype=torch.long, device=g.device)
        self.next_position = 0  # committed tokens == next position to write
        self.dropped_total = 0  # positions that left attention for good
        self._layer_rows = [0] * g.num_layers  # K/V rows written per layer (INV-1)
        self._layout: AttentionLayout | None = None
        self._peak_nbytes = self.store.nbytes

    @property
    def compressor(self) -> str:
        return self.store.compressor

    # -- protocol --------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, positions: torch.Tensor, ids: torch.Tensor | None = None) -> AttentionLayout:
        """Reserve slots for new tokens at `positions`; `ids` (their token ids) is only needed
        by caches that restore evicted positions."""
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
        key_slots = self.store.key_slots(self.pos[:n])
        key_pos = self.pos[:n] if key_slots is None else self.pos[key_slots]
        masks = {w: self._mask(positions, key_pos, w) for w in set(self.geometry.layer_windows)}
        self._layout = AttentionLayout(positions, slots, key_pos, masks, self._sink_shift(), key_slots,
                                       self._restore_plan(positions, ids))
        return self._layout

    @torch.inference_mode()
    def update_and_fetch(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store the step's k, v (Hkv, T, D); return every key/value its queries may read,
        (Hkv, N, D) in layout.key_positions order, the step's own rows as stored."""
        layout = self._layout
        if layout is None or k.shape[1] != layout.slots.numel():
            raise CacheInvariantError("inv1", f"layer {layer} update does not match the prepared step")
        self.store.write(layer, layout.slots, k, v)
        self._layer_rows[layer] += k.shape[1]
        return self.store.fetch(layer, layout.key_positions.numel(), layout.key_slots)

    @torch.inference_mode()
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
        evicted = self._evict_dead()
        self._layer_rows = [r - evicted for r in self._layer_rows]
        self._settle()
        self.check_inv1()
        dropped = self._dropped(evicted)
        self.dropped_total += dropped
        return dropped

    @torch.inference_mode()
    def abort(self) -> None:
        """Drop an uncommitted step entirely (the forward failed part-way)."""
        layout = self._layout
        if layout is None:
            return
        self._layout = None
        self._release(layout.slots)
        self._layer_rows = list(self._rows_before)
        self._settle()

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
        """Bytes of K/V storage the cache holds (packed bytes for a compressed store)."""
        return self.store.nbytes

    @property
    def peak_nbytes(self) -> int:
        """Most bytes of K/V storage ever held at once, transient step growth included."""
        return max(self._peak_nbytes, self.store.nbytes)

    def _resize_slots(self, capacity: int) -> None:
        """Grow the store to `capacity` slots, or shrink it by moving the resident rows to the front."""
        if capacity > self.capacity:
            self.store.grow(capacity)
            self.pos = torch.cat([self.pos, self.pos.new_full((capacity - self.capacity,), -1)])
        else:
            live = torch.nonzero(self.pos >= 0).flatten()
            self.store.compact(live, capacity)
            pos = self.pos.new_full((capacity,), -1)
            pos[: live.numel()] = self.pos[live]
            self.pos = pos
        self.capacity = capacity
        self._peak_nbytes = max(self._peak_nbytes, self.nbytes)

    # -- strategy hooks ----------------------------------------------------------------
    def _allocate(self, t: int) -> torch.Tensor:
        raise NotImplementedError

    def _key_count(self) -> int:
        raise NotImplementedError

    def _release(self, slots: torch.Tensor) -> None:
        self.pos[slots] = -1
        self.store.evict(slots)

    def _settle(self) -> None:
        """After a step is committed or aborted: give back transient room (bounded caches)."""

    def _evict_dead(self) -> int:
        return 0

    def _dropped(self, evicted: int) -> int:
        return evicted

    def _sink_shift(self) -> SinkShift | None:
        return None

    def _restore_plan(self, positions: torch.Tensor, ids: torch.Tensor | None) -> RestorePlan | None:
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

    def __init__(self, geometry: CacheGeometry, initial_capacity: int = 256, **store):
        super().__init__(geometry, initial_capacity, **store)

    def _allocate(self, t: int) -> torch.Tensor:
        need = self.next_position + t
        if need > self.capacity:
            self._resize_slots(max(need, 2 * self.capacity))
        return torch.arange(self.next_position, need, device=self.pos.device)

    def _key_count(self) -> int:
        return self.next_position + self._layout_t

    def prepare(self, positions, ids=None):
        self._layout_t = int(positions.numel())
        return super().prepare(positions, ids)


class SinkWindowCache(SlotKVCache):
    """Attention sink + sliding window in a slab of sink + window + min(max_step, 16) slots.

    Slots are reused once their position can no longer be seen by any future query, so
    memory never grows between steps. A step longer than the spare room (a prefill chunk)
    grows the slab for that step only; the commit moves the resident rows to the front and
    gives the room back, so `nbytes` between steps is constant and `peak_nbytes` records
    the transient. Key order inside the slab is not chronological; masks go by position. Past the model's trained context (`max_context`), absolute distances to the
    sink would leave the trained range, so a query at p >= max_context sees the sink as if
    it sat immediately before its window: the sink is scored as if the query stood at
    position sink + window - 1 (StreamingLLM's cache-position layout). Window keys keep
    their true positions; RoPE only sees their distance to the query, which is < window.
    """

    STEP_ROOM = 16  # spare slots kept between steps: decode and speculative verify steps fit

    def __init__(self, geometry: CacheGeometry, sink: int, window: int, max_step: int, max_context: int, **store):
        self.base_capacity = sink + window + min(max_step, self.STEP_ROOM)
        super().__init__(geometry, self.base_capacity, **store)
        self.sink, self.window, self.max_step, self.max_context = sink, window, max_step, max_context

    def _allocate(self, t: int) -> torch.Tensor:
        if t > self.max_step:
            raise ValueError(f"a step of {t} tokens exceeds this cache's max step of {self.max_step}; prefill in smaller chunks")
        free = torch.nonzero(self.pos < 0).flatten()
        if free.numel() < t:
            self._resize_slots(self.capacity + t - free.numel())
            free = torch.nonzero(self.pos < 0).flatten()
        return free[:t]

    def _settle(self) -> None:
        if self.capacity > self.base_capacity:  # resident rows (< sink + window) always fit
            self._resize_slots(self.base_capacity)

    def _key_count(self) -> int:
        return self.capacity

    def _allowed(self, qp, kp):
        return (kp >= 0) & (kp <= qp) & ((kp < self.sink) | (kp > qp - self.window))

    def _evict_dead(self) -> int:
        # The next query sits at next_position and sees (next_position - window, next_position].
        return self._evict_through(self.next_position - self.window)

    def _evict_through(self, upto: int, keep: torch.Tensor | None = None) -> int:
        """Free the slots of positions in [sink, upto], except positions listed in `keep`."""
        dead = (self.pos >= self.sink) & (self.pos <= upto)
        if keep is not None and keep.numel():
            dead &= ~torch.isin(self.pos, keep)
        slots = torch.nonzero(dead).flatten()
        if slots.numel():
            self.pos[slots] = -1
            self.store.evict(slots)
        return int(slots.numel())

    def _sink_shift(self) -> SinkShift | None:
        return SinkShift(self.max_context, self.sink, self.sink + self.window - 1)


class DLMRestoreCache(SinkWindowCache):
    """sink_window's resident positions; every evicted position is restored for each step.

    Resident memory is exactly sink_window's. The step's queries attend causally to every
    resident key and to the evicted positions [sink, next_position - window], whose K/V a
    RestoreSource computes for that step only (restore.py; the backend fetches them layer by
    layer). Nothing leaves attention, so `commit` reports no dropped positions; the cache
    counts evictions from the resident store in `evicted_total`. It keeps the token ids of
    the history (int32, 4 bytes a token; not K/V, not in `nbytes`) because the proposer
    re-reads them every step. Attention is the `full` one, so the history is limited to
    the trained context as for `full` (no sink re-anchoring).

    restore_pin P > 0 (cross-model): as positions leave the window, the proposer restores them
    once and its V error against the resident rows is measured; the P worst-restored evicted
    positions so far stay resident ("pinned", attended exactly), the rest are evicted and
    restored every step. Resident memory is sink + window + P rows, flat in the history.
    """

    def __init__(self, geometry: CacheGeometry, sink: int, window: int, max_step: int, max_context: int, *,
                 restore_from: str = "verifier", restore_source=None, restore_refresh: int = 1, restore_pin: int = 0,
                 **store):
        super().__init__(geometry, sink, window, max_step, max_context, **store)
        self.restore_pin = restore_pin
        # Pinned positions (restore_pin P > 0): of the evicted positions, the P the proposer restores
        # worst (V error against the resident rows, measured as they leave the window) stay resident.
        self._pin_pos = torch.zeros(0, dtype=torch.long, device=self.pos.device)
        self._pin_err = torch.zeros(0, dtype=torch.float32, device=self.pos.device)
        self._v_energy = torch.zeros(geometry.num_layers, dtype=torch.float64)  # per layer: sum |v|^2, for the error scale
        self._v_rows = 0
        self.restore_from = restore_from
        self.restore_source = restore_source  # None: the backend resolves `restore_from` itself
        self.restore_refresh = restore_refresh
        self.evicted_total = 0
        self._tokens = torch.zeros(256, dtype=torch.int32, device=self.pos.device)
        # Refresh option (N > 1): restored K/V of [sink, _held_upto] kept for up to N steps; positions
        # evicted after the refresh stay resident until the next one. N = 1 never holds anything.
        self._held: HeldRestore | None = None
        self._held_upto = sink - 1
        self._held_uses = 0
        self._cover_upto = sink - 1  # this step: resident keys in [sink, _cover_upto] are served restored
        self._recording: HeldRestore | None = None
        if restore_pin:  # room for the pinned rows besides sink + window
            self.base_capacity += restore_pin
            self._resize_slots(self.base_capacity)

    @property
    def nbytes(self) -> int:
        """Resident K/V bytes plus restored K/V held for reuse (refresh option)."""
        return self.store.nbytes + (self._held.nbytes if self._held is not None else 0)

    @property
    def peak_nbytes(self) -> int:
        return max(self._peak_nbytes, self.nbytes)

    @property
    def held_nbytes(self) -> int:
        return self._held.nbytes if self._held is not None else 0

    def _allowed(self, qp, kp):
        restored = (kp >= self.sink) & (kp <= self._cover_upto)  # served from the restored set instead
        if self.restore_pin:
            restored = restored & ~torch.isin(kp, self._pin_pos)  # pinned: attended as resident rows
        return (kp >= 0) & (kp <= qp) & ~restored

    @property
    def pinned_positions(self) -> list[int]:
        return sorted(self._pin_pos.tolist())

    def _evict_pinning(self) -> int:
        """Evict the positions that left the window, except the restore_pin worst-restored ones."""
        upto = self.next_position - self.window
        cand = (self.pos >= self.sink) & (self.pos <= upto) & ~torch.isin(self.pos, self._pin_pos)
        if not bool(cand.any()):
            return 0
        slots = torch.nonzero(cand).flatten()
        order = torch.argsort(self.pos[slots])
        slots = slots[order]
        positions = self.pos[slots]
        err = self._restoration_error(positions, slots)
        all_pos, all_err = torch.cat([self._pin_pos, positions]), torch.cat([self._pin_err, err])
        keep = torch.topk(all_err, min(self.restore_pin, all_err.numel())).indices
        self._pin_pos, self._pin_err = all_pos[keep], all_err[keep]
        return self._evict_through(upto, keep=self._pin_pos)

    def _restoration_error(self, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Per position: sum over layers of |V_restored - V_resident|^2 / (the layer's mean |V|^2 per row).
        V crosses the restore seam exactly as the cache stores it (no norm or RoPE), so the store's
        rows are the reference; K would need the backend's RoPE."""
        if self.restore_source is None:
            raise ValueError("restore_pin needs the cache's restore_source (the learned proposer)")
        n = int(positions[-1]) + 1
        step = self.restore_source.open_step(self._tokens[:n].long(), positions)
        err = torch.zeros(positions.numel(), dtype=torch.float64)
        self._v_rows += positions.numel()
        try:
            for layer in range(self.geometry.num_layers):
                _, v_hat = step.kv_for_layer(layer)
                _, v = self.store.read(layer, slots)
                v = v.double()
                self._v_energy[layer] += float(v.pow(2).sum())
                scale = float(self._v_energy[layer]) / self._v_rows
                err += (v_hat.double().cpu() - v.cpu()).pow(2).sum((0, 2)) / max(scale, 1e-30)
        finally:
            step.close()
        return err.to(torch.float32).to(self.pos.device)

    def _refreshing(self) -> bool:
        return self.restore_refresh == 1 or self._held is None or self._held_uses >= self.restore_refresh

    def _evict_dead(self) -> int:
        if self.restore_pin:
            return self._evict_pinning()
        if self.restore_refresh == 1:
            return super()._evict_dead()
        # Only positions the held set covers may leave the resident store.
        return self._evict_through(min(self.next_position - self.window, self._held_upto))

    def _settle(self) -> None:
        # Positions kept for the refresh option can outnumber sink + window: keep room for them.
        target = max(self.base_capacity, self.resident_positions + min(self.max_step, self.STEP_ROOM))
        if self.capacity > target:
            self._resize_slots(target)

    @torch.inference_mode()
    def commit(self, n_keep: int | None = None) -> int:
        layout, rec = self._layout, self._recording
        self._recording = None
        if layout is not None and layout.restore is not None and self.restore_refresh > 1:
            full_step = n_keep is None or n_keep == layout.slots.numel()
            if rec is not None and rec.complete and full_step:
                # A rolled-back step may have shown the proposer tokens that are gone: not adopted.
                # The old set and the new recording were both alive during the step.
                self._peak_nbytes = max(self._peak_nbytes, self.nbytes + rec.nbytes)
                self._held, self._held_upto, self._held_uses = rec, self._cover_upto, 1
            elif layout.restore.held is not None:
                self._held_uses += 1
        return super().commit(n_keep)

    @torch.inference_mode()
    def abort(self) -> None:
        self._recording = None
        super().abort()

    def _sink_shift(self) -> SinkShift | None:
        return None

    def _dropped(self, evicted: int) -> int:
        self.evicted_total += evicted
        return 0

    def prepare(self, positions: torch.Tensor, ids: torch.Tensor | None = None) -> AttentionLayout:
        # Checked before any slot is taken, so a refused step leaves the cache untouched.
        if ids is None or ids.numel() != positions.numel():
            raise ValueError("a dlm_restore cache needs the step's token ids: call prepare(positions, ids)")
        if positions.numel() and int(positions[-1]) >= self.max_context:
            raise ValueError(
                f"position {int(positions[-1])} is past the model's context of {self.max_context}; dlm_restore attends "
                "to the whole history like `full`, so sessions stop at the trained context"
            )
        refresh = self._refreshing()
        # Positions out of the window for this step's first query: restored now (refresh), or the held set.
        self._cover_upto = self.next_position - self.window if refresh else self._held_upto
        return super().prepare(positions, ids)

    def _restore_plan(self, positions: torch.Tensor, ids: torch.Tensor | None) -> RestorePlan:
        end = int(positions[-1]) + 1
        if end > self._tokens.numel():
            grown = self._tokens.new_zeros(max(end, 2 * self._tokens.numel()))
            grown[: self._tokens.numel()] = self._tokens
            self._tokens = grown
        self._tokens[int(positions[0]) : end] = ids.to(self._tokens.dtype)
        evicted = torch.arange(self.sink, max(self.sink, self._cover_upto + 1), device=self.pos.device)
        if self.restore_pin and self._pin_pos.numel():
            evicted = evicted[~torch.isin(evicted, self._pin_pos)]
        qp, kp = positions[:, None], evicted[None, :]
        masks = {}
        for w in set(self.geometry.layer_windows):
            masks[w] = (kp <= qp) if w is None else (kp > qp - w)
        held = record = None
        if self.restore_refresh > 1 and evicted.numel():
            if self._refreshing():
                record = self._recording = HeldRestore(self.geometry.num_layers)
            else:
                held = self._held
        return RestorePlan(self._tokens[:end].long(), evicted, masks, held, record)


def make_cache(strategy: KVStrategy, geometry: CacheGeometry, *, max_step: int, max_context: int,
               restore_source=None) -> SlotKVCache:
    """The resident cache `strategy` names, storing rows as `strategy.compressor` says.

    restore_source: for dlm_restore, the RestoreSource to use; None lets the backend use
    `strategy.restore_from` ("verifier" = the model itself, f_θ = identity)."""
    store = dict(compressor=strategy.compressor, q_range=strategy.q_range)
    if strategy.name == "full":
        return FullKVCache(geometry, **store)
    if strategy.name == "dlm_restore":
        return DLMRestoreCache(geometry, strategy.sink, strategy.window, max_step, max_context,
                               restore_from=strategy.restore_from, restore_source=restore_source,
                               restore_refresh=strategy.restore_refresh, restore_pin=strategy.restore_pin, **store)
    return SinkWindowCache(geometry, strategy.sink, strategy.window, max_step, max_context, **store)
