"""SlotKVCache: the protocol every resident cache speaks, and the slot machinery they share.

A forward step over T new tokens is three calls:

    layout = cache.prepare(positions, ids)               # pick slots, build attention masks
    k_all, v_all = cache.update_and_fetch(layer, k, v)   # once per layer
    cache.commit(n_keep)                                 # keep the first n_keep, roll back the rest

(`abort()` drops a step whose forward failed.) Tokens written during a step are provisional
until `commit`, which makes speculative rollback exact: slots of positions that left the
window are only reused after a commit, so a rejected verify step leaves the state intact.

Bookkeeping (positions, slots, row counts) is host-side: numpy arrays and Python ints owned
by the store; the device sees the step's slot index, key positions and masks.

`state()` -> CacheState and `factory.cache_from_state(state, ...)` round-trip a cache exactly:
the store's bytes (codes for a compressed store), the slot map, counters and the strategy's
own state, so a continued session is token-identical to one that never left memory.
`delta_state(since)` is the same state as a saver that already holds part of it needs it
(CacheDelta): the rows committed since, read per slot, and the new rows of tables that only grow.

Invariants (ADR 0008 §2.8) are checked at every mutation and raise `CacheInvariantError`:
INV-1 every layer holds exactly as many K/V rows as there are resident positions;
INV-2 positions are appended contiguously and never go backwards.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, cast

import numpy as np
import torch

from inference_engine.errors import CacheInvariantError
from inference_engine.kv.layout import AttentionLayout, CacheGeometry, ExtraKeySource, SinkShift
from inference_engine.kv.stores import FP16_RESIDENT, INT8_RESIDENT, make_store
from inference_engine.kv.strategy import KVStrategy

STATE_FORMAT = 1


@dataclass
class CacheState:
    """A cache's persistent form: CPU tensors (safetensors-ready) and JSON-able metadata."""

    tensors: dict
    meta: dict


@dataclass(frozen=True)
class SaveMark:
    """How much of a cache a saver already holds: the rows of every position below `rows_through`
    (those still resident never change), and the first `appended_rows` rows of its append-only tables."""

    rows_through: int = 0
    appended_rows: int = 0


@dataclass(frozen=True)
class AppendOnly:
    """A cache's state tensors that only ever grow along one axis (a strategy's archive): a saver
    writes the rows added since its last save. `rows_key`: the meta key holding their row count;
    `axes`: tensor name prefix -> row axis."""

    rows_key: str
    axes: dict[str, int]


@dataclass(frozen=True)
class AppendedRows:
    """The append-only tensors in a CacheDelta's state: rows `start` .. `end` - 1 of each (the
    rows after SaveMark.appended_rows, or all of them when the tables hold fewer than that);
    `axes`: tensor name -> row axis; `rows_key`: the meta key that holds `end`."""

    axes: dict[str, int]
    start: int
    end: int
    rows_key: str


class Pieces(list):
    """An append-only state tensor given as its pieces along `axis`, in order (a state loaded from several append
    segments): the table that loads it copies them in one after another, not one concatenated copy of the whole
    archive first (a 32k-token paged session's fp32 pages: 1.5 GB). `shape` and `dtype` are the whole tensor's."""

    def __init__(self, parts: list, axis: int):
        super().__init__(parts)
        self.axis = axis

    @property
    def shape(self) -> tuple:
        s = list(self[0].shape)
        s[self.axis] = sum(p.shape[self.axis] for p in self)
        return tuple(s)

    @property
    def dtype(self) -> torch.dtype:
        return self[0].dtype

    def tensor(self) -> torch.Tensor:
        """The whole tensor (a copy)."""
        return torch.cat(list(self), self.axis)


@dataclass
class CacheDelta:
    """What a saver holding `since` (a SaveMark) writes of a cache now (`SlotKVCache.delta_state`).

    pos        the slot map: position per slot, -1 empty (a copy; small)
    row_axes   payload name -> slot axis of `read_rows`' tensors; None: the store's rows are not
               read per slot, and `state` carries the whole store instead
    new_slots  resident slots holding positions at or past since.rows_through: the rows not saved
    read_rows  slots -> their stored rows (codes for a compressed store), stacked over layers (CPU)
    state      everything else (counters, strategy tensors), as `state()` has it; its append-only
               tensors hold the rows `appended` says only, and may be RowSpans (`paged_store`: read a
               layer at a time as they are written, so a save does not copy a turn's archive whole)
    appended   the append-only tensors' rows in `state`; None: the cache has none
    """

    pos: np.ndarray
    row_axes: dict[str, int] | None
    new_slots: np.ndarray
    read_rows: Callable[[np.ndarray], dict]
    state: CacheState
    appended: AppendedRows | None

    def mark(self, next_position: int) -> SaveMark:
        """The SaveMark of a saver that wrote this delta whole."""
        return SaveMark(next_position, self.appended.end if self.appended else 0)


def geometry_meta(g: CacheGeometry) -> dict:
    """What a saved state records of the model's cache shape (checked when it is loaded)."""
    return {"num_layers": g.num_layers, "num_kv_heads": g.num_kv_heads, "head_dim": g.head_dim,
            "dtype": str(g.dtype).removeprefix("torch.")}


class SlotKVCache:
    """Per-layer K/V rows in a store, addressed by slot; subclasses choose slots and masks.

    Mutations run under inference mode: the model writes the cache inside its inference-mode
    forward, and the engine commits outside it."""

    def __init__(self, strategy: KVStrategy, geometry: CacheGeometry, capacity: int):
        self.strategy = strategy
        self.geometry = geometry
        g = geometry
        # The backend's own store, if it brings one (CacheGeometry): torch's stores (stores.py) and MLX's share
        # write / fetch / read / nbytes by duck typing, hence Any.
        store = cast(Callable[..., Any], g.make_store or make_store)
        name = {"int8": INT8_RESIDENT, "fp16": FP16_RESIDENT}.get(strategy.kv_dtype, strategy.compressor)
        self.store = store(name, strategy.q_range, num_layers=g.num_layers, num_kv_heads=g.num_kv_heads,
                           head_dim=g.head_dim, capacity=capacity, dtype=g.dtype, device=g.device)
        self.next_position = 0  # committed tokens == next position to write
        self.dropped_total = 0  # positions that left attention for good
        self._layer_rows = [0] * g.num_layers  # K/V rows written per layer (INV-1)
        self._rows_before: list = []
        self._layout: AttentionLayout | None = None
        self._step_slots: np.ndarray | None = None
        self._peak_nbytes = self.store.nbytes

    @property
    def compressor(self) -> str:
        return self.store.compressor

    @property
    def capacity(self) -> int:
        return self.store.capacity

    @property
    def pos(self) -> np.ndarray:
        """Position held by each slot (-1 = empty); host memory, owned by the store."""
        return self.store.pos

    # -- protocol ------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, positions: range | torch.Tensor, ids: torch.Tensor | None = None) -> AttentionLayout:
        """Reserve slots for new tokens at `positions` (a range, or a 1-D tensor); `ids` (their
        token ids) is only needed by caches that keep the token history (for their extra keys)."""
        first, t = self._check_positions(positions)
        if self._layout is not None:
            raise CacheInvariantError("inv1", "prepare() called while a previous step is uncommitted")
        slots = self._allocate(t)
        self._rows_before = list(self._layer_rows)
        qpos = np.arange(first, first + t, dtype=np.int64)
        self.store.occupy(slots, qpos)
        n = self.store.read_width(self._key_count(t))
        key_slots = self.store.key_slots(n)
        key_pos = self.store.pos[:n] if key_slots is None else self.store.pos[key_slots]
        dev = self.store.device
        host_masks = {w: self._mask(qpos, key_pos, w) for w in set(self.geometry.layer_windows)}
        masks = {w: torch.from_numpy(m).to(dev) for w, m in host_masks.items()}
        self._step_slots = slots
        self._layout = AttentionLayout(
            positions=torch.arange(first, first + t, device=dev), first_position=first,
            slots=self.store.slots_tensor(slots), key_positions=torch.from_numpy(key_pos.copy()).to(dev), masks=masks,
            sink_shift=self._sink_shift(), key_slots=None if key_slots is None else self.store.slots_tensor(key_slots),
            extra_keys=self._extra_keys(first, t, ids), host_masks=host_masks, whole_rows=self.store.whole_slab_reads,
            host_slots=slots)
        return self._layout

    @torch.inference_mode()
    def update_and_fetch(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[Any, Any]:
        """Store the step's k, v (Hkv, T, D); return every key/value its queries may read,
        (Hkv, N, D) in layout.key_positions order, the step's own rows as stored (the store's: torch
        tensors, stores.Int8Rows, or another backend's arrays)."""
        layout = self._layout
        if layout is None or k.shape[1] != layout.slots.numel():
            raise CacheInvariantError("inv1", f"layer {layer} update does not match the prepared step")
        self.store.write(layer, layout.slots, k, v)
        self._layer_rows[layer] += k.shape[1]
        return self.store.fetch(layer, layout.key_positions.numel(), layout.key_slots)

    def rows_written(self) -> None:
        """The step's k, v were written into the store's rows at layout.slots, every layer, by the backend's
        fused step (backends/torch/row_graphs.py) instead of update_and_fetch: count them (INV-1)."""
        if self._layout is None:
            raise CacheInvariantError("inv1", "rows_written() without a prepared step")
        t = self._layout.slots.numel()
        self._layer_rows = [r + t for r in self._layer_rows]

    @torch.inference_mode()
    def commit(self, n_keep: int | None = None) -> int:
        """Keep the first n_keep new tokens (all if None); returns positions dropped from attention."""
        layout, slots = self._layout, self._step_slots
        if layout is None or slots is None:
            raise CacheInvariantError("inv1", "commit() without a prepared step")
        t = slots.size
        n_keep = t if n_keep is None else n_keep
        if not 0 <= n_keep <= t:
            raise ValueError(f"n_keep must be in [0, {t}], got {n_keep}")
        self._on_commit(layout, n_keep)
        self._layout = self._step_slots = None
        if n_keep < t:
            self._release(slots[n_keep:])
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
        slots = self._step_slots
        if self._layout is None or slots is None:
            return
        self._layout = self._step_slots = None
        self._on_abort()
        self._release(slots)
        self._layer_rows = list(self._rows_before)
        self._settle()

    def exact_step_room(self) -> int:
        """Most tokens a row-exact step (decode, speculative verify) may take from here and still
        read every row's keys exactly as one-token steps would (the engine trims drafts to it)."""
        return 1 << 30

    def check_inv1(self) -> None:
        resident = self.resident_positions
        bad = [i for i, r in enumerate(self._layer_rows) if r != resident]
        if bad:
            rows = [self._layer_rows[i] for i in bad]
            raise CacheInvariantError("inv1", f"layers {bad} hold {rows} rows for {resident} resident positions")

    @property
    def resident_positions(self) -> int:
        return self.store.resident

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage the cache holds (packed bytes for a compressed store)."""
        return self.store.nbytes

    @property
    def peak_nbytes(self) -> int:
        """Most bytes of K/V storage ever held at once, transient step growth included."""
        return max(self._peak_nbytes, self.nbytes)

    # -- persistence ------------------------------------------------------------------------
    # State tensors that only grow (None: none); a strategy with an archive declares them.
    APPEND_ONLY: ClassVar[AppendOnly | None] = None

    def state(self, *, with_store: bool = True) -> CacheState:
        """with_store=False leaves out the store's tensors (slot map and rows): what `delta_state` does
        for a store whose rows a saver reads per slot."""
        return self._state(with_store, appended_from=0)

    def delta_state(self, since: SaveMark | None = None) -> CacheDelta:
        """What a saver that holds `since` (None: nothing) writes now: the state without the rows
        it holds (CacheDelta). The cache keeps no record of saves: the saver keeps its SaveMark."""
        since = since or SaveMark()
        axes = self.store.row_axes
        axes = dict(axes) if axes is not None else None
        pos = self.store.pos.copy()
        new = np.flatnonzero((pos >= 0) & (pos >= since.rows_through)) if axes is not None else np.zeros(0, np.int64)
        st = self._state(axes is None, appended_from=since.appended_rows, lazy=True)
        appended = None
        if self.APPEND_ONLY is not None:
            rows_key, prefixes = self.APPEND_ONLY.rows_key, self.APPEND_ONLY.axes
            start, end = since.appended_rows, int(st.meta[rows_key])
            if start > end:  # fewer rows than saved (the tables only grow, so not expected): all of them
                st, start = self._state(axes is None, appended_from=0, lazy=True), 0
            names = {k: axis for k in st.tensors for prefix, axis in prefixes.items() if k.startswith(prefix)}
            appended = AppendedRows(names, start, end, rows_key)
        return CacheDelta(pos, axes, new, self.store.read_rows, st, appended)

    def _state(self, with_store: bool, appended_from: int, lazy: bool = False) -> CacheState:
        if self._layout is not None:
            raise CacheInvariantError("inv1", "state() of a cache with an uncommitted step; commit or abort first")
        meta = {
            "format": STATE_FORMAT, "cache": type(self).__name__, "strategy": asdict(self.strategy),
            "geometry": geometry_meta(self.geometry),
            "next_position": self.next_position, "dropped_total": self.dropped_total, "peak_nbytes": self.peak_nbytes,
        }
        tensors = {f"store.{k}": v for k, v in self.store.state().items()} if with_store else {}
        extra_t, extra_m = self._extra_state(appended_from, lazy)
        return CacheState(tensors | extra_t, meta | extra_m)

    def load_state(self, state: CacheState) -> None:
        """Adopt `state` (from `state()` of a cache built from the same strategy and geometry):
        factory.cache_from_state checks those and calls this on a fresh cache."""
        meta = state.meta
        if type(self).__name__ != meta["cache"]:
            raise ValueError(f"cache state holds a {meta['cache']}, the strategy builds a {type(self).__name__}")
        self.store.load_state({k.removeprefix("store."): v for k, v in state.tensors.items() if k.startswith("store.")})
        self.next_position, self.dropped_total = int(meta["next_position"]), int(meta["dropped_total"])
        self._peak_nbytes = int(meta["peak_nbytes"])
        self._layer_rows = [self.store.resident] * self.geometry.num_layers
        self._load_extra_state(state.tensors, meta)
        self.check_inv1()

    # -- strategy hooks ----------------------------------------------------------------
    def _allocate(self, t: int) -> np.ndarray:
        raise NotImplementedError

    def _key_count(self, t: int) -> int:
        raise NotImplementedError

    def _release(self, slots: np.ndarray) -> None:
        self.store.release(slots)

    def _resize(self, capacity: int) -> None:
        self.store.resize(capacity)
        self._peak_nbytes = max(self._peak_nbytes, self.nbytes)

    def _settle(self) -> None:
        """After a step is committed or aborted: give back transient room (bounded caches)."""

    def _evict_dead(self) -> int:
        return 0

    def _dropped(self, evicted: int) -> int:
        return evicted

    def _on_commit(self, layout: AttentionLayout, n_keep: int) -> None:
        pass

    def _on_abort(self) -> None:
        pass

    def _sink_shift(self) -> SinkShift | None:
        return None

    def _extra_keys(self, first: int, t: int, ids: torch.Tensor | None) -> ExtraKeySource | None:
        """Keys the step at first .. first + t - 1 attends to besides the store's (AttentionLayout.extra_keys)."""
        return None

    def _extra_state(self, appended_from: int, lazy: bool = False) -> tuple[dict, dict]:
        """The strategy's own (tensors, meta); APPEND_ONLY tensors from row `appended_from` on (with `lazy`, as
        objects a saver reads a piece at a time where the strategy has them: `paged_store.RowSpan`)."""
        return {}, {}

    def _load_extra_state(self, tensors: dict, meta: dict) -> None:
        pass

    def _allowed(self, qp: np.ndarray, kp: np.ndarray) -> np.ndarray:
        return (kp >= 0) & (kp <= qp)

    def _mask(self, qpos: np.ndarray, key_pos: np.ndarray, layer_window: int | None) -> np.ndarray:
        qp, kp = qpos[:, None], key_pos[None, :]
        m = self._allowed(qp, kp)
        if layer_window is not None:
            m = m & (kp > qp - layer_window)
        return m

    def _check_positions(self, positions: range | torch.Tensor) -> tuple[int, int]:
        expected = self.next_position
        if isinstance(positions, range):
            first, t, ok = positions.start, len(positions), positions.step == 1
        else:
            vals = positions.tolist()
            t = len(vals)
            first = vals[0] if t else expected
            ok = vals == list(range(first, first + t))
        if t == 0 or not ok or first != expected:
            raise CacheInvariantError("inv2", f"new positions must continue at {expected} contiguously, got {first}..{first + t - 1}")
        return first, t
