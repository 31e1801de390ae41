"""KV codecs (ADR 0008 §11.11.4): pure row codecs, (N, D) float rows <-> per-row payload tensors.

A codec owns no slots and no storage: `encode(rows)` returns named payload tensors whose first
dim is N, `decode(payload)` gives the rows back as float32 (N, D), and `payload_layout()` names
each payload's trailing shape and dtype so a store (stores.py CompressedStore, the only owner of
bytes and occupancy) can preallocate slabs for them. "identity" is not a codec: an uncompressed
cache keeps its rows in a SlabStore.

Per row (`bytes_per_row`), kakeya_*: code_bytes uint8 packed lattice point (see
compressor_lattice_codes.py) + 2 float16 scalars (‖x‖, qmax of the rotated unit vector)
= code_bytes + 4 bytes; head_dim 64, q_range 38: 50 + 4 bytes (D4), 51 + 4 bytes (E8) vs 128
bytes of bf16.

`KakeyaLatticeCodec` reproduces `kakeyalattice`'s own `roundtrip` bit for bit: it reuses the
codec's Hadamard matrix and nearest-lattice-point step, keeps the lattice point and the two fp16
scalars the codec rounds through, and decodes with the codec's exact float ops. Each row is
coded on its own, so decode(encode(x)) == kakeyalattice roundtrip(x) for any x of at least 16
rows, and any subset or order of rows decodes to the same bits; for fewer rows the codec's own
result differs in the last bits (see `_rotate`), ours does not.
"""
from __future__ import annotations

from typing import Any, NoReturn, Protocol, runtime_checkable

import torch

from inference_engine.kv.compressor_lattice_codes import LatticeCodePacker
from inference_engine.kv.compressor_names import COMPRESSOR_NAMES, MAX_Q_RANGE

CODEC_NAMES = tuple(n for n in COMPRESSOR_NAMES if n != "identity")
_MIN_GEMM_ROWS = 16  # see KakeyaLatticeCodec._rotate


class CompressorInputError(ValueError):
    """The caller passed rows, K/V or settings a codec or compressed store cannot accept."""


class KakeyaLatticeUnavailable(ImportError):
    """A kakeya_* codec was requested but the kakeyalattice package is not installed."""


@runtime_checkable
class KVCodec(Protocol):
    """Rows (N, head_dim) <-> named per-row payload tensors, each (N, *trailing shape)."""

    head_dim: int

    def encode(self, rows: torch.Tensor) -> dict[str, torch.Tensor]: ...
    def decode(self, payload: dict[str, torch.Tensor]) -> torch.Tensor: ...
    def payload_layout(self) -> dict[str, tuple[tuple, torch.dtype]]: ...

    @property
    def bytes_per_row(self) -> int: ...


def bf16_reference_bytes(num_slots: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes the same K and V rows take as plain bf16, the baseline compression is measured against."""
    return 2 * num_slots * num_kv_heads * head_dim * 2


def make_codec(name: str, q_range: int = 38, *, head_dim: int, device: str | torch.device = "cpu") -> KVCodec:
    """The codec a compressor name stands for (kakeya_d4 / kakeya_e8); codes do not depend on the model dtype."""
    if name == "identity":
        raise CompressorInputError("'identity' is not a codec: uncompressed rows live in a SlabStore (stores.make_store)")
    if name in CODEC_NAMES:
        return KakeyaLatticeCodec(name.removeprefix("kakeya_"), q_range, head_dim, device)
    raise CompressorInputError(f"unknown compressor {name!r}; choose one of {', '.join(COMPRESSOR_NAMES)}")


class KakeyaLatticeCodec:
    """D4 (kakeyalattice v1.4) or E8 (v1.5) lattice codes + two fp16 scalars per row."""

    def __init__(self, lattice: str, q_range: int, head_dim: int, device: str | torch.device = "cpu"):
        codec_class = _kakeya_codec_class(lattice)
        block = codec_class.block_dim
        if not isinstance(head_dim, int) or head_dim < 1 or head_dim & (head_dim - 1) or head_dim % block:
            raise CompressorInputError(
                f"kakeya_{lattice} needs head_dim to be a power of two and a multiple of {block} "
                f"(Hadamard rotation, {block}-D blocks), got {head_dim!r}; use the identity compressor for this model"
            )
        if not isinstance(q_range, int) or not 1 <= q_range <= MAX_Q_RANGE:
            raise CompressorInputError(f"q_range must be an int in [1, {MAX_Q_RANGE}], got {q_range!r} (38 is the default)")
        self.lattice = lattice
        self.q_range = q_range
        self.head_dim = head_dim
        self.device = torch.device(device)
        # kakeyalattice asserts on bad arguments; everything it would reject was rejected above.
        self.kakeya = codec_class(D=head_dim, q_range=q_range, device=str(self.device))
        self.packer = LatticeCodePacker(head_dim, block, q_range, half_integer_coset=lattice == "e8",
                                        device=self.device)

    def payload_layout(self) -> dict[str, tuple[tuple, torch.dtype]]:
        return {"codes": ((self.packer.code_bytes,), torch.uint8), "scalars": ((2,), torch.float16)}

    @property
    def bytes_per_row(self) -> int:
        return self.packer.code_bytes + 2 * 2

    # The float ops below are kakeyalattice's roundtrip, op for op, split at the stored values.
    def encode(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """(N, D) float rows -> {"codes": (N, code_bytes) uint8, "scalars": (N, 2) float16}."""
        if not isinstance(rows, torch.Tensor) or not rows.is_floating_point() or rows.dim() != 2 \
                or rows.shape[1] != self.head_dim:
            raise CompressorInputError(f"rows must be a float tensor (N, head_dim={self.head_dim}), got {_describe(rows)}")
        rows = rows.to(self.device, torch.float32)
        n, eps = rows.shape[0], torch.finfo(torch.float32).eps
        if n == 0:
            return {name: torch.zeros(0, *shape, dtype=dtype, device=self.device)
                    for name, (shape, dtype) in self.payload_layout().items()}
        norms = rows.norm(dim=1, keepdim=True).clamp(min=eps)  # (N, 1)
        y = self._rotate(rows / norms)  # (N, D) unit vectors, Hadamard-rotated
        qmax = y.abs().max(dim=1, keepdim=True).values.clamp(min=eps)
        scalars = torch.cat([norms, qmax], dim=1).to(torch.float16)  # (N, 2)
        scale = scalars[:, 1:].to(torch.float32) / float(self.q_range)
        blocks = (y / scale).reshape(n, self.packer.blocks, self.packer.block_dim)
        point = self.kakeya._closest_lattice_point(blocks)  # before the codec's clamp; see the packer
        twice = torch.round(point * 2).to(torch.int64)
        # Every check in one host sync (a decode step encodes one token per layer; on an
        # accelerator each sync drains the launch queue). Later checks are meaningless once an
        # earlier one fails, so the first failing one names the problem.
        packed, off_lattice = self.packer.pack_flagged(twice)
        failed = torch.stack([~torch.isfinite(rows).all(), ~torch.isfinite(scalars).all(), off_lattice])
        if bool(failed.any()):
            self._raise_first(*failed.tolist())
        return {"codes": packed, "scalars": scalars}

    def decode(self, payload: dict[str, torch.Tensor]) -> torch.Tensor:
        """Payload of N rows (as `encode` returned it, or gathered from a store) -> float32 (N, D)."""
        codes, scalars = payload["codes"], payload["scalars"]
        n = codes.shape[0]
        if n == 0:
            return torch.zeros(0, self.head_dim, device=codes.device)
        q = float(self.q_range)
        point = self.packer.unpack_points(codes).clamp(-q, q)  # (N, blocks, block_dim)
        scale = scalars[:, 1:].to(torch.float32) / q  # (N, 1)
        y_hat = (point * scale.unsqueeze(-1)).reshape(n, self.head_dim)
        return self._rotate(y_hat) * scalars[:, :1].to(torch.float32)

    def _raise_first(self, non_finite: bool, too_large: bool, off_lattice: bool) -> NoReturn:
        if non_finite:
            raise CompressorInputError("K/V contain inf or NaN; the lattice code cannot represent them")
        if too_large:
            raise CompressorInputError("a K/V vector norm exceeds the float16 range the codec stores it in")
        if not off_lattice:  # unreachable: called only when one of the three failed
            raise RuntimeError("KakeyaLatticeCodec._raise_first called without a failed check")
        raise self.packer.invalid_error()

    def _rotate(self, rows: torch.Tensor) -> torch.Tensor:
        # MKL rounds a GEMM of fewer than ~12 rows through another kernel, so a vector's code
        # would depend on how many vectors shared its call (one token vs a prefill chunk).
        # Padding keeps every row on the batched kernel: codes are per-vector, and equal to
        # kakeyalattice's roundtrip of any batch of at least 16 rows.
        m = rows.shape[0]
        if m < _MIN_GEMM_ROWS:
            rows = torch.cat([rows, rows.new_zeros(_MIN_GEMM_ROWS - m, rows.shape[1])])
        return (rows @ self.kakeya.H)[:m]


def _kakeya_codec_class(lattice: str) -> Any:  # kakeyalattice ships no type information
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


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
