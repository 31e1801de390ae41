"""Append-only row tables behind the paged strategy: the page store and the compact keys.

A `RowTable` keeps, per layer, rows appended in position order (row r = position first + r)
through a row codec, in slabs (S, Hkv, capacity, *trailing) with S = 2 (K and V) or 1 (keys
only). Capacity grows in whole pages, so `nbytes` is the bytes of the pages held, and a table
rebuilt from its `state()` has the same capacity and bytes.

Row codecs (encode (N, D) float -> named per-row payload, decode -> float32 (N, D)):
  IdentityRows     the rows themselves, in the model dtype (exact)
  RowQuant(8 | 4)  symmetric per-row int8 / packed int4 codes + one float16 scale per row
  KakeyaLatticeCodec (compressors.py) for kakeya_d4 / kakeya_e8
Every codec codes each row on its own, so a row's code does not depend on which rows shared
its call: a key quantized in the page store equals the same key quantized on the fly.
"""
from __future__ import annotations

import torch

from inference_engine.kv.compressors import make_codec


class IdentityRows:
    """Rows kept as they are, in `dtype`."""

    def __init__(self, head_dim: int, dtype):
        self.head_dim, self.dtype = head_dim, dtype

    def payload_layout(self) -> dict:
        return {"rows": ((self.head_dim,), self.dtype)}

    @property
    def bytes_per_row(self) -> int:
        return self.head_dim * torch.empty(0, dtype=self.dtype).element_size()

    def encode(self, rows: torch.Tensor) -> dict:
        return {"rows": rows.to(self.dtype)}

    def decode(self, payload: dict) -> torch.Tensor:
        return payload["rows"]


class RowQuant:
    """Symmetric per-row quantization: int8 codes (bits 8) or two int4 codes a byte (bits 4), and
    the row's scale (max |x| / qmax) in float16."""

    def __init__(self, bits: int, head_dim: int):
        if bits not in (4, 8):
            raise ValueError(f"RowQuant supports 4 or 8 bits, got {bits!r}")
        if bits == 4 and head_dim % 2:
            raise ValueError(f"4-bit row codes pack two elements a byte; head_dim {head_dim} is odd")
        self.bits, self.head_dim = bits, head_dim
        self.qmax = 127 if bits == 8 else 7

    def payload_layout(self) -> dict:
        if self.bits == 8:
            return {"codes": ((self.head_dim,), torch.int8), "scale": ((1,), torch.float16)}
        return {"codes": ((self.head_dim // 2,), torch.uint8), "scale": ((1,), torch.float16)}

    @property
    def bytes_per_row(self) -> int:
        return (self.head_dim if self.bits == 8 else self.head_dim // 2) + 2

    def encode(self, rows: torch.Tensor) -> dict:
        rows = rows.float()
        tiny = torch.finfo(torch.float16).tiny
        scale = (rows.abs().amax(-1, keepdim=True) / self.qmax).clamp(min=tiny).to(torch.float16)  # (N, 1)
        q = torch.round(rows / scale.float()).clamp(-self.qmax, self.qmax)
        if self.bits == 8:
            return {"codes": q.to(torch.int8), "scale": scale}
        u = (q + 8).to(torch.uint8).view(rows.shape[0], -1, 2)  # 1 .. 15
        return {"codes": u[..., 0] | (u[..., 1] << 4), "scale": scale}

    def group_max_scores(self, q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """max over g of q[b, g, m] . decode(row c), (B, M, C), for q (B, G, M, D) float and coded rows
        (B, C, ...): one matmul over the integer codes (4-bit: q's even dims against the low nibbles,
        odd dims against the high ones), the max over the group, then the row scale (> 0, so it
        commutes with the max). Nothing decoded, and only one (B, G*M, C) pass besides the matmul."""
        b, g, m, d = q.shape
        if self.bits == 8:
            ints, qq = codes.float(), q
        else:
            ints = torch.cat([codes & 15, codes >> 4], -1).float() - 8  # (B, C, D): even dims, then odd dims
            qq = torch.cat([q[..., 0::2], q[..., 1::2]], -1)
        raw = (qq.reshape(b, g * m, d) @ ints.transpose(1, 2)).view(b, g, m, -1).amax(1)  # (B, M, C)
        return raw * scale.float().squeeze(-1)[:, None, :]

    def decode(self, payload: dict) -> torch.Tensor:
        codes, scale = payload["codes"], payload["scale"].float()
        if self.bits == 8:
            return codes.float() * scale
        lo = (codes & 15).to(torch.int8) - 8
        hi = (codes >> 4).to(torch.int8) - 8
        return torch.stack([lo, hi], -1).reshape(codes.shape[0], self.head_dim).float() * scale


def make_row_codec(name: str, *, head_dim: int, dtype, q_range: int = 38, device="cpu"):
    """identity (exact, model dtype), int8, int4, or a KakeyaLattice codec (kakeya_d4 / kakeya_e8)."""
    if name == "identity":
        return IdentityRows(head_dim, dtype)
    if name in ("int8", "int4"):
        return RowQuant(int(name[3:]), head_dim)
    return make_codec(name, q_range, head_dim=head_dim, device=device)


class RowTable:
    """Per layer, rows (S, Hkv, n, D) appended in order and read back by row index."""

    def __init__(self, codec, *, num_layers: int, num_kv_heads: int, head_dim: int, stack: int, page: int, device):
        self.codec, self.stack, self.page = codec, stack, page
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.device = torch.device(device)
        self.layout = codec.payload_layout()
        self.rows = 0  # rows every layer holds (between appends)
        self.capacity = 0
        self.slabs = [self._zeros(0) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for slabs in self.slabs for t in slabs.values())

    def reserve(self, rows: int) -> None:
        """Room for `rows` rows, rounded up to whole pages."""
        if rows <= self.capacity:
            return
        cap = -(-rows // self.page) * self.page

        def grown(x):
            return torch.cat([x, x.new_zeros(*x.shape[:2], cap - x.shape[2], *x.shape[3:])], 2)

        self.slabs = [{name: grown(x) for name, x in slabs.items()} for slabs in self.slabs]
        self.capacity = cap

    def write(self, layer: int, start: int, rows: torch.Tensor) -> None:
        """Encode rows (S, Hkv, n, D) into rows start .. start + n - 1 of `layer` (after `reserve`)."""
        s, h, n, d = rows.shape
        payload = self.codec.encode(rows.reshape(-1, d))
        for name, slab in self.slabs[layer].items():
            slab[:, :, start:start + n] = payload[name].reshape(s, h, n, *slab.shape[3:]).to(slab.device)

    def read(self, layer: int, idx: torch.Tensor | None = None) -> torch.Tensor:
        """Decoded rows (S, Hkv, len(idx), D) float32 (identity: the stored dtype); idx None = all rows."""
        slabs = self.slabs[layer]
        if idx is None:
            part = {name: x[:, :, : self.rows] for name, x in slabs.items()}
        else:
            part = {name: x.index_select(2, idx) for name, x in slabs.items()}
        n = next(iter(part.values())).shape[2]
        flat = {name: x.reshape(-1, *x.shape[3:]) for name, x in part.items()}
        return self.codec.decode(flat).reshape(self.stack, self.num_kv_heads, n, self.head_dim)

    def payload(self, layer: int) -> dict:
        """The stored payload of every row of `layer`, per name (S, Hkv, rows, *trailing) views."""
        return {name: x[:, :, : self.rows] for name, x in self.slabs[layer].items()}

    def gather(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Decoded rows (S, Hkv, E, D): rows[h] (E,) of KV head h, for every head h (a per-head choice)."""
        flat_rows = (rows + torch.arange(self.num_kv_heads, device=rows.device)[:, None] * self.capacity).flatten()
        n = rows.shape[1]
        flat = {name: x.flatten(1, 2).index_select(1, flat_rows).flatten(0, 1)  # (S * Hkv * E, ...)
                for name, x in self.slabs[layer].items()}
        return self.codec.decode(flat).reshape(self.stack, self.num_kv_heads, n, self.head_dim)

    def state(self, start: int = 0) -> dict:
        """The used rows' payload per name, (L, S, Hkv, rows - start, *trailing) on the CPU: rows
        `start` .. rows - 1 (a saver that holds the earlier ones asks for the new rows only)."""
        return {name: torch.stack([s[name][:, :, start: self.rows] for s in self.slabs]).cpu() for name in self.layout}

    def load_state(self, tensors: dict, rows: int) -> None:
        want = {name: (len(self.slabs), self.stack, self.num_kv_heads, rows, *shape) for name, (shape, _) in self.layout.items()}
        got = {name: tuple(t.shape) for name, t in tensors.items()}
        if got != want:
            raise ValueError(f"stored rows {got} do not fit this {type(self.codec).__name__} table, which holds {want}")
        self.slabs = [self._zeros(0) for _ in self.slabs]
        self.capacity = 0
        self.reserve(rows)
        for i, slabs in enumerate(self.slabs):
            for name, slab in slabs.items():
                slab[:, :, :rows] = tensors[name][i].to(slab.device, slab.dtype)
        self.rows = rows

    def _zeros(self, capacity: int) -> dict:
        return {name: torch.zeros(self.stack, self.num_kv_heads, capacity, *shape, dtype=dtype, device=self.device)
                for name, (shape, dtype) in self.layout.items()}
