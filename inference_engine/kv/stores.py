"""Slot storage behind a resident cache: where the K/V rows of resident positions live.

A cache decides which slot each position occupies and who attends to whom; a store only
holds rows per (layer, slot). Two stores speak the same small protocol:

  SlabStore        per-layer (Hkv, capacity, D) slabs in the model dtype; reads are views of
                   a slab prefix, so the uncompressed path copies nothing.
  CompressedStore  one KVCompressor per layer (compressors.py): rows are stored as packed
                   lattice codes and decompressed on every read.

Reads of a CompressedStore return what its compressor stores, so a token's K/V read back is
the same whether it was written alone or in a chunk (the codes are per vector).
"""
from __future__ import annotations

import torch

from inference_engine.kv.compressors import COMPRESSOR_NAMES, CompressorInputError, make_compressor


class SlabStore:
    """Uncompressed rows; `fetch` returns views of the first n slots of each slab."""

    compressor = "identity"

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype, device):
        self.capacity = capacity
        self.k = [torch.zeros(num_kv_heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(1, slots, k)
        self.v[layer].index_copy_(1, slots, v)

    def key_slots(self, pos: torch.Tensor) -> None:
        """Slots a step reads: None = the whole prefix `pos` covers, empty slots included (masked)."""
        return None

    def fetch(self, layer: int, n: int, slots: torch.Tensor | None):
        return self.k[layer][:, :n], self.v[layer][:, :n]

    def read(self, layer: int, slots: torch.Tensor):
        """(k, v) rows at `slots`, each (Hkv, len(slots), D)."""
        return self.k[layer][:, slots], self.v[layer][:, slots]

    def evict(self, slots: torch.Tensor) -> None:
        pass  # a freed slab row is simply overwritten later

    def grow(self, capacity: int) -> None:
        extra = capacity - self.capacity
        if extra <= 0:
            return
        self.k = [torch.cat([x, x.new_zeros(x.shape[0], extra, x.shape[2])], 1) for x in self.k]
        self.v = [torch.cat([x, x.new_zeros(x.shape[0], extra, x.shape[2])], 1) for x in self.v]
        self.capacity = capacity

    def compact(self, keep: torch.Tensor, capacity: int) -> None:
        """Move the rows of slots `keep` to slots 0..len(keep)-1 of `capacity`-slot slabs."""
        def moved(x):
            y = x.new_zeros(x.shape[0], capacity, x.shape[2])
            y[:, : keep.numel()] = x.index_select(1, keep)
            return y

        self.k = [moved(x) for x in self.k]
        self.v = [moved(x) for x in self.v]
        self.capacity = capacity

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


class CompressedStore:
    """Rows held by one KVCompressor per layer; reads decompress only the slots asked for."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype, device,
                 *, compressor: str, q_range: int):
        self.compressor = compressor
        self.q_range = q_range
        self.capacity = capacity
        self.dtype = dtype
        self.layers = [
            make_compressor(compressor, q_range=q_range, head_dim=head_dim, num_kv_heads=num_kv_heads,
                            capacity=capacity, device=device)
            for _ in range(num_layers)
        ]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # The cache owns slot bookkeeping: the unchecked paths skip per-layer host syncs.
        self.layers[layer].write_rows(k, v, slots)

    def key_slots(self, pos: torch.Tensor) -> torch.Tensor:
        # Only occupied slots are decoded: decoding is the per-step cost of compression.
        return torch.nonzero(pos >= 0).flatten()

    def fetch(self, layer: int, n: int, slots: torch.Tensor):
        return self.read(layer, slots)

    def read(self, layer: int, slots: torch.Tensor):
        k, v = self.layers[layer].read_rows(slots)  # float32 (Hkv, len(slots), D)
        if k.dtype != self.dtype:
            k, v = k.to(self.dtype), v.to(self.dtype)
        return k, v

    def evict(self, slots: torch.Tensor) -> None:
        if slots.numel():
            for c in self.layers:
                c.free_rows(slots)

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        for c in self.layers:
            c.ensure_capacity(capacity)
        self.capacity = capacity

    def compact(self, keep: torch.Tensor, capacity: int) -> None:
        for c in self.layers:
            c.compact(keep, capacity)  # moves packed bytes: codes are not re-encoded
        self.capacity = capacity

    @property
    def nbytes(self) -> int:
        return sum(c.memory_bytes() for c in self.layers)


def make_store(compressor: str, q_range: int, *, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
               dtype, device):
    if compressor == "identity":
        return SlabStore(num_layers, num_kv_heads, head_dim, capacity, dtype, device)
    if compressor not in COMPRESSOR_NAMES:
        raise CompressorInputError(f"unknown kv compressor {compressor!r}; choose one of {', '.join(COMPRESSOR_NAMES)}")
    return CompressedStore(num_layers, num_kv_heads, head_dim, capacity, dtype, device,
                           compressor=compressor, q_range=q_range)
