"""Weight formats of the MLX backend's linear layers: dense fp32 / fp16 and 4-bit affine.

Each format is a callable `y = lin(x)` on (M, K) activations -> (M, N), with `nbytes` and
`dequantized()` (the fp32 matrix it computes with, for checks), as backends/torch/linear.py.

  int4: `mx.quantize`'s affine layout, groups of 32 along the input: w = q * scale + bias,
        q in 0..15 packed eight to a uint32 (element j of a word in bits 4j..4j+3). That is
        GGUF Q4_1 (w = q * d + m per 32-block), so the GGUF's blocks are used as they are.
        It computes the same function as the torch backend's int4 (backends/torch/linear.py),
        so that the two backends agree on the same weight format: torch's CPU int4 kernel
        (`_weight_int4pack_mm_for_cpu`) keeps scale and zero (= m + 8 d) in bfloat16, takes
        bfloat16 activations and returns bfloat16; here scale = bf16(d), bias = bf16(m + 8 d)
        - 8 scale (exact in fp32), activations and outputs are rounded to bf16 around an fp32
        `mx.quantized_matmul`. The dequantized matrix equals torch's bit for bit, and so do the
        outputs (measured on SmolLM2's linears and random inputs, tests/backends/test_mlx_backend.py).
        Weights without a GGUF are quantized by the same min/max Q4_1 quantizer as torch's
        (linear.quantize_q4_1), not by mx.quantize, so both backends hold the same codes.
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
    """4-bit affine, groups of 32: `mx.quantized_matmul` over packed codes, scales and biases, with
    torch int4's bf16 numerics (module docstring)."""

    def __init__(self, packed: mx.array, scales: mx.array, biases: mx.array, b: mx.array | None = None):
        self.packed, self.scales, self.biases, self.b = packed, scales, biases, b  # (N, K/8) uint32, (N, K/32) x2

    @classmethod
    def from_float(cls, w: mx.array, b: mx.array | None = None) -> "Int4Linear":
        """Q4_1 min/max quantization of fp32 weights (used when the model directory keeps no GGUF): the
        quantizer of the torch backend, so both backends compute with the same codes and scales."""
        import torch

        from inference_engine.backends.torch.linear import quantize_q4_1

        q, d, m = quantize_q4_1(torch.from_numpy(np.array(w.astype(mx.float32))))
        return cls.from_blocks(q.numpy(), d.numpy(), m.numpy(), b)

    @classmethod
    def from_blocks(cls, q: np.ndarray, d: np.ndarray, m: np.ndarray, b: mx.array | None = None) -> "Int4Linear":
        """From Q4_1 blocks: q (N, K) in 0..15, d and m (N, K / 32), w = q * d + m; scale and zero
        rounded to bf16 as torch's Int4Linear.from_blocks stores them."""
        n, k = q.shape
        if k % GROUP:
            raise ValueError(f"int4 needs the input dimension to be a multiple of {GROUP}, got {k}")
        words = q.astype(np.uint32).reshape(n, k // 8, 8) << (BITS * np.arange(8, dtype=np.uint32))
        packed = np.bitwise_or.reduce(words, axis=-1)
        d32, m32 = d.astype(np.float32), m.astype(np.float32)
        scale = _bf16(mx.array(d32))
        zero = _bf16(mx.array(m32 + 8 * d32))  # torch: (q - 8) * scale + zero
        return cls(mx.array(packed), scale, zero - 8 * scale, b)

    @classmethod
    def stacked(cls, parts: list) -> "Int4Linear":
        """One fused layer from several (rows stacked; groups run along the input, so rows are independent)."""
        bs = [p.b for p in parts]
        b = mx.concatenate(bs) if all(x is not None for x in bs) else None
        packed, scales, biases = (mx.concatenate([getattr(p, a) for p in parts]) for a in ("packed", "scales", "biases"))
        return cls(packed, scales, biases, b)

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.quantized_matmul(_bf16(x), self.packed, self.scales, self.biases, transpose=True, group_size=GROUP, bits=BITS)
        y = _bf16(y).astype(x.dtype)
        return y + self.b if self.b is not None else y

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes + self.biases.nbytes

    def dequantized(self) -> mx.array:
        return mx.dequantize(self.packed, self.scales, self.biases, group_size=GROUP, bits=BITS).astype(mx.float32)


def _bf16(x: mx.array) -> mx.array:
    """x rounded to bfloat16 (nearest even), kept in float32."""
    return x.astype(mx.bfloat16).astype(mx.float32)
