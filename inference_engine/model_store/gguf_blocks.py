"""Q4_1 blocks of a GGUF's linear layers, in the HF model's names and row order.

A Q4_1 block covers 32 consecutive inputs of one output row: fp16 d, fp16 m, then 16 bytes
whose low nibbles are elements 0..15 and high nibbles elements 16..31; w = q * d + m.
llama.cpp's converter permutes the rows of Llama's q/k projections (rotary pairs interleaved);
HF keeps them split in halves, so those rows are un-permuted here (the same per-head reshuffle
transformers applies when it dequantizes a GGUF).
"""
from __future__ import annotations

import mmap
import pathlib
import struct

import numpy as np
import torch

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_BLOCK_BYTES = 20
_Q4_1 = 3  # ggml_type


def q4_1_blocks(gguf_path: str | pathlib.Path, *, num_heads: int, num_kv_heads: int) -> dict:
    """{HF weight name: (q (N, K) uint8, d (N, K/32) fp32, m (N, K/32) fp32)} for every Q4_1 tensor
    of a Llama-architecture GGUF."""
    out = {}
    for name, raw in _q4_1_tensors(gguf_path):
        parts = name.split(".")  # blk.{i}.{kind}.weight
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
            raise ValueError(f"unexpected Q4_1 tensor {name!r} in {gguf_path}")
        n = raw.shape[0]  # raw: (N, K/32 * 20) uint8
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


def _q4_1_tensors(gguf_path: str | pathlib.Path):
    """(name, raw (N, K/32 * 20) uint8) of every Q4_1 tensor, in file order. The tensor table is read from
    the header with the metadata skipped (_tensor_table): gguf.GGUFReader parses every metadata field first,
    the tokenizer's ~100k strings included (~3 s of a daemon's start); it still reads a file _tensor_table
    does not take."""
    table = _tensor_table(gguf_path)
    if table is None:
        from gguf import GGUFReader

        for t in GGUFReader(str(gguf_path)).tensors:
            if t.tensor_type.name == "Q4_1":
                yield t.name, np.asarray(t.data)
        return
    for name, dims, ggml_type, offset in table:
        if ggml_type != _Q4_1:
            continue
        k, n = dims[0], int(np.prod(dims[1:], dtype=np.int64))  # ne[0]: the row (input) length
        if k % 32:
            raise ValueError(f"Q4_1 tensor {name!r} in {gguf_path} has rows of {k} elements, not whole blocks of 32")
        row = k // 32 * _BLOCK_BYTES
        yield name, np.fromfile(str(gguf_path), dtype=np.uint8, count=n * row, offset=offset).reshape(n, row)


# GGUF metadata value types: fixed sizes (8 = string: u64 length + bytes; 9 = array: u32 type, u64 count, items)
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _tensor_table(gguf_path: str | pathlib.Path) -> list[tuple[str, tuple[int, ...], int, int]] | None:
    """[(name, dims (ne[0] first), ggml type, absolute byte offset of its data)] of a little-endian GGUF
    v2/v3 file, read from its header; the metadata is skipped over, not parsed (general.alignment is read).
    None for anything else (GGUFReader then reads it)."""
    with open(gguf_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if len(mm) < 24 or mm[:4] != b"GGUF":
            return None
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
        if version not in (2, 3):
            return None
        pos, alignment = 24, 32
        u32, u64 = struct.Struct("<I"), struct.Struct("<Q")

        def string(at: int) -> tuple[bytes, int]:
            (n,) = u64.unpack_from(mm, at)
            return mm[at + 8 : at + 8 + n], at + 8 + n

        def skip(vtype: int, at: int) -> int:
            if vtype in _GGUF_SIZES:
                return at + _GGUF_SIZES[vtype]
            if vtype == 8:
                return at + 8 + u64.unpack_from(mm, at)[0]
            if vtype == 9:
                (etype,), (count,) = u32.unpack_from(mm, at), u64.unpack_from(mm, at + 4)
                at += 12
                if etype in _GGUF_SIZES:
                    return at + count * _GGUF_SIZES[etype]
                for _ in range(count):
                    at = skip(etype, at)
                return at
            raise ValueError(f"unknown GGUF metadata value type {vtype} in {gguf_path}")

        for _ in range(n_kv):
            key, pos = string(pos)
            (vtype,) = u32.unpack_from(mm, pos)
            pos += 4
            if key == b"general.alignment" and vtype == 4:
                (alignment,) = u32.unpack_from(mm, pos)
            pos = skip(vtype, pos)
        infos = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = u32.unpack_from(mm, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", mm, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", mm, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name.decode(), dims, ggml_type, offset))
        start = pos + (-pos % alignment)  # the data section begins at the next multiple of the alignment
        return [(name, dims, t, start + offset) for name, dims, t, offset in infos]


def _unpermute_rows(n: int, heads: int) -> np.ndarray:
    """Row order taking llama.cpp's interleaved rotary rows back to HF's halves, per head."""
    hd = n // heads
    return np.arange(n).reshape(heads, hd // 2, 2).transpose(0, 2, 1).reshape(n)
