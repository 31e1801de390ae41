"""KV compressors (ADR 0008 §11.11.4): a per-layer, slot-addressed store of K/V rows.

A cache writes K/V of shape (Hkv, T, D) at T integer slots, reads any occupied slots back as
float32 (Hkv, n, D), frees slots with `evict`, and reports the bytes the store holds with
`memory_bytes`. Storage is preallocated for `capacity` slots (grow with `ensure_capacity`),
so `memory_bytes` is `capacity * bytes_per_slot` whatever the occupancy: evicting frees a slot
for reuse, it never shrinks the store, and writing into a freed slot never grows it.

Per slot layout (`bytes_per_slot`), for K and for V, per kv head:
  identity:   head_dim values in the store dtype
  kakeya_*:   code_bytes uint8 packed lattice point (see compressor_lattice_codes.py)
              + 2 float16 scalars (‖x‖, qmax of the rotated unit vector) = code_bytes + 4 bytes
              head_dim 64, q_range 38: 50 + 4 bytes (D4), 51 + 4 bytes (E8) vs 128 bytes of bf16.
The slot occupancy mask (1 bool per slot) is bookkeeping and is not counted.

`KakeyaLatticeCompressor` reproduces `kakeyalattice`'s own `roundtrip` bit for bit: it reuses
the codec's Hadamard matrix and nearest-lattice-point step, stores the lattice point and the
two fp16 scalars the codec rounds through, and decodes with the codec's exact float ops.
Each vector is coded on its own, so decompress(compress(x)) == codec.roundtrip(x) for any x
of at least 16 rows, and any subset or order of slots reads back the same bits; for fewer
rows the codec's own result differs in the last bits (see `_rotate`), ours does not.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from inference_engine.kv.compressor_lattice_codes import LatticeCodePacker
from inference_engine.kv.compressor_names import COMPRESSOR_NAMES, MAX_Q_RANGE
_MIN_GEMM_ROWS = 16  # see KakeyaLatticeCompressor._rotate
_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class CompressorInputError(ValueError):
    """The caller passed K/V, slots or settings the compressor cannot accept."""


class EmptySlotError(LookupError):
    """A slot was read that holds nothing (never written, or evicted)."""


class KakeyaLatticeUnavailable(ImportError):
    """A kakeya_* compressor was requested but the kakeyalattice package is not installed."""


@runtime_checkable
class KVCompressor(Protocol):
    """What a resident cache calls: one instance per layer per session, K/V (Hkv, T, D) at slots (T,)."""

    def compress(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None: ...
    def decompress(self, slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...
    def evict(self, slots: torch.Tensor) -> None: ...
    def memory_bytes(self) -> int: ...


def bf16_reference_bytes(num_slots: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes the same K and V rows take as plain bf16, the baseline compression is measured against."""
    return 2 * num_slots * num_kv_heads * head_dim * 2


def make_compressor(
    name: str,
    *,
    q_range: int = 38,
    head_dim: int,
    num_kv_heads: int,
    capacity: int,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> "SlotCompressor":
    """`identity` stores `dtype` rows; `kakeya_d4` / `kakeya_e8` ignore `dtype` (codes are dtype-free)."""
    if name == "identity":
        return IdentityCompressor(
            head_dim=head_dim, num_kv_heads=num_kv_heads, capacity=capacity, dtype=dtype, device=device
        )
    if name in ("kakeya_d4", "kakeya_e8"):
        return KakeyaLatticeCompressor(
            lattice=name.removeprefix("kakeya_"), q_range=q_range, head_dim=head_dim,
            num_kv_heads=num_kv_heads, capacity=capacity, device=device,
        )
    raise CompressorInputError(f"unknown compressor {name!r}; choose one of {', '.join(COMPRESSOR_NAMES)}")


class SlotCompressor:
    """Slot bookkeeping and argument checks shared by every compressor; subclasses own the payload."""

    def __init__(self, *, head_dim: int, num_kv_heads: int, capacity: int, device: str | torch.device):
        for label, value in (("head_dim", head_dim), ("num_kv_heads", num_kv_heads), ("capacity", capacity)):
            if not isinstance(value, int) or value < 1:
                raise CompressorInputError(f"{label} must be a positive int, got {value!r}")
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.capacity = capacity
        self.device = torch.device(device)
        self._in_use = torch.zeros(capacity, dtype=torch.bool, device=self.device)

    # -- KVCompressor --
    def compress(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store k, v (Hkv, T, D) at slots (T,); slots already holding rows are overwritten."""
        slots = self._check_write(k, v, slots)
        if slots.numel() == 0:
            return
        kv = torch.stack([k, v]).to(self.device)  # (2, Hkv, T, D)
        self._write(kv, slots)
        self._in_use[slots] = True

    def decompress(self, slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (k, v), each (Hkv, n, D), at `slots` in the given order; None = `slots_in_use()`."""
        slots = self.slots_in_use() if slots is None else self._check_slots(slots, "decompress")
        empty = slots[~self._in_use[slots]]
        if empty.numel():
            raise EmptySlotError(f"slots {empty.tolist()} hold no K/V (never written or evicted)")
        if slots.numel() == 0:
            out = torch.zeros(2, self.num_kv_heads, 0, self.head_dim, device=self.device)
        else:
            out = self._read(slots)
        return out[0], out[1]

    def write_rows(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """`compress` for a caller that owns the slot bookkeeping (a resident cache): k, v are
        (Hkv, T, D) of this compressor's geometry and `slots` (T,) distinct long slots < capacity.
        Nothing is checked that would need a host sync per call; the codec's own checks stay."""
        self._write(torch.stack([k, v]), slots)
        self._in_use[slots] = True

    def read_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """`decompress` for a caller that owns the slot bookkeeping: (2, Hkv, n, D) float32 at
        occupied long `slots`, unchecked (no host sync)."""
        if slots.numel() == 0:
            return torch.zeros(2, self.num_kv_heads, 0, self.head_dim, device=self.device)
        return self._read(slots)

    def free_rows(self, slots: torch.Tensor) -> None:
        """`evict` for a caller that owns the slot bookkeeping: long `slots` < capacity, unchecked."""
        self._in_use[slots] = False

    def evict(self, slots: torch.Tensor) -> None:
        """Free slots for reuse; freeing a free slot is a no-op. The store keeps its size."""
        self._in_use[self._check_slots(slots, "evict")] = False

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._payload())

    # -- extras the caches use --
    @property
    def bytes_per_slot(self) -> int:
        return self.memory_bytes() // self.capacity

    def slots_in_use(self) -> torch.Tensor:
        """Occupied slots, ascending."""
        return self._in_use.nonzero().flatten()

    def ensure_capacity(self, capacity: int) -> None:
        """Grow the store to at least `capacity` slots, keeping what it holds."""
        if capacity <= self.capacity:
            return
        grow = capacity - self.capacity
        self._grow(grow)
        self._in_use = torch.cat([self._in_use, self._in_use.new_zeros(grow)])
        self.capacity = capacity

    def compact(self, keep: torch.Tensor, capacity: int) -> None:
        """Rebuild the store with `capacity` slots holding the rows of slots `keep` at 0..len(keep)-1,
        bit for bit (payload bytes are moved, never re-encoded); every other slot ends up free."""
        keep = self._check_slots(keep, "compact")
        if not isinstance(capacity, int) or capacity < max(1, keep.numel()):
            raise CompressorInputError(f"compact: capacity must be an int >= max(1, {keep.numel()} kept slots), got {capacity!r}")
        empty = keep[~self._in_use[keep]]
        if empty.numel():
            raise EmptySlotError(f"compact: slots {empty.tolist()} hold no K/V")
        for name in self._payload_names:
            old = getattr(self, name)  # (2, Hkv, capacity, ...)
            new = old.new_zeros(*old.shape[:2], capacity, *old.shape[3:])
            new[:, :, : keep.numel()] = old.index_select(2, keep)
            setattr(self, name, new)
        self._in_use = self._in_use.new_zeros(capacity)
        self._in_use[: keep.numel()] = True
        self.capacity = capacity

    @property
    def payload_names(self) -> tuple:
        return self._payload_names

    def load_payload(self, payload: dict, in_use) -> None:
        """Adopt stored payload tensors (as `getattr(self, name)` held them) and the occupancy
        mask `in_use` (capacity,) bool: the inverse of reading the payload for persistence."""
        for name in self._payload_names:
            setattr(self, name, payload[name].to(self.device).contiguous())
        self._in_use = torch.as_tensor(in_use, dtype=torch.bool).to(self.device)
        self.capacity = int(self._in_use.numel())

    # -- subclass hooks --
    _payload_names: tuple = ()  # attributes holding (2, Hkv, capacity, ...) payload tensors

    def _write(self, kv: torch.Tensor, slots: torch.Tensor) -> None:  # kv (2, Hkv, T, D)
        raise NotImplementedError

    def _read(self, slots: torch.Tensor) -> torch.Tensor:  # -> (2, Hkv, n, D) float32
        raise NotImplementedError

    def _payload(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def _grow(self, extra_slots: int) -> None:
        raise NotImplementedError

    # -- checks --
    def _check_write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        for label, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 3:
                raise CompressorInputError(f"{label} must be a float tensor (Hkv, T, D), got {_describe(x)}")
            if x.shape[0] != self.num_kv_heads or x.shape[2] != self.head_dim:
                raise CompressorInputError(
                    f"{label} has shape {tuple(x.shape)}; this compressor holds "
                    f"(num_kv_heads={self.num_kv_heads}, T, head_dim={self.head_dim})"
                )
        if k.shape != v.shape or k.dtype != v.dtype:
            raise CompressorInputError(
                f"k ({_describe(k)}) and v ({_describe(v)}) must have the same shape and dtype"
            )
        slots = self._check_slots(slots, "compress")
        if slots.numel() != k.shape[1]:
            raise CompressorInputError(f"{slots.numel()} slots given for {k.shape[1]} K/V rows; pass one slot per row")
        if torch.unique(slots).numel() != slots.numel():
            raise CompressorInputError(f"slots {slots.tolist()} repeat a slot; each row needs its own slot")
        return slots

    def _check_slots(self, slots: torch.Tensor, op: str) -> torch.Tensor:
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in _INDEX_DTYPES:
            raise CompressorInputError(f"{op}: slots must be a 1-D integer tensor, got {_describe(slots)}")
        slots = slots.to(device=self.device, dtype=torch.long)
        bad = slots[(slots < 0) | (slots >= self.capacity)]
        if bad.numel():
            raise CompressorInputError(
                f"{op}: slots {bad.tolist()} outside [0, {self.capacity}); call ensure_capacity() to grow the store"
            )
        return slots


class IdentityCompressor(SlotCompressor):
    """Stores K/V rows as they are, in `dtype` (exact when the input already has that dtype)."""

    _payload_names = ("_kv",)

    def __init__(self, *, head_dim: int, num_kv_heads: int, capacity: int,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"):
        super().__init__(head_dim=head_dim, num_kv_heads=num_kv_heads, capacity=capacity, device=device)
        if not dtype.is_floating_point:
            raise CompressorInputError(f"identity compressor stores floats, got dtype {dtype}")
        self.dtype = dtype
        self._kv = torch.zeros(2, num_kv_heads, capacity, head_dim, dtype=dtype, device=self.device)

    def _write(self, kv, slots):
        self._kv.index_copy_(2, slots, kv.to(self.dtype))

    def _read(self, slots):
        return self._kv.index_select(2, slots).float()

    def _payload(self):
        return [self._kv]

    def _grow(self, extra_slots):
        pad = self._kv.new_zeros(2, self.num_kv_heads, extra_slots, self.head_dim)
        self._kv = torch.cat([self._kv, pad], dim=2)


class KakeyaLatticeCompressor(SlotCompressor):
    """D4 (kakeyalattice v1.4) or E8 (v1.5) lattice codes + two fp16 scalars per vector."""

    _payload_names = ("_codes", "_scalars")

    def __init__(self, *, lattice: str, q_range: int, head_dim: int, num_kv_heads: int, capacity: int,
                 device: str | torch.device = "cpu"):
        super().__init__(head_dim=head_dim, num_kv_heads=num_kv_heads, capacity=capacity, device=device)
        codec_class = _kakeya_codec_class(lattice)
        block = codec_class.block_dim
        if head_dim & (head_dim - 1) or head_dim % block:
            raise CompressorInputError(
                f"kakeya_{lattice} needs head_dim to be a power of two and a multiple of {block} "
                f"(Hadamard rotation, {block}-D blocks), got {head_dim}; use the identity compressor for this model"
            )
        if not isinstance(q_range, int) or not 1 <= q_range <= MAX_Q_RANGE:
            raise CompressorInputError(f"q_range must be an int in [1, {MAX_Q_RANGE}], got {q_range!r} (38 is the default)")
        self.lattice = lattice
        self.q_range = q_range
        # The codec asserts on bad arguments; everything it would reject was rejected above.
        self.codec = codec_class(D=head_dim, q_range=q_range, device=str(self.device))
        self.packer = LatticeCodePacker(head_dim, block, q_range, half_integer_coset=lattice == "e8",
                                        device=self.device)
        self._codes = torch.zeros(2, num_kv_heads, capacity, self.packer.code_bytes, dtype=torch.uint8,
                                  device=self.device)
        self._scalars = torch.zeros(2, num_kv_heads, capacity, 2, dtype=torch.float16, device=self.device)

    def _write(self, kv, slots):
        rows = kv.reshape(-1, self.head_dim).to(torch.float32)  # (2*Hkv*T, D)
        codes, scalars = self._encode(rows)  # checked before anything is stored
        n = slots.numel()
        self._codes.index_copy_(2, slots, codes.reshape(2, self.num_kv_heads, n, -1))
        self._scalars.index_copy_(2, slots, scalars.reshape(2, self.num_kv_heads, n, 2))

    def _read(self, slots):
        codes = self._codes.index_select(2, slots).reshape(-1, self.packer.code_bytes)
        scalars = self._scalars.index_select(2, slots).reshape(-1, 2)
        return self._decode(codes, scalars).reshape(2, self.num_kv_heads, slots.numel(), self.head_dim)

    def _payload(self):
        return [self._codes, self._scalars]

    def _grow(self, extra_slots):
        self._codes = torch.cat([self._codes, self._codes.new_zeros(2, self.num_kv_heads, extra_slots,
                                                                     self.packer.code_bytes)], dim=2)
        self._scalars = torch.cat([self._scalars, self._scalars.new_zeros(2, self.num_kv_heads, extra_slots, 2)],
                                  dim=2)

    # The float ops below are the codec's roundtrip, op for op, split at the stored values.
    def _encode(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, eps = rows.shape[0], torch.finfo(torch.float32).eps
        norms = rows.norm(dim=1, keepdim=True).clamp(min=eps)  # (N, 1)
        y = self._rotate(rows / norms)  # (N, D) unit vectors, Hadamard-rotated
        qmax = y.abs().max(dim=1, keepdim=True).values.clamp(min=eps)
        scalars = torch.cat([norms, qmax], dim=1).to(torch.float16)  # (N, 2)
        scale = scalars[:, 1:].to(torch.float32) / float(self.q_range)
        blocks = (y / scale).reshape(n, self.packer.blocks, self.packer.block_dim)
        point = self.codec._closest_lattice_point(blocks)  # before the codec's clamp; see the packer
        twice = torch.round(point * 2).to(torch.int64)
        # Every check in one host sync (a decode step encodes one token per layer; on an
        # accelerator each sync drains the launch queue). Later checks are meaningless once an
        # earlier one fails, so the first failing one names the problem.
        packed, off_lattice = self.packer.pack_flagged(twice)
        failed = torch.stack([~torch.isfinite(rows).all(), ~torch.isfinite(scalars).all(), off_lattice])
        if bool(failed.any()):
            self._raise_first(*failed.tolist())
        return packed, scalars

    def _raise_first(self, non_finite: bool, too_large: bool, off_lattice: bool):
        if non_finite:
            raise CompressorInputError("K/V contain inf or NaN; the lattice code cannot represent them")
        if too_large:
            raise CompressorInputError("a K/V vector norm exceeds the float16 range the codec stores it in")
        assert off_lattice
        raise self.packer.invalid_error()

    def _decode(self, codes: torch.Tensor, scalars: torch.Tensor) -> torch.Tensor:
        n = codes.shape[0]
        q = float(self.q_range)
        point = self.packer.unpack_points(codes).clamp(-q, q)  # (N, blocks, block_dim)
        scale = scalars[:, 1:].to(torch.float32) / q  # (N, 1)
        y_hat = (point * scale.unsqueeze(-1)).reshape(n, self.head_dim)
        return self._rotate(y_hat) * scalars[:, :1].to(torch.float32)

    def _rotate(self, rows: torch.Tensor) -> torch.Tensor:
        # MKL rounds a GEMM of fewer than ~12 rows through another kernel, so a vector's code
        # would depend on how many vectors shared its call (one token vs a prefill chunk).
        # Padding keeps every row on the batched kernel: codes are per-vector, and equal to
        # codec.roundtrip of any batch of at least 16 rows.
        m = rows.shape[0]
        if m < _MIN_GEMM_ROWS:
            rows = torch.cat([rows, rows.new_zeros(_MIN_GEMM_ROWS - m, rows.shape[1])])
        return (rows @ self.codec.H)[:m]


def _kakeya_codec_class(lattice: str):
    if lattice not in ("d4", "e8"):
        raise CompressorInputError(f"unknown lattice {lattice!r}; choose 'd4' or 'e8'")
    try:
        import kakeyalattice
    except ImportError as e:
        raise KakeyaLatticeUnavailable(
            f"kakeya_{lattice} needs the kakeyalattice package: pip install kakeyalattice==1.5.0 "
            "(or pip install 'kakeya-runtime[lattice]'), or choose the identity compressor"
        ) from e
    return kakeyalattice.V14KakeyaZamirLatticeGPU if lattice == "d4" else kakeyalattice.V15KakeyaZamirE8GPU


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
