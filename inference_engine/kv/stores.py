"""Slot storage behind a resident cache: the only owner of K/V bytes and of slot occupancy.

A store maps slots to positions (`pos`, host numpy, -1 = empty) and holds rows per
(layer, slot); the cache decides which slot each position takes and who attends to whom.

  SlabStore        per-layer (Hkv, capacity, D) slabs in the model dtype; reads are views of
                   a slab prefix, so the uncompressed path copies nothing.
  CompressedStore  per-layer payload slabs of a KVCodec (compressors.py): rows are stored
                   encoded (packed lattice codes) and decoded on every read.
  Int8SlabStore    int8 rows + a scale per position (--kv-dtype int8), read without decoding:
                   attention runs on the codes through torch's int8 kernel.

`state()` returns the slot map and the stored bytes (codes, not decoded values, for a
compressed store), so `load_state` rebuilds a store that reads back bit for bit. A store made
inside `rows_deferred()` allocates no rows until `load_state` hands it its payload (what
`factory.cache_from_state` does: a load does not allocate and zero slabs it then drops).
"""
from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from inference_engine.kv.compressor_names import COMPRESSOR_NAMES
from inference_engine.kv.compressors import CompressorInputError, make_codec

INT8_RESIDENT = "int8_resident"  # the store name make_store takes for KVStrategy(kv_dtype="int8")
FP16_RESIDENT = "fp16_resident"  # ... and for KVStrategy(kv_dtype="fp16")

_deferred = threading.local()


@contextlib.contextmanager
def rows_deferred() -> Iterator[None]:
    """Stores that `make_store` makes inside (on this thread) hold no rows until their `load_state`:
    for a cache whose state is loaded at once, so its slabs are not allocated and zeroed twice.
    Until then the store's slabs have 0 slots (its `capacity` is already the one asked for)."""
    before = getattr(_deferred, "on", False)
    _deferred.on = True
    try:
        yield
    finally:
        _deferred.on = before


def _allocating() -> bool:
    return not getattr(_deferred, "on", False)


class SlotStore:
    """Occupancy shared by every store: `pos[slot]` is the position a slot holds, or -1."""

    compressor = "identity"

    def __init__(self, capacity: int, device: str | torch.device):
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

    whole_slab_reads = False  # reads return every slot (Int8SlabStore), so a step reads read_width(n) keys

    def key_slots(self, n: int) -> np.ndarray | None:
        """Slots a step reads: None = the prefix 0..n-1, empty slots included (masked)."""
        return None

    def read_width(self, n: int) -> int:
        """Keys a step that needs the first n slots reads."""
        return n

    def fit(self, capacity: int) -> int:
        """The capacity this store allocates for a request of `capacity` slots."""
        return capacity

    def resize(self, capacity: int) -> None:
        """Grow to `capacity` slots, or shrink by moving the resident rows to the front (in slot order)."""
        capacity = self.fit(capacity)
        if capacity > self.capacity:
            self._grow(capacity)
            self.pos = np.concatenate([self.pos, np.full(capacity - self.capacity, -1, dtype=np.int64)])
            self.capacity = capacity
        else:
            self.relocate(capacity, np.arange(self.resident))

    def relocate(self, capacity: int, dest: np.ndarray) -> None:
        """Rebuild with `capacity` slots, the resident rows (in slot order) moved to slots `dest`."""
        capacity = self.fit(capacity)
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

    # Payload name -> slot axis of `state()`'s payload, for a store that reads some slots' rows
    # (`read_rows`): a saver then writes the rows a session added, not every slot each time. None:
    # rows are not read per slot (the store is saved whole).
    row_axes: dict[str, int] | None = None

    def read_rows(self, slots: np.ndarray) -> dict:
        """The stored rows (codes, for a compressed store) at `slots`, stacked over layers like
        `state()`'s payload, on the CPU."""
        raise NotImplementedError(f"{type(self).__name__} reads no rows per slot (row_axes is None)")

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
    """Uncompressed rows; `fetch` returns views of the first n slots of each slab. Every layer's K and V slab
    (Hkv, capacity, D) is a view of one (L, 2, Hkv, capacity, D) tensor, so a run of slots is read for every layer
    in one copy (`read_run`: paged archives a decode step's evicted row so)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: str | torch.device, *, allocate: bool = True):
        super().__init__(capacity, device)
        n = capacity if allocate else 0  # rows_deferred: load_state brings the slabs
        self._set(torch.zeros(num_layers, 2, num_kv_heads, n, head_dim, dtype=dtype, device=device))

    def _set(self, kv: torch.Tensor) -> None:
        self.kv: torch.Tensor | None = kv  # (L, 2, Hkv, capacity, D)
        self.k = [x[0] for x in kv]
        self.v = [x[1] for x in kv]

    def _own(self) -> torch.Tensor | None:
        """The (L, 2, Hkv, capacity, D) tensor the slabs are views of; None where a subclass set slabs of its own."""
        kv = getattr(self, "kv", None)
        return kv if kv is not None and self.k and self.k[0].data_ptr() == kv[0, 0].data_ptr() else None

    def _whole(self) -> torch.Tensor:
        kv = self._own()
        return kv if kv is not None else torch.stack([torch.stack([k, v]) for k, v in zip(self.k, self.v)])

    def read_run(self, a: int, b: int) -> torch.Tensor:
        """(L, 2, Hkv, b - a, D): every layer's K and V at slots a .. b - 1, a copy. Slabs loaded from a state (its
        tensors adopted as they are, per layer) are brought into one tensor here first, once."""
        kv = self._own()
        if kv is None and type(self) is SlabStore:  # joined once (a subclass's slabs are its own: read per layer)
            self._set(kv := self._whole())
        if kv is None:
            return torch.stack([torch.stack([k[:, a:b], v[:, a:b]]) for k, v in zip(self.k, self.v)])
        return kv[:, :, :, a:b].clone()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(1, slots, k)
        self.v[layer].index_copy_(1, slots, v)

    def fetch(self, layer: int, n: int, slots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][:, :n], self.v[layer][:, :n]

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) rows at `slots`, each (Hkv, len(slots), D)."""
        return self.k[layer][:, slots], self.v[layer][:, slots]

    def _grow(self, capacity: int) -> None:
        kv = self._whole()
        grown = kv.new_zeros(*kv.shape[:3], capacity, kv.shape[4])
        grown[:, :, :, :kv.shape[3]] = kv
        self._set(grown)

    def _move(self, src: torch.Tensor, dst: torch.Tensor, capacity: int) -> None:
        kv = self._whole()
        moved = kv.new_zeros(*kv.shape[:3], capacity, kv.shape[4])
        for layer in range(kv.shape[0]):  # a layer at a time: the rows in flight are a layer's, not the slab's
            moved[layer].index_copy_(2, dst, kv[layer].index_select(2, src))
        self._set(moved)

    row_axes = {"k": 2, "v": 2}

    def read_rows(self, slots: np.ndarray) -> dict:
        idx = self.slots_tensor(np.asarray(slots, dtype=np.int64))
        return {"k": _stacked_rows(self.k, 1, idx), "v": _stacked_rows(self.v, 1, idx)}

    def _payload(self) -> dict:
        return {"k": torch.stack(self.k), "v": torch.stack(self.v)}  # (L, Hkv, capacity, D)

    def _load_payload(self, payload: dict) -> None:
        dev, dtype = self.k[0].device, self.k[0].dtype  # the state's tensors adopted as they are (no second copy)
        self.kv = None
        self.k = [t.to(dev, dtype).contiguous() for t in payload["k"].unbind(0)]
        self.v = [t.to(dev, dtype).contiguous() for t in payload["v"].unbind(0)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


class HalfSlabStore(SlabStore):
    """SlabStore's slabs in fp16 (half the bytes a step's attention reads, as llama.cpp's default f16 K/V cache): rows
    are rounded to fp16 when written (round to nearest even) and attention computes in the model's dtype on the stored
    values (every fp16 value is exactly a float). The native CPU step reads the fp16 slabs itself
    (`backends/torch/native.plain_slab`); `fetch` / `read` give the other paths the rows in the model's dtype (a
    copy). CPU only (the CUDA paths take the model's dtype)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: str | torch.device, *, allocate: bool = True):
        if torch.device(device).type != "cpu":
            raise ValueError(f"an fp16 K/V store is for the CPU; on {device} use kv dtype fp32 (the model's dtype)")
        super().__init__(num_layers, num_kv_heads, head_dim, capacity, torch.float16, device, allocate=allocate)
        self.dtype = dtype  # what attention computes in

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(1, slots, k.to(torch.float16))
        self.v[layer].index_copy_(1, slots, v.to(torch.float16))

    def fetch(self, layer: int, n: int, slots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][:, :n].to(self.dtype), self.v[layer][:, :n].to(self.dtype)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][:, slots].to(self.dtype), self.v[layer][:, slots].to(self.dtype)


class CompressedStore(SlotStore):
    """Rows as a codec's payload: per layer and payload name one slab (2, Hkv, capacity, *trailing),
    K and V stacked. Writes encode the step's rows at their slots; reads decode only the slots
    asked for; growing and compacting move payload bytes (never re-encode)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: str | torch.device, *, compressor: str, q_range: int, allocate: bool = True):
        super().__init__(capacity, device)
        self.compressor = compressor
        self.q_range = q_range
        self.dtype = dtype
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.codec = make_codec(compressor, q_range=q_range, head_dim=head_dim, device=device)
        self.layout = self.codec.payload_layout()  # name -> (trailing shape, dtype)
        self.slabs = [self._zeros(capacity if allocate else 0) for _ in range(num_layers)]  # per layer: name -> slab

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

    def fetch(self, layer: int, n: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read(layer, slots)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        def grown(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x.new_zeros(*x.shape[:2], capacity - x.shape[2], *x.shape[3:])], 2)

        self.slabs = [{name: grown(x) for name, x in slabs.items()} for slabs in self.slabs]

    def _move(self, src: torch.Tensor, dst: torch.Tensor, capacity: int) -> None:
        def moved(x: torch.Tensor) -> torch.Tensor:
            y = x.new_zeros(*x.shape[:2], capacity, *x.shape[3:])
            y.index_copy_(2, dst, x.index_select(2, src))
            return y

        self.slabs = [{name: moved(x) for name, x in slabs.items()} for slabs in self.slabs]

    @property
    def row_axes(self) -> dict[str, int]:  # type: ignore[override]  # SlotStore's class attribute; the names are the codec's
        return {name: 3 for name in self.layout}

    def read_rows(self, slots: np.ndarray) -> dict:
        idx = self.slots_tensor(np.asarray(slots, dtype=np.int64))
        return {name: _stacked_rows([slabs[name] for slabs in self.slabs], 2, idx) for name in self.layout}

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


@dataclass(frozen=True)
class Int8Rows:
    """Rows of an Int8SlabStore as stored: int8 codes with one scale per (head, position). Keys
    are (Hkv, N, D); values are kept transposed, (Hkv, D, N), so the weighted sum over positions
    runs through the same int8 kernel as the scores (backends/torch/attention.py)."""

    codes: torch.Tensor
    scales: torch.Tensor  # (Hkv, N) bfloat16: the kernel's scale dtype; codes were rounded against it
    transposed: bool

    @property
    def width(self) -> int:
        return self.scales.shape[1]

    def select(self, idx: torch.Tensor) -> "Int8Rows":
        return Int8Rows(self.codes.index_select(2 if self.transposed else 1, idx), self.scales.index_select(1, idx), self.transposed)

    def dequantize(self) -> torch.Tensor:
        """(Hkv, N, D) float32."""
        c = self.codes.transpose(1, 2) if self.transposed else self.codes
        return c.float() * self.scales.float()[..., None]


class Int8SlabStore(SlotStore):
    """Resident rows in int8 with a bf16 scale per (layer, head, position): a quarter of fp32's
    bytes, read by attention without decoding (scores and weighted sum through torch's int8
    weight kernel). The kernel wants a contiguous matrix, and V is stored transposed, so reads
    are whole slabs: every step reads `capacity` columns (empty ones masked), whatever `n`."""

    compressor = "identity"
    whole_slab_reads = True
    # The kernel's reduction dimension must be a multiple of 16 (other sizes return garbage or
    # crash in torch 2.13): capacity is the reduction of the weighted sum, head_dim of the scores.
    MULTIPLE = 16

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: str | torch.device, *, allocate: bool = True):
        if torch.device(device).type != "cpu":
            raise ValueError(f"an int8 K/V store runs on torch's CPU int8 kernel; on {device} use kv dtype fp32")
        if head_dim % self.MULTIPLE:
            raise ValueError(f"an int8 K/V store needs head_dim divisible by {self.MULTIPLE} (torch's int8 kernel); "
                             f"this model's is {head_dim}: use kv dtype fp32")
        capacity = self.fit(capacity)
        super().__init__(capacity, device)
        self.dtype = dtype
        z8 = functools.partial(torch.zeros, dtype=torch.int8, device=device)
        zs = functools.partial(torch.zeros, dtype=torch.bfloat16, device=device)
        n = capacity if allocate else 0  # rows_deferred: load_state brings the slabs
        self.k = [z8(num_kv_heads, n, head_dim) for _ in range(num_layers)]
        self.v = [z8(num_kv_heads, head_dim, n) for _ in range(num_layers)]  # transposed
        self.ks = [zs(num_kv_heads, n) for _ in range(num_layers)]
        self.vs = [zs(num_kv_heads, n) for _ in range(num_layers)]

    @staticmethod
    def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (Hkv, T, D) -> int8 codes, bf16 scales (Hkv, T): symmetric, per position and head."""
        scale = (x.abs().amax(-1) / 127).clamp_min(1e-12).to(torch.bfloat16)
        codes = torch.round(x / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8)
        return codes, scale

    def fit(self, capacity: int) -> int:
        return -(-capacity // self.MULTIPLE) * self.MULTIPLE

    def read_width(self, n: int) -> int:
        return self.capacity

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        kc, ks = self.quantize(k)
        vc, vs = self.quantize(v)
        self.k[layer].index_copy_(1, slots, kc)
        self.ks[layer].index_copy_(1, slots, ks)
        self.v[layer].index_copy_(2, slots, vc.transpose(1, 2))
        self.vs[layer].index_copy_(1, slots, vs)

    def fetch(self, layer: int, n: int, slots: torch.Tensor | None) -> tuple[Int8Rows, Int8Rows]:
        return Int8Rows(self.k[layer], self.ks[layer], False), Int8Rows(self.v[layer], self.vs[layer], True)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.fetch(layer, self.capacity, None)
        return k.select(slots).dequantize().to(self.dtype), v.select(slots).dequantize().to(self.dtype)

    def _grow(self, capacity: int) -> None:
        extra = capacity - self.capacity

        def grown(x: torch.Tensor, dim: int) -> torch.Tensor:
            shape = list(x.shape)
            shape[dim] = extra
            return torch.cat([x, x.new_zeros(shape)], dim)

        self.k, self.ks, self.vs = ([grown(x, 1) for x in xs] for xs in (self.k, self.ks, self.vs))
        self.v = [grown(x, 2) for x in self.v]

    def _move(self, src: torch.Tensor, dst: torch.Tensor, capacity: int) -> None:
        def moved(x: torch.Tensor, dim: int) -> torch.Tensor:
            shape = list(x.shape)
            shape[dim] = capacity
            return x.new_zeros(shape).index_copy_(dim, dst, x.index_select(dim, src))

        self.k, self.ks, self.vs = ([moved(x, 1) for x in xs] for xs in (self.k, self.ks, self.vs))
        self.v = [moved(x, 2) for x in self.v]

    def _payload(self) -> dict:
        return {"k": torch.stack(self.k), "k_scale": torch.stack(self.ks), "v_t": torch.stack(self.v), "v_scale": torch.stack(self.vs)}

    def _load_payload(self, payload: dict) -> None:
        dev = self.device
        want = {"k": torch.int8, "k_scale": torch.bfloat16, "v_t": torch.int8, "v_scale": torch.bfloat16}
        got = {name: t.dtype for name, t in payload.items()}
        if got != want:
            raise ValueError(f"stored payload {got} does not fit an int8 K/V store, which holds {want}")
        self.k, self.ks, self.v, self.vs = ([t.to(dev).contiguous() for t in payload[name].unbind(0)]
                                            for name in ("k", "k_scale", "v_t", "v_scale"))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *self.ks, *self.vs))


def make_store(compressor: str, q_range: int, *, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
               dtype: torch.dtype, device: str | torch.device) -> SlotStore:
    allocate = _allocating()
    if compressor == "identity":
        return SlabStore(num_layers, num_kv_heads, head_dim, capacity, dtype, device, allocate=allocate)
    if compressor == FP16_RESIDENT:
        return HalfSlabStore(num_layers, num_kv_heads, head_dim, capacity, dtype, device, allocate=allocate)
    if compressor == INT8_RESIDENT:
        return Int8SlabStore(num_layers, num_kv_heads, head_dim, capacity, dtype, device, allocate=allocate)
    if compressor not in COMPRESSOR_NAMES:
        raise CompressorInputError(f"unknown kv compressor {compressor!r}; choose one of {', '.join(COMPRESSOR_NAMES)}")
    return CompressedStore(num_layers, num_kv_heads, head_dim, capacity, dtype, device,
                           compressor=compressor, q_range=q_range, allocate=allocate)


def _stacked_rows(slabs: list, axis: int, idx: torch.Tensor) -> torch.Tensor:
    """torch.stack([x.index_select(axis, idx) for x in slabs]).cpu() without the per-layer copies beside the stacked
    one (a save reads the resident rows this way: half the peak)."""
    x = slabs[0]
    out = x.new_empty(len(slabs), *x.shape[:axis], idx.numel(), *x.shape[axis + 1:])
    for i, slab in enumerate(slabs):
        torch.index_select(slab, axis, idx, out=out[i])
    return out.cpu()
