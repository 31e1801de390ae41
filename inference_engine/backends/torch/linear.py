"""Weight formats of the torch backend's linear layers: fp32 dense, int8 and int4 weight-only.

Each format is a callable `y = lin(x)` on (M, K) activations -> (M, N), with `nbytes` (the
bytes a forward reads) and `dequantized()` (the fp32 matrix it computes with, for checks).

Measured on the 2-core CPU (torch 2.13, SmolLM2's 30 layers of linears, `scripts/bench_weights.py`):
torch's weight-only kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) are fast
only with bfloat16 activations; with fp32 or fp16 activations they fall back to paths several
times slower than fp32 dense. So the quantized formats cast activations to bf16 for the
matmul and back to fp32 after it, and their scales are stored in bf16 (chosen so that the
integer codes are computed against the bf16 scale actually used). Both kernels are bitwise
row-independent (a row's output does not depend on the other rows of the call), so results do
not depend on how a history was chunked (INV-3). Dequantizing to bf16 and using dense GEMM for
prefill chunks measured faster (2k prefill: int4 523 vs 429 tok/s, int8 622 vs 411) but its
numerics change with the number of rows per call and flipped near-tie tokens between chunkings
(tests/backends/test_weight_formats.py), so it is not used.

  int8: symmetric, one scale per output row.
  int4: asymmetric, groups of 32 along the input (GGUF Q4_1's own layout: w = q * d + m per
        32-block), scale and zero per group; built from the GGUF's Q4_1 blocks when given.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

WEIGHT_FORMATS = ("fp32", "int8", "int4")
GROUP = 32  # int4 group size along the input dimension (= GGUF Q4_1 block)
_COMPUTE = torch.bfloat16


class DenseLinear:
    """y = x @ w.T (+ b) in the weight's dtype."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None = None):
        self.w, self.b = w.contiguous(), b

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w, self.b)

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()

    def dequantized(self) -> torch.Tensor:
        return self.w.float()


class Int8Linear:
    """Per-output-row symmetric int8: w ≈ q * s, q in [-127, 127], s bf16 (N,)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, b: torch.Tensor | None = None):
        self.q, self.scales, self.b = q.contiguous(), scales.contiguous(), b

    @classmethod
    def from_float(cls, w: torch.Tensor, b: torch.Tensor | None = None) -> "Int8Linear":
        w = w.float()
        s = (w.abs().amax(1) / 127).clamp_min(1e-12).to(_COMPUTE)  # the scale the kernel will use
        q = torch.round(w / s.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, s, b)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x.to(_COMPUTE), self.q, self.scales)
        y = y.to(x.dtype)
        return y + self.b if self.b is not None else y

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * 2

    def dequantized(self) -> torch.Tensor:
        return self.q.float() * self.scales.float()[:, None]

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors it computes with (backends/torch/packed.py saves them; `from_state` takes them back)."""
        return {"q": self.q, "scales": self.scales}

    @classmethod
    def from_state(cls, st: dict[str, torch.Tensor], b: torch.Tensor | None = None) -> "Int8Linear":
        return cls(st["q"], st["scales"], b)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows `ids` (an embedding lookup from the same table), fp32."""
        return self.q[ids].float() * self.scales[ids].float()[:, None]


def quantize_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q (N, K) in 0..15, d, m (N, K / 32)) with w ~ q * d + m per group of 32: min/max per group, as
    llama.cpp's Q4_1 quantizer does. The MLX backend's int4 quantizes with this too (same weights)."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / 15).clamp_min(1e-12)
    return torch.round((g - lo[..., None]) / d[..., None]).clamp(0, 15).view(n, k), d, lo


class Int4Linear:
    """Groups of 32 along the input: w = (q - 8) * scale + zero, q in [0, 15] (torch's int4pack
    convention; a Q4_1 block q * d + m is scale = d, zero = m + 8 d)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, b: torch.Tensor | None = None):
        # q (N, K) int values 0..15; scale, zero (N, K / 32)
        n, k = q.shape
        if k % GROUP:
            raise ValueError(f"int4 needs the input dimension to be a multiple of {GROUP}, got {k}")
        q = q.to(torch.uint8)
        self.shape = (n, k)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.nibbles = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()  # (N, K/2): the codes, for checks
        self.scale = scale.to(_COMPUTE).contiguous()  # (N, K/32)
        self.zero = zero.to(_COMPUTE).contiguous()
        self.scale_zero = torch.stack([self.scale, self.zero], -1).transpose(0, 1).contiguous()  # (K/32, N, 2)
        self.b = b

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors it computes with, packed (torch's int4pack layout: valid for the torch version and CPU that
        made it; backends/torch/packed.py keys its file on those)."""
        return {"packed": self.packed, "nibbles": self.nibbles, "scale": self.scale, "zero": self.zero,
                "scale_zero": self.scale_zero}

    @classmethod
    def from_state(cls, st: dict[str, torch.Tensor], b: torch.Tensor | None = None) -> "Int4Linear":
        """Back from `state()` without packing again."""
        lin = cls.__new__(cls)
        lin.packed, lin.nibbles, lin.scale, lin.zero, lin.scale_zero = (
            st[k] for k in ("packed", "nibbles", "scale", "zero", "scale_zero"))
        lin.shape = (lin.nibbles.shape[0], lin.nibbles.shape[1] * 2)
        lin.b = b
        return lin

    @classmethod
    def from_float(cls, w: torch.Tensor, b: torch.Tensor | None = None) -> "Int4Linear":
        """Min/max per group of 32, as llama.cpp's Q4_1 quantizer does (quantize_q4_1)."""
        return cls.from_blocks(*quantize_q4_1(w), b)

    @classmethod
    def from_blocks(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, b: torch.Tensor | None = None) -> "Int4Linear":
        """From Q4_1 blocks: q (N, K) in 0..15, d and m (N, K / 32), w = q * d + m."""
        d32, m32 = d.float(), m.float()
        return cls(q, d32, m32 + 8 * d32, b)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(x.to(_COMPUTE), self.packed, GROUP, self.scale_zero)
        y = y.to(x.dtype)
        return y + self.b if self.b is not None else y

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scale_zero.numel() * 2

    def codes(self) -> torch.Tensor:
        """q (N, K) in 0..15."""
        n, k = self.shape
        return torch.stack([self.nibbles & 15, self.nibbles >> 4], -1).view(n, k)

    def dequantized(self) -> torch.Tensor:
        """The fp32 matrix the kernel computes with: (q - 8) * scale + zero, scale/zero as stored (bf16)."""
        n, k = self.shape
        q = self.codes().float().view(n, k // GROUP, GROUP)
        return ((q - 8) * self.scale.float()[..., None] + self.zero.float()[..., None]).view(n, k)


class RefinedHead:
    """The LM head for the quantized formats: every logit from the int8 kernel, then the top
    `refine` candidates of each row recomputed exactly in fp32 from the fp32 rows.

    The kernel's output is bf16, whose step at a typical top logit (~20) is 0.125, so near-ties
    between the best candidates flip; recomputing the few that can win keeps greedy choices those
    of the fp32 head (measured in scripts/bench_weights.py) for 16 fp32 rows per query instead of
    the whole 49152 x 576 matrix. The fp32 rows are the model's own (the GGUF keeps the head 8-bit,
    so these are its dequantized values) and double as the embedding table.

    Greedy steps (`greedy=True`: the caller picks the argmax of these logits and nothing else)
    score with a 4-bit copy of the head instead (Q4_1 groups of 32, half the int8 bytes, the
    kernel the linear layers use) and refine the top `greedy_refine` (64) exactly: the argmax is
    the fp32 head's whenever it ranks in the 4-bit top 64 (on 2,000 positions of code and prose it
    ranked in the top 16 every time). Logits outside the refined set are the 4-bit scores, so a
    sampled step (temperature > 0) never takes this path."""

    def __init__(self, w: torch.Tensor, refine: int = 16, greedy_refine: int = 64, packed=None):
        """packed: a backends/torch/packed.PackedWeights that keeps the quantized copies between loads."""
        self.w = w.float().contiguous()
        self.refine = refine
        # shapes the int4 kernel cannot pack (input not whole groups of 32, rows not a multiple of 16: tiny
        # test models) keep the int8 scoring for greedy steps too
        n, k = self.w.shape

        def made(name, kind, build):
            st = packed.lookup(name) if packed is not None else None
            if st is not None:
                return kind.from_state(st)
            lin = build()
            if packed is not None:
                packed.store(name, lin.state())
            return lin

        self.approx = made("head.int8", Int8Linear, lambda: Int8Linear.from_float(self.w))
        self.greedy_approx = (made("head.int4", Int4Linear, lambda: Int4Linear.from_float(self.w))
                              if k % GROUP == 0 and n % 16 == 0 else None)
        self.greedy_refine = greedy_refine
        # x -> the whole result of a path in one call of another kernel (native.py: csrc/row_step.cpp refined_head),
        # or None: greedy_kernel the greedy path's (greedy_approx's 4-bit scores, the top greedy_refine exact);
        # kernel the other one's (scores of ~8-bit weights, the head plus its 4-bit residual, the top `refine` exact)
        self.greedy_kernel: Any = None
        self.kernel: Any = None

    def __call__(self, x: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        approx: Any
        if greedy and self.greedy_kernel is not None:
            return self.greedy_kernel(x)
        if not greedy and self.kernel is not None:
            return self.kernel(x)
        if greedy and self.greedy_approx is not None:
            approx, r = self.greedy_approx, min(self.greedy_refine, self.w.shape[0])
        else:
            approx, r = self.approx, self.refine
        y = approx(x).float()
        idx = y.topk(r, dim=-1).indices  # (M, r)
        exact = torch.einsum("mh,mrh->mr", x.float(), self.w[idx])
        return y.scatter(-1, idx, exact)

    @property
    def nbytes(self) -> int:
        return self.approx.nbytes  # + refine rows per query, negligible

    def dequantized(self) -> torch.Tensor:
        return self.w


class DequantizedLinear:
    """A quantized format on a device without torch's CPU weight-only kernels (CUDA): the matrix
    the CPU kernel computes with (`dequantized()`), held dense in bf16 and run through the dense
    GEMM. Same weights up to bf16 rounding of the dequantized values; dense bf16 bytes, not packed."""

    def __init__(self, lin, device):
        self.w = lin.dequantized().to(device=device, dtype=_COMPUTE).contiguous()
        self.b = lin.b.to(device) if getattr(lin, "b", None) is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(_COMPUTE), self.w).to(x.dtype)
        return y + self.b if self.b is not None else y

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()

    def dequantized(self) -> torch.Tensor:
        return self.w.float()


# A layer's linear map in any of its forms (the head is a RefinedHead or a DenseLinear).
Linear = DenseLinear | Int8Linear | Int4Linear | DequantizedLinear


def make_linear(fmt: str, w: torch.Tensor, b: torch.Tensor | None = None) -> DenseLinear | Int8Linear | Int4Linear:
    if fmt == "fp32":
        return DenseLinear(w, b)
    if fmt == "int8":
        return Int8Linear.from_float(w, b)
    if fmt == "int4":
        return Int4Linear.from_float(w, b)
    raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
