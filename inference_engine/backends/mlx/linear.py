"""Weight formats of the MLX backend's linear layers: dense fp32 / fp16 and 4-bit affine.

Each format is a callable `y = lin(x)` on (M, K) activations -> (M, N), with `nbytes` and
`dequantized()` (the fp32 matrix it computes with, for checks), as backends/torch/linear.py.

  int4: `mx.quantize`'s affine layout, groups of 32 along the input: w = q * scale + bias,
        q in 0..15 packed eight to a uint32 (element j of a word in bits 4j..4j+3). That is
        GGUF Q4_1 (w = q * d + m per 32-block), so the GGUF's blocks are used as they are:
        scale = d, bias = m (fp16 values, kept in fp32), and the weights the kernel computes
        with are the pulled fp32 weights up to fp32 rounding of q * d + m.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

GROUP = 32  # = GGUF Q4_1 block
BITS = 4


class DenseLinear:
    """y = x @ w.T (+ b) in the weight's dtype."""

    def __init__(self, w: mx.array, b: mx.array | None = None):
        self.w, self.b = w, b

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ self.w.T
        return y + self.b if self.b is not None else y

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    def dequantized(self) -> mx.array:
        return self.w.astype(mx.float32)


class Int4Linear:
    """4-bit affine, groups of 32: `mx.quantized_matmul` over packed codes, scales and biases."""

    def __init__(self, packed: mx.array, scales: mx.array, biases: mx.array, b: mx.array | None = None):
        self.packed, self.scales, self.biases, self.b = packed, scales, biases, b  # (N, K/8) uint32, (N, K/32) x2

    @classmethod
    def from_float(cls, w: mx.array, b: mx.array | None = None) -> "Int4Linear":
        """mx.quantize of fp32 weights (used when the model directory keeps no GGUF)."""
        return cls(*mx.quantize(w.astype(mx.float32), group_size=GROUP, bits=BITS), b)

    @classmethod
    def from_blocks(cls, q: np.ndarray, d: np.ndarray, m: np.ndarray, b: mx.array | None = None) -> "Int4Linear":
        """From Q4_1 blocks: q (N, K) in 0..15, d and m (N, K / 32), w = q * d + m."""
        n, k = q.shape
        if k % GROUP:
            raise ValueError(f"int4 needs the input dimension to be a multiple of {GROUP}, got {k}")
        words = q.astype(np.uint32).reshape(n, k // 8, 8) << (BITS * np.arange(8, dtype=np.uint32))
        packed = np.bitwise_or.reduce(words, axis=-1)
        return cls(mx.array(packed), mx.array(d.astype(np.float32)), mx.array(m.astype(np.float32)), b)

    @classmethod
    def stacked(cls, parts: list) -> "Int4Linear":
        """One fused layer from several (rows stacked; groups run along the input, so rows are independent)."""
        bs = [p.b for p in parts]
        b = mx.concatenate(bs) if all(x is not None for x in bs) else None
        return cls(*(mx.concatenate([getattr(p, a) for p in parts]) for a in ("packed", "scales", "biases")), b)

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.quantized_matmul(x, self.packed, self.scales, self.biases, transpose=True, group_size=GROUP, bits=BITS)
        return y + self.b if self.b is not None else y

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes + self.biases.nbytes

    def dequantized(self) -> mx.array:
        return mx.dequantize(self.packed, self.scales, self.biases, group_size=GROUP, bits=BITS).astype(mx.float32)
