"""Q4_1 blocks of a GGUF's linear layers, in the HF model's names and row order.

A Q4_1 block covers 32 consecutive inputs of one output row: fp16 d, fp16 m, then 16 bytes
whose low nibbles are elements 0..15 and high nibbles elements 16..31; w = q * d + m.
llama.cpp's converter permutes the rows of Llama's q/k projections (rotary pairs interleaved);
HF keeps them split in halves, so those rows are un-permuted here (the same per-head reshuffle
transformers applies when it dequantizes a GGUF).
"""
from __future__ import annotations

import pathlib

import numpy as np
import torch

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_BLOCK_BYTES = 20


def q4_1_blocks(gguf_path: str | pathlib.Path, *, num_heads: int, num_kv_heads: int) -> dict:
    """{HF weight name: (q (N, K) uint8, d (N, K/32) fp32, m (N, K/32) fp32)} for every Q4_1 tensor
    of a Llama-architecture GGUF."""
    from gguf import GGUFReader

    out = {}
    for t in GGUFReader(str(gguf_path)).tensors:
        if t.tensor_type.name != "Q4_1":
            continue
        parts = t.name.split(".")  # blk.{i}.{kind}.weight
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
            raise ValueError(f"unexpected Q4_1 tensor {t.name!r} in {gguf_path}")
        raw = np.asarray(t.data)  # (N, K/32 * 20) uint8
        n = raw.shape[0]
        blocks = raw.reshape(n, -1, _BLOCK_BYTES)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, -1)  # (N, K)
        kind = parts[2]
        if kind in ("attn_q", "attn_k"):
            perm = _unpermute_rows(n, num_heads if kind == "attn_q" else num_kv_heads)
            q, d, m = q[perm], d[perm], m[perm]
        name = f"model.layers.{parts[1]}.{_LAYER_NAMES[kind]}.weight"
        out[name] = (torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(np.ascontiguousarray(d)),
                     torch.from_numpy(np.ascontiguousarray(m)))
    return out


def _unpermute_rows(n: int, heads: int) -> np.ndarray:
    """Row order taking llama.cpp's interleaved rotary rows back to HF's halves, per head."""
    hd = n // heads
    return np.arange(n).reshape(heads, hd // 2, 2).transpose(0, 2, 1).reshape(n)
