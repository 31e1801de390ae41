"""MlxSlabStore: the slot store of the MLX backend, so every cache strategy runs over MLX arrays.

The caches (kv/full.py, kv/sink_window.py, ...) keep all bookkeeping on the host (slot map,
positions, masks); the store is the only owner of K/V bytes. This one holds per-layer
(Hkv, capacity, D) `mx.array` slabs, takes the step's slots as a host/torch index and returns
slab prefixes, exactly as kv/stores.py's SlabStore does with torch tensors. Saved state is the
same CPU torch tensors SlabStore saves, so a session saved by one backend loads into the other.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import torch

from inference_engine.kv.stores import SlotStore

_MX_DTYPES = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}


def mx_dtype(dtype: torch.dtype):
    if dtype not in _MX_DTYPES:
        raise ValueError(f"the MLX backend stores K/V as float32, float16 or bfloat16, not {dtype}")
    return _MX_DTYPES[dtype]


def as_index(slots) -> mx.array:
    """A slot index (numpy, torch CPU tensor or mx.array) as an mx int32 array."""
    if isinstance(slots, mx.array):
        return slots
    if isinstance(slots, torch.Tensor):
        slots = slots.numpy()
    return mx.array(np.ascontiguousarray(slots, dtype=np.int32))


class MlxSlabStore(SlotStore):
    """Uncompressed rows in MLX slabs; `fetch` returns the first n slots of each slab."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device):
        super().__init__(capacity, "cpu")  # `device` of a SlotStore is where the layout's torch tensors live
        self.dtype = dtype
        self._mx_dtype = mx_dtype(dtype)
        self.k = [mx.zeros((num_kv_heads, capacity, head_dim), dtype=self._mx_dtype) for _ in range(num_layers)]
        self.v = [mx.zeros_like(t) for t in self.k]
        mx.eval(self.k, self.v)  # nothing lazy may outlive the call: the next step can run on another thread

    def write(self, layer: int, slots, k: mx.array, v: mx.array) -> None:
        # Lazy: evaluated with the step's logits (every layer's rows feed them), in the step's thread.
        idx = as_index(slots)
        self.k[layer][:, idx] = k.astype(self._mx_dtype)
        self.v[layer][:, idx] = v.astype(self._mx_dtype)

    def release(self, slots) -> None:
        # An aborted step's writes may still be lazy: evaluate them on the thread that built them (MLX
        # cannot evaluate another thread's graph; the next step may run elsewhere). No-op otherwise.
        super().release(slots)
        mx.eval(self.k, self.v)

    def fetch(self, layer: int, n: int, slots):
        return self.k[layer][:, :n], self.v[layer][:, :n]

    def read(self, layer: int, slots):
        """The rows at `slots` as CPU torch tensors (Hkv, n, D): what the paged strategy archives into its
        torch page store (kv/paged.py)."""
        idx = as_index(slots)
        return _to_torch(self.k[layer][:, idx], self.dtype), _to_torch(self.v[layer][:, idx], self.dtype)

    row_axes = {"k": 2, "v": 2}

    def read_rows(self, slots) -> dict:
        """The rows at `slots` stacked over layers like `state()`'s payload: CPU torch (L, Hkv, n, D)
        (what persistence writes per turn: SlotKVCache.delta_state)."""
        idx = as_index(slots)
        return {"k": _to_torch(mx.stack([x[:, idx] for x in self.k]), self.dtype),
                "v": _to_torch(mx.stack([x[:, idx] for x in self.v]), self.dtype)}

    def _grow(self, capacity: int) -> None:
        def grown(x):
            return mx.concatenate([x, mx.zeros((x.shape[0], capacity - self.capacity, x.shape[2]), dtype=x.dtype)], 1)

        self.k = [grown(x) for x in self.k]
        self.v = [grown(x) for x in self.v]
        mx.eval(self.k, self.v)

    def _move(self, src, dst, capacity: int) -> None:
        src, dst = as_index(src), as_index(dst)

        def moved(x):
            y = mx.zeros((x.shape[0], capacity, x.shape[2]), dtype=x.dtype)
            if src.size:
                y[:, dst] = x[:, src]
            return y

        self.k = [moved(x) for x in self.k]
        self.v = [moved(x) for x in self.v]
        mx.eval(self.k, self.v)

    def _payload(self) -> dict:
        return {"k": _to_torch(mx.stack(self.k), self.dtype), "v": _to_torch(mx.stack(self.v), self.dtype)}

    def _load_payload(self, payload: dict) -> None:
        self.k = [_from_torch(t, self._mx_dtype) for t in payload["k"].unbind(0)]
        self.v = [_from_torch(t, self._mx_dtype) for t in payload["v"].unbind(0)]
        mx.eval(self.k, self.v)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v))


def _to_torch(x: mx.array, dtype: torch.dtype) -> torch.Tensor:
    # numpy has no bfloat16: go through float32 (exact) and cast back
    return torch.from_numpy(np.array(x.astype(mx.float32))).to(dtype)


def _from_torch(t: torch.Tensor, dtype) -> mx.array:
    return mx.array(t.float().numpy()).astype(dtype)


def make_mlx_store(compressor: str, q_range: int, *, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                   dtype, device) -> MlxSlabStore:
    """kv.stores.make_store's signature (CacheGeometry.make_store) for the MLX backend."""
    if compressor != "identity":
        raise ValueError(f"kv compressor {compressor!r} runs on the torch backend only; with --backend mlx use "
                         "--kv-compressor identity")
    return MlxSlabStore(num_layers, num_kv_heads, head_dim, capacity, dtype, device)
