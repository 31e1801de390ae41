"""Slot storage behind a resident cache: the only owner of K/V bytes and of slot occupancy.

A store maps slots to positions (`pos`, host numpy, -1 = empty) and holds rows per
(layer, slot); the cache decides which slot each position takes and who attends to whom.

  SlabStore        per-layer (Hkv, capacity, D) slabs in the model dtype; reads are views of
                   a slab prefix, so the uncompressed path copies nothing.
  CompressedStore  per-layer payload slabs of a KVCodec (compressors.py): rows are stored
                   encoded (packed lattice codes) and decoded on every read.

`state()` returns the slot map and the stored bytes (codes, not decoded values, for a
compressed store), so `load_state` rebuilds a store that reads back bit for bit.
"""
from __future__ import annotations

import numpy as np
import torch

from inference_engine.kv.compressor_names import COMPRESSOR_NAMES
from inference_engine.kv.compressors import CompressorInputError, make_codec


class SlotStore:
    """Occupancy shared by every store: `pos[slot]` is the position a slot holds, or -1."""

    compressor = "identity"

    def __init__(self, capacity: int, device):
        self.capacity = capacity
        self.device = torch.device(device)
        self.pos = np.full(capacity, -1, dtype=np.int64)

    # -- occupancy (host only) ----------------------------------------------------------
    @property
    def resident(self) -> int:
        return int((self.pos >= 0).sum())

    def occupied(self) -> np.ndarray:
        return np.flatnonzero(self.pos >= 0)

    def free_slots(self, t: int) -> np.ndarray:
        return np.flatnonzero(self.pos < 0)[:t]

    def occupy(self, slots: np.ndarray, positions: np.ndarray) -> None:
        self.pos[slots] = positions

    def release(self, slots: np.ndarray) -> None:
        self.pos[slots] = -1

    def slots_tensor(self, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(slots)).to(self.device)

    def key_slots(self, n: int) -> np.ndarray | None:
        """Slots a step reads: None = the prefix 0..n-1, empty slots included (masked)."""
        return None

    def resize(self, capacity: int) -> None:
        """Grow to `capacity` slots, or shrink by moving the resident rows to the front (in slot order)."""
        if capacity > self.capacity:
            self._grow(capacity)
            self.pos = np.concatenate([self.pos, np.full(capacity - self.capacity, -1, dtype=np.int64)])
            self.capacity = capacity
        else:
            self.relocate(capacity, np.arange(self.resident))

    def relocate(self, capacity: int, dest: np.ndarray) -> None:
        """Rebuild with `capacity` slots, the resident rows (in slot order) moved to slots `dest`."""
        live = self.occupied()
        self._move(self.slots_tensor(live), self.slots_tensor(dest), capacity)
        pos = np.full(capacity, -1, dtype=np.int64)
        pos[dest] = self.pos[live]
        self.pos = pos
        self.capacity = capacity

    # -- persistence ----------------------------------------------------------------------
    def state(self) -> dict:
        """Tensors (CPU) that rebuild this store exactly: the slot map and the stored payload."""
        return {"pos": torch.from_numpy(self.pos.copy())} | {k: v.detach().to("cpu").clone() for k, v in self._payload().items()}

    def load_state(self, state: dict) -> None:
        self.pos = state["pos"].numpy().astype(np.int64).copy()
        self.capacity = int(self.pos.size)
        self._load_payload({k: v for k, v in state.items() if k != "pos"})

    # -- rows (subclasses) ----------------------------------------------------------------
    def _grow(self, capacity: int) -> None:
        raise NotImplementedError

    def _move(self, src: torch.Tensor, dst: torch.Tensor, capacity: int) -> None:
        """New slabs of `capacity` slots holding the rows of slots `src` at slots `dst`."""
        raise NotImplementedError

    def _payload(self) -> dict:
        raise NotImplementedError

    def _load_payload(self, payload: dict) -> None:
        raise NotImplementedError


class SlabStore(SlotStore):
    """Uncompressed rows; `fetch` returns views of the first n slots of each slab."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype, device):
        super().__init__(capacity, device)
        self.k = [torch.zeros(num_kv_heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(1, slots, k)
        self.v[layer].index_copy_(1, slots, v)

    def fetch(self, layer: int, n: int, slots: torch.Tensor | None):
        return self.k[layer][:, :n], self.v[layer][:, :n]

    def read(self, layer: int, slots: torch.Tensor):
        """(k, v) rows at `slots`, each (Hkv, len(slots), D)."""
        return self.k[layer][:, slots], self.v[layer][:, slots]

    def _grow(self, capacity: int) -> None:
        extra = capacity - self.capacity
        self.k = [torch.cat([x, x.new_zeros(x.shape[0], extra, x.shape[2])], 1) for x in self.k]
        self.v = [torch.cat([x, x.new_zeros(x.shape[0], extra, x.shape[2])], 1) for x in self.v]

    def _move(self, src: torch.Tensor, dst: torch.Tensor, capacity: int) -> None:
        def moved(x):
            y = x.new_zeros(x.shape[0], capacity, x.shape[2])
            y.index_copy_(1, dst, x.index_select(1, src))
            return y

        self.k = [moved(x) for x in self.k]
        self.v = [moved(x) for x in self.v]

    def _payload(self) -> dict:
        return {"k": torch.stack(self.k), "v": torch.stack(self.v)}  # (L, Hkv, capacity, D)

    def _load_payload(self, payload: dict) -> None:
        dev, dtype = self.k[0].device, self.k[0].dtype
        self.k = [t.to(dev, dtype).contiguous() for t in payload["k"].unbind(0)]
        self.v = [t.to(dev, dtype).contiguous() for t in payload["v"].unbind(0)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


class CompressedStore(SlotStore):
    """Rows as a codec's payload: per layer and payload name one slab (2, Hkv, capacity, *trailing),
    K and V stacked. Writes encode the step's rows at their slots; reads decode only the slots
    asked for; growing and compacting move payload bytes (never re-encode)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype, device,
                 *, compressor: str, q_range: int):
        super().__init__(capacity, device)
        self.compressor = compressor
        self.q_range = q_range
        self.dtype = dtype
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.codec = make_codec(compressor, q_range=q_range, head_dim=head_dim, device=device)
        self.layout = self.codec.payload_layout()  # name -> (trailing shape, dtype)
        self.slabs = [self._zeros(capacity) for _ in range(num_layers)]  # per layer: name -> slab

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode k, v (Hkv, T, D) into `slots` (T,) long. The cache owns slot choice, so slots are
        not checked (that would cost host syncs); a codec error leaves every slab untouched."""
        want = (self.num_kv_heads, slots.numel(), self.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise CompressorInputError(
                f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be (num_kv_heads, len(slots), head_dim) = {want}")
        payload = self.codec.encode(torch.stack([k, v]).reshape(-1, self.head_dim))  # rows (2*Hkv*T, D)
        for name, slab in self.slabs[layer].items():
            slab.index_copy_(2, slots, payload[name].reshape(2, *want[:2], *slab.shape[3:]))

    def key_slots(self, n: int) -> np.ndarray:
        # Only occupied slots are decoded: decoding is the per-step cost of compression.
        return self.occupied()

    def fetch(self, layer: int, n: int, slots: torch.Tensor):
        return self.read(layer, slots)

    def read(self, layer: int, slots: torch.Tensor):
        """(k, v) rows at occupied `slots` (any order, repeats allowed), each (Hkv, len(slots), D) in
        the store dtype."""
        n = slots.numel()
        if n == 0:
            empty = torch.zeros(self.num_kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
            return empty, empty.clone()
        payload = {name: slab.index_select(2, slots).reshape(-1, *slab.shape[3:])
                   for name, slab in self.slabs[layer].items()}
        kv = self.codec.decode(payload).reshape(2, self.num_kv_heads, n, self.head_dim)  # float32
        if kv.dtype != self.dtype:
            kv = kv.to(self.dtype)
        return kv[0], kv[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for slabs in self.slabs for t in slabs.values())

    def _zeros(self, capacity: int) -> dict:
        return {name: torch.zeros(2, self.num_kv_heads, capacity, *shape, dtype=dtype, device=self.device)
                for name, (shape, dtype) in self.layout.items()}

    def _grow(self, capacity: int) -> None:
        def grown(x):
            return torch.cat([x, x.new_zeros(*x.shape[:2], capacity - x.shape[2], *x.shape[3:])], 2)

        self.slabs = [{name: grown(x) for name, x in slabs.items()} for slabs in self.slabs]

    def _move(self, src: torch.Tensor, dst: torch.Tensor, capacity: int) -> None:
        def moved(x):
            y = x.new_zeros(*x.shape[:2], capacity, *x.shape[3:])
            y.index_copy_(2, dst, x.index_select(2, src))
            return y

        self.slabs = [{name: moved(x) for name, x in slabs.items()} for slabs in self.slabs]

    def _payload(self) -> dict:
        return {name: torch.stack([slabs[name] for slabs in self.slabs]) for name in self.layout}  # (L, 2, Hkv, capacity, ...)

    def _load_payload(self, payload: dict) -> None:
        want = {name: ((len(self.slabs), 2, self.num_kv_heads, self.capacity, *shape), dtype)
                for name, (shape, dtype) in self.layout.items()}
        got = {name: (tuple(t.shape), t.dtype) for name, t in payload.items()}
        if got != want:
            raise ValueError(f"stored payload {got} does not fit this {self.compressor} store, which holds {want}")
        self.slabs = [{name: payload[name][i].to(self.device).contiguous() for name in self.layout}
                      for i in range(len(self.slabs))]


def make_store(compressor: str, q_range: int, *, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
               dtype, device) -> SlotStore:
    if compressor == "identity":
        return SlabStore(num_layers, num_kv_heads, head_dim, capacity, dtype, device)
    if compressor not in COMPRESSOR_NAMES:
        raise CompressorInputError(f"unknown kv compressor {compressor!r}; choose one of {', '.join(COMPRESSOR_NAMES)}")
    return CompressedStore(num_layers, num_kv_heads, head_dim, capacity, dtype, device,
                           compressor=compressor, q_range=q_range)
