"""Append-only row tables behind the paged strategy: the page store and the compact keys.

A `RowTable` keeps, per layer, rows appended in position order (row r = position first + r)
through a row codec, in slabs (S, Hkv, capacity, *trailing) with S = 2 (K and V) or 1 (keys
only). Capacity grows by at least a quarter at a time, in whole pages (a spilling table's ring is sized for its RAM
budget at once). On the CPU a table's memory is taken as rows are written (`lazy_zeros`), so `nbytes`, the bytes
held, is the written rows' pages, whatever the capacity; a table rebuilt from its `state()` holds its rows' pages
exactly.

Row codecs (encode (N, D) float -> named per-row payload, decode -> float32 (N, D)):
  IdentityRows     the rows themselves, in the model dtype (exact)
  RowQuant(8 | 4)  symmetric per-row int8 / packed int4 codes + one float16 scale per row
  KakeyaLatticeCodec (compressors.py) for kakeya_d4 / kakeya_e8
Every codec codes each row on its own, so a row's code does not depend on which rows shared
its call: a key quantized in the page store equals the same key quantized on the fly.
"""
from __future__ import annotations

import itertools
import logging
import mmap
import os
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch

from inference_engine.kv.compressors import KVCodec, make_codec

log = logging.getLogger("kakeya")

CodecT = TypeVar("CodecT", bound=KVCodec)  # a RowTable's row codec


class IdentityRows:
    """Rows kept as they are, in `dtype`."""

    def __init__(self, head_dim: int, dtype: torch.dtype):
        self.head_dim, self.dtype = head_dim, dtype

    def payload_layout(self) -> dict:
        return {"rows": ((self.head_dim,), self.dtype)}

    @property
    def bytes_per_row(self) -> int:
        return self.head_dim * torch.empty(0, dtype=self.dtype).element_size()

    def encode(self, rows: torch.Tensor) -> dict:
        return {"rows": rows.to(self.dtype)}

    def in_place(self, rows: torch.Tensor) -> bool:
        """`encode_into` takes these rows (any)."""
        return True

    def encode_into(self, rows: torch.Tensor, views: dict) -> None:
        """encode(rows) written into `views` (a table's rows, rows' shape)."""
        views["rows"].copy_(rows)

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

    def in_place(self, rows: torch.Tensor) -> bool:
        """`encode_into` takes these rows: 8-bit codes, a backend's kernel (`set_row_quant_kernel`), CPU fp32 / fp16
        rows (A, B, C, n, D) with the last dimension contiguous."""
        return (_quant8_kernel is not None and self.bits == 8 and rows.dim() == 5 and rows.stride(-1) == 1
                and rows.device.type == "cpu" and rows.dtype in (torch.float32, torch.float16))

    def encode_into(self, rows: torch.Tensor, views: dict) -> None:
        """encode(rows) written into `views` (a table's codes and scale, rows' leading shape) by the backend's kernel,
        the same bits (after `in_place`)."""
        assert _quant8_kernel is not None
        _quant8_kernel(rows, views["codes"], views["scale"])

    def group_max_scores(self, q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                         path: str | None = None) -> torch.Tensor:
        """max over g of q[b, g, m] . decode(row c), (B, M, C), for q (B, G, M, D) float and coded rows
        (B, C, ...): a matmul over the integer codes, the max over the group, then the row scale
        (> 0, so it commutes with the max). Nothing decoded is kept. 4-bit codes are unpacked into
        two int8 halves, the low nibbles (even dimensions) and the high ones (odd dimensions), each
        multiplied with q's matching dimensions (no interleaving copy).

        With `query_int8()` (the default) the query is first quantized to int8 per (b, m) over its group
        (`quantize_query`: scale s = max |q| / 127): every dot is then an exact integer, so every path
        below gives the same bits, and the score is float(max_g a[b, g, m] . code) * s * scale. Its
        rounding (2^-8 of the group's largest element) is far below the 4-bit codes' own, and it lets the
        native kernels score with integer multiply-adds (~2x the fp32 kernel's keys a second on an AVX2
        EPYC). query_int8(False): the fp32 query, as before (the paths then differ by float rounding).

        Steps of few queries (decode, speculative verify: up to `_INT_QUERIES` queries) take the path
        that measures fastest on this CPU (`scoring_path`): "int", exact int8 x int8 -> int32 matmuls
        (torch._int_mm) of the int8 query (with an fp32 query: three int8 limbs per (b, m), `query_limbs`,
        combined in float32); "native": the backend's one-pass kernel (`set_score_kernel`: the native CPU
        step's group_max_scores, each key decoded once and dotted with the query rows); "float": the
        batched float matmuls longer steps (prefill chunks) always take. path: force one (tests,
        research); None: the measured choice."""
        b, g, m, d = q.shape
        if path is None:
            path = scoring_path() if m <= _INT_QUERIES and q.device.type == "cpu" else "float"
        if path == "native":
            if _score_kernel is None:
                raise ValueError("no native scoring kernel here (set_score_kernel)")
            return _score_kernel(q.float().contiguous(), codes, scale.to(torch.float16))
        if self.bits == 8:
            halves = [(codes, slice(None))]  # (B, C, D) int8
        else:  # low nibble = even dimension, high nibble = odd dimension
            halves = [((codes & 15).view(torch.int8).sub_(8), slice(0, None, 2)),
                      ((codes >> 4).view(torch.int8).sub_(8), slice(1, None, 2))]  # (B, C, D / 2) each
        c = codes.shape[1]
        s: torch.Tensor | None = None
        if _query_int8:
            q, s = quantize_query(q.float())  # integers in float32; (B, M, 1)
        if path != "int":  # torch._int_mm off the CPU wants > 16 rows, multiples of 8
            qq = q.reshape(b, g * m, d)
            (ints, dims), *rest = halves
            raw = torch.bmm(qq[..., dims], ints.float().transpose(1, 2))
            for ints, dims in rest:  # accumulated inside the matmul: no pass over the (B, G * M, C) scores
                raw.baddbmm_(qq[..., dims], ints.float().transpose(1, 2))
            raw = raw.view(b, g, m, c).amax(1)
            if s is not None:
                raw.mul_(s)
            return raw.mul_(scale.transpose(1, 2))  # float * float16 scales: float
        if s is not None:  # one int8 limb: the query is its integers
            limbs, n_limbs = q.reshape(b, g * m, d).to(torch.int8), 1
        else:
            limbs, s = query_limbs(q)  # (B, 3 * G * M, D) int8, (B, M, 1) float
            n_limbs = 3
        parts = [limbs[..., dims].contiguous() for _, dims in halves]
        ii = torch.empty(b, n_limbs * g * m, c, dtype=torch.int32, device=q.device)
        for h in range(b):
            torch._int_mm(parts[0][h], halves[0][0][h].t(), out=ii[h])
            if len(halves) == 2:
                ii[h].add_(torch._int_mm(parts[1][h], halves[1][0][h].t()))
        if n_limbs == 1:
            raw = ii.view(b, g, m, c).amax(1).float()  # the integer max, then float (exact below 2^24)
        else:
            iif = ii.view(b, 3, g, m, c).float()
            raw = iif[:, 0].add_(iif[:, 1], alpha=1 / 254).add_(iif[:, 2], alpha=1 / 254 ** 2).amax(1)  # (B, M, C)
        return raw.mul_(s).mul_(scale.transpose(1, 2))

    def decode(self, payload: dict) -> torch.Tensor:
        codes, scale = payload["codes"], payload["scale"].float()
        if self.bits == 8:
            return codes.float() * scale
        lo = (codes & 15).to(torch.int8) - 8
        hi = (codes >> 4).to(torch.int8) - 8
        return torch.stack([lo, hi], -1).reshape(codes.shape[0], self.head_dim).float() * scale


_INT_QUERIES = 16  # RowQuant.group_max_scores: steps of up to this many queries may score in integers
_scoring: str | None = None
_score_kernel: Callable | None = None
_query_int8 = os.environ.get("KAKEYA_PAGE_QUERY", "int8") != "fp32"
_query_toggle: Callable[[int], object] | None = None


_quant8_kernel: Callable | None = None


def set_row_quant_kernel(kernel: Callable | None) -> None:
    """A backend's in-place RowQuant(8) encode, kernel(x (A, B, C, n, D), codes, scale) writing into views of a table
    (backends/torch/native.py: the native CPU step's row_quant8_into), the same bits as `RowQuant.encode`: a decode
    step's evicted row is archived with it in one call, not ~10 torch calls."""
    global _quant8_kernel
    _quant8_kernel = kernel


def set_score_kernel(kernel: Callable | None, query_toggle: Callable[[int], object] | None = None) -> None:
    """A backend's one-pass scoring kernel (q, codes, fp16 scale) -> (B, M, C), as group_max_scores computes
    (backends/torch/native.py: the native CPU step's group_max_scores), and the switch (1 / 0) by which its
    kernels follow `query_int8`; the scoring path is measured again."""
    global _score_kernel, _scoring, _query_toggle
    _score_kernel, _scoring, _query_toggle = kernel, None, query_toggle
    if query_toggle is not None:
        query_toggle(int(_query_int8))


def query_int8(on: bool | None = None) -> bool:
    """Whether compact keys are scored against the query quantized to int8 (the default; RowQuant.group_max_scores),
    on every path of this process, the backend's native kernels included; `on` sets it (research scripts compare the
    two; KAKEYA_PAGE_QUERY=fp32 starts with the fp32 query). Returns the value before."""
    global _query_int8
    was = _query_int8
    if on is not None:
        _query_int8 = bool(on)
        if _query_toggle is not None:
            _query_toggle(int(_query_int8))
    return was


def quantize_query(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, G, M, D) float32 -> (a, s): a (B, G, M, D) float32 holding integers in [-127, 127], round-half-even
    of q / s, and s (B, M, 1) float32 = max |q| over the group's G rows and D / 127 (at least 1e-30), as the
    native kernels quantize it (csrc/row_step.cpp quantize_query): the same bits."""
    b, g, m, d = q.shape
    s = q.abs().amax((1, 3), keepdim=True).div_(127).clamp_(min=1e-30)  # (B, 1, M, 1)
    return torch.round(q / s).clamp_(-127, 127), s.view(b, m, 1)


def scoring_path() -> str:
    """How few-query steps score compact keys on this CPU: "int", "float" or "native" (when a backend gave a
    kernel), measured once (until a kernel comes or goes) on a decode step's shape (3 KV heads x 3 query heads,
    4,096 int4 keys of 64 dimensions), the fastest kept; KAKEYA_PAGE_SCORING=int / float / native decides instead.
    Logged."""
    global _scoring
    if _scoring is None:
        forced = os.environ.get("KAKEYA_PAGE_SCORING", "")
        if forced in ("int", "float") or (forced == "native" and _score_kernel is not None):
            _scoring = forced
        else:
            codec, g = RowQuant(4, 64), torch.Generator().manual_seed(0)
            codes = torch.randint(0, 256, (3, 4096, 32), dtype=torch.uint8, generator=g)
            scale = torch.full((3, 4096, 1), 0.01, dtype=torch.float16)
            q = torch.randn(3, 3, 1, 64, generator=g)
            paths = ["int", "float"] + (["native"] if _score_kernel is not None else [])
            best: dict[str, float] = {}
            for i, path in enumerate(paths * 3):  # interleaved; the first round warms up
                t0 = time.perf_counter()
                for _ in range(3):
                    codec.group_max_scores(q, codes, scale, path=path)
                if i >= len(paths):
                    best[path] = min(best.get(path, float("inf")), (time.perf_counter() - t0) / 3)
            _scoring = min(best, key=lambda p: best[p])
            log.info("paged: compact keys of decode steps scored by the %s path (measured, ms: %s)", _scoring,
                     ", ".join(f"{p} {t * 1e3:.2f}" for p, t in best.items()))
    return _scoring


def query_limbs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, G, M, D) float -> (B, 3 * G * M, D) int8 limbs a0, a1, a2 (limb-major) and s (B, M, 1)
    float32 with q = s * (a0 + a1 / 254 + a2 / 254^2) to within s * 254^-2 / 2 (s = max |q| over
    the group's heads and D / 127, so 2^-23 of that max; computed in float64)."""
    b, g, m, d = q.shape
    x = q.double()
    s = x.abs().amax((1, 3), keepdim=True).clamp_(min=1e-30).div_(127)  # (B, 1, M, 1)
    x = x / s
    a0 = torch.round(x)
    r = x.sub_(a0).mul_(254)
    a1 = torch.round(r)
    a2 = r.sub_(a1).mul_(254).round_()
    return torch.stack([a0, a1, a2], 1).to(torch.int8).view(b, 3 * g * m, d), s.view(b, m, 1).float()


def make_row_codec(name: str, *, head_dim: int, dtype: torch.dtype, q_range: int = 38,
                   device: str | torch.device = "cpu") -> KVCodec:
    """identity (exact, model dtype), int8, int4, or a KakeyaLattice codec (kakeya_d4 / kakeya_e8)."""
    if name == "identity":
        return IdentityRows(head_dim, dtype)
    if name in ("int8", "int4"):
        return RowQuant(int(name[3:]), head_dim)
    return make_codec(name, q_range, head_dim=head_dim, device=device)


def lazy_zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros of `shape`; on the CPU in a private anonymous map, whose pages the kernel gives (zeroed) as they are
    first written: a table sized for many rows holds in RAM only the pages of the rows written so far (reads of
    untouched pages see the shared zero page and take nothing). Transparent huge pages are refused for the map, so
    what is held follows the rows in 4 KiB pages on any THP setting. Elsewhere torch.zeros."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        m.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(m, dtype=dtype).view(shape)  # the tensor keeps the map alive; unmapped with it


class RowTable(Generic[CodecT]):
    """Per layer, rows (S, Hkv, n, D) appended in order and read back by row index. Each payload
    name is one tensor (L, S, Hkv, capacity, *trailing) over the layers (`slabs[layer]` are its
    per-layer views), so an append writes every layer in one copy (`write_all`)."""

    def __init__(self, codec: CodecT, *, num_layers: int, num_kv_heads: int, head_dim: int, stack: int, page: int,
                 device: str | torch.device, grow: float = 0.25):
        self.codec, self.stack, self.page, self.grow = codec, stack, page, grow
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.device = torch.device(device)
        self.layout = codec.payload_layout()
        self.rows = 0  # rows every layer holds (between appends)
        self.written = 0  # slots written so far (an append's pages are written before `rows` counts them)
        self.capacity = 0
        self._set(self._zeros(0))

    def _set(self, data: dict) -> None:
        self.data = data
        self.slabs = [{name: x[i] for name, x in data.items()} for i in range(self.num_layers)]

    @property
    def nbytes(self) -> int:
        """Bytes held: on the CPU the written rows' pages (`lazy_zeros`: capacity past them takes no memory; the
        kernel's 4 KiB pages add at most one page per (layer, stack entry, KV head) row band); elsewhere the
        capacity's."""
        per_row = sum(t.numel() * t.element_size() for t in self.data.values()) // max(self.capacity, 1)
        return per_row * self._held_rows()

    def _held_rows(self) -> int:
        if self.device.type != "cpu":
            return self.capacity
        return min(self.capacity, -(-self.rows // self.page) * self.page)

    def reserve(self, rows: int, most: int | None = None) -> None:
        """Room for `rows` rows: the capacity grows by at least `grow` (a quarter), in whole pages, to at most `most`
        rows (whole pages, >= rows) where given. Growing copies the table (its rows axis is not the outermost), so a
        page at a time would copy the whole history every page a session decodes (0.8 s per 64 tokens at 32k for
        SmolLM2's fp32 page store): O(n^2) over a session. A growth holds the old and the new payload of one name at
        a time (the old rows copied into the new zeros, which take memory only for them; the per-layer views
        dropped first so the old is freed)."""
        if rows <= self.capacity:
            return
        want = max(rows, self.capacity + int(self.capacity * self.grow))
        cap = -(-want // self.page) * self.page
        if most is not None:
            cap = max(min(cap, most), rows)
        data, self.slabs = self.data, []
        for name in list(data):
            x = data[name]
            y = lazy_zeros((*x.shape[:3], cap, *x.shape[4:]), x.dtype, x.device)
            held = min(max(self.rows, self.written), x.shape[3])  # what was written; the rest is zeros, untouched
            y[:, :, :, :held] = x[:, :, :, :held]
            data[name] = y
            del x
        self._set(data)
        self.capacity = cap

    @property
    def row_stride(self) -> int:
        """Row r of KV head h is flat row h * row_stride + r (`gather_flat`); fixed between appends."""
        return self.capacity

    @property
    def cold_nbytes(self) -> int:
        """Bytes of rows held on disk (a `SpillingRowTable`'s spill file); 0 here."""
        return 0

    @property
    def spilled(self) -> bool:
        """Rows are no longer at slot = row in one slab (`whole_pages` / `payload` refuse): read them by rows."""
        return False

    def write_all(self, start: int, rows: torch.Tensor) -> None:
        """Encode rows (L, S, Hkv, n, D) of every layer into rows start .. start + n - 1 (after
        `reserve`): one encode and one copy per payload name; or, where the codec writes in place (`encode_into`) and
        the rows land in one run of the table, one call into it."""
        codec: Any = self.codec  # IdentityRows and RowQuant write in place; other codecs (lattice) do not
        if getattr(codec, "in_place", None) is not None and codec.in_place(rows):
            views = self._views(start, rows.shape[3])
            if views is not None:
                codec.encode_into(rows, views)
                return
        d = rows.shape[4]
        payload = self.codec.encode(rows.reshape(-1, d))
        self._put(start, {name: payload[name].reshape(*rows.shape[:4], *shape) for name, (shape, _) in self.layout.items()})

    def _views(self, start: int, n: int) -> dict | None:
        """The payload of rows start .. start + n - 1 (after `reserve`) per name, (L, S, Hkv, n, *trailing) views to
        write in place, counted as written; None where they are not one run (nothing done then)."""
        self.written = max(self.written, start + n)
        return {name: x[:, :, :, start:start + n] for name, x in self.data.items()}

    def _put(self, start: int, payload: dict) -> None:
        """Coded rows (L, S, Hkv, n, *trailing) per payload name into rows start .. start + n - 1."""
        for name, x in self.data.items():
            y = payload[name]
            x[:, :, :, start:start + y.shape[3]] = y.to(x.device, x.dtype)
            self.written = max(self.written, start + y.shape[3])

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

    def whole_pages(self, layer: int, rows: int) -> dict:
        """The stored payload of rows 0 .. rows - 1 of `layer` (views), `rows` a multiple of the page up
        to the capacity: rows past `self.rows` are spare (zeros or stale), for callers that mask them."""
        if rows > self.capacity or rows % self.page:
            raise ValueError(f"{rows} rows are not whole pages within the capacity {self.capacity}")
        return {name: x[:, :, :rows] for name, x in self.slabs[layer].items()}

    def gather(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Decoded rows (S, Hkv, E, D): rows[h] (E,) of KV head h, for every head h (a per-head choice)."""
        flat_rows = (rows + torch.arange(self.num_kv_heads, device=rows.device)[:, None] * self.capacity).flatten()
        n = rows.shape[1]
        flat = {name: x.flatten(1, 2).index_select(1, flat_rows).flatten(0, 1)  # (S * Hkv * E, ...)
                for name, x in self.slabs[layer].items()}
        return self.codec.decode(flat).reshape(self.stack, self.num_kv_heads, n, self.head_dim)

    def read_pages(self, layer: int, rows: int) -> torch.Tensor:
        """Decoded rows 0 .. rows - 1 (S, Hkv, rows, D), `rows` whole pages within the capacity (rows
        past `self.rows` are spare, for callers that mask them); identity: views, no copy."""
        part = self.whole_pages(layer, rows)
        if isinstance(self.codec, IdentityRows):
            return part["rows"]
        flat = {name: x.reshape(-1, *x.shape[3:]) for name, x in part.items()}
        return self.codec.decode(flat).reshape(self.stack, self.num_kv_heads, rows, self.head_dim)

    def gather_flat(self, layer: int, flat_rows: torch.Tensor, heads: int) -> torch.Tensor:
        """Decoded rows (S, heads, E, D) at flat_rows (heads * E,) of the (Hkv * capacity) flattened
        slab: head h's row r is h * capacity + r (a per-head choice, offsets added by the caller)."""
        flat = {name: x.flatten(1, 2).index_select(1, flat_rows).flatten(0, 1) for name, x in self.slabs[layer].items()}
        return self.codec.decode(flat).reshape(self.stack, heads, -1, self.head_dim)

    def take(self, layer: int, rows: torch.Tensor) -> dict:
        """The stored payload (S, H, E, *trailing) per name of rows[h] (H, E) of KV head h, not decoded."""
        h, e = rows.shape
        flat = (rows + torch.arange(h, device=rows.device)[:, None] * self.capacity).flatten()
        return {name: x.flatten(1, 2).index_select(1, flat).view(self.stack, h, e, *x.shape[3:])
                for name, x in self.slabs[layer].items()}

    def span(self, a: int, b: int, at: tuple[int, ...] = ()) -> dict:
        """Rows a .. b - 1 per payload name, (L, S, Hkv, b - a, *trailing), or with `at` (indices into the leading
        (L, S, Hkv) axes: (layer,), (layer, s), (layer, s, kv head)) of those only (views here)."""
        return {name: x[at].narrow(3 - len(at), a, b - a) for name, x in self.data.items()}

    def take_pages(self, layer: int, pages: torch.Tensor) -> dict:
        """The stored payload (S, H, M * P, *trailing) per name of whole pages pages[h] (H, M) of KV head h, not
        decoded (rows of a page past `rows` are spare: callers mask them)."""
        p = self.page
        return self.take(layer, ((pages * p)[:, :, None] + torch.arange(p, device=pages.device)).flatten(1))

    def gather_pages(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """Decoded rows (S, Hkv, M * P, D) of whole pages: pages[h] (Hkv, M) of KV head h, in the order given."""
        h, p = pages.shape[0], self.page
        heads = torch.arange(h, device=pages.device)[:, None, None]
        rows = (pages * p)[:, :, None] + torch.arange(p, device=pages.device) + heads * self.row_stride
        return self.gather_flat(layer, rows.flatten(), h)

    def state(self, start: int = 0, *, lazy: bool = False) -> dict:
        """The used rows' payload per name, (L, S, Hkv, rows - start, *trailing) on the CPU: rows
        `start` .. rows - 1 (a saver that holds the earlier ones asks for the new rows only); copies, or with
        `lazy` RowSpans, read a layer at a time by whoever writes them."""
        if lazy:
            return {name: RowSpan(self, name, start, self.rows) for name in self.layout}
        return {name: x.clone().cpu() for name, x in self.span(start, self.rows).items()}

    def load_state(self, tensors: dict, rows: int) -> None:
        """Adopt `state()`'s rows; a value may be `slot_cache.Pieces` (the rows in pieces, copied in one after
        another: a state loaded from several append segments is never concatenated whole)."""
        want = {name: (self.num_layers, self.stack, self.num_kv_heads, rows, *shape) for name, (shape, _) in self.layout.items()}
        got = {name: tuple(t.shape) for name, t in tensors.items()}
        if got != want:
            raise ValueError(f"stored rows {got} do not fit this {type(self.codec).__name__} table, which holds {want}")
        self._set(self._zeros(0))
        self.capacity = self.written = 0
        self.reserve(rows)
        at = 0
        for part in _in_pieces(tensors):
            self.rows = at  # a spilling table appends at its rows
            self._put(at, part)
            at += next(iter(part.values())).shape[3]
        self.rows = rows

    def _zeros(self, capacity: int) -> dict:
        return {name: lazy_zeros((self.num_layers, self.stack, self.num_kv_heads, capacity, *shape), dtype, self.device)
                for name, (shape, dtype) in self.layout.items()}


def _in_pieces(tensors: dict) -> list[dict]:
    """`load_state`'s tensors as payload dicts of consecutive rows: one per piece where every name is given in the
    same pieces (`Pieces` of one set of segments), else one whole."""
    from inference_engine.kv.slot_cache import Pieces

    if not any(isinstance(t, Pieces) for t in tensors.values()):
        return [tensors]
    cuts = {name: [p.shape[3] for p in t] if isinstance(t, Pieces) else None for name, t in tensors.items()}
    if None in cuts.values() or len({tuple(c) for c in cuts.values() if c is not None}) != 1:
        return [{name: t.tensor() if isinstance(t, Pieces) else t for name, t in tensors.items()}]
    return [{name: t[i] for name, t in tensors.items()} for i in range(len(next(iter(tensors.values()))))]


PIECE_ROWS = 1 << 14  # RowSpan.pieces: rows a piece at most (4 MB of one KV head's fp32 K rows for SmolLM2)


class RowSpan:
    """Rows a .. b - 1 of one payload of a RowTable, (L, S, Hkv, b - a, *trailing) as `state` gives them, not read
    yet: a saver writes it a piece at a time (`pieces`: up to PIECE_ROWS rows of one layer, stack entry and KV head),
    so a save holds a piece in RAM, not the whole span (a copy, then the serialized bytes: 3 GB at the peak for the fp32 pages of
    one 32k-token turn of SmolLM2, where the session keeps 128 MB of pages in RAM). Read it before the table
    changes: a saver holds the session meanwhile."""

    def __init__(self, table: RowTable, name: str, a: int, b: int):
        self.table, self.name, self.a, self.b = table, name, a, b
        trailing, self.dtype = table.layout[name]
        self.shape = (table.num_layers, table.stack, table.num_kv_heads, b - a, *trailing)

    def pieces(self) -> Iterator[torch.Tensor]:
        """Rows (n, *trailing) per layer, stack entry and KV head in that order, at most PIECE_ROWS of them a piece,
        contiguous on the CPU: together the span's bytes in order."""
        t = self.table
        cuts = [self.a, *range((self.a // PIECE_ROWS + 1) * PIECE_ROWS, self.b, PIECE_ROWS), self.b]
        for at in itertools.product(range(t.num_layers), range(t.stack), range(t.num_kv_heads)):
            for a, b in zip(cuts, cuts[1:]):
                if b > a:
                    yield t.span(a, b, at)[self.name].contiguous().cpu()

    def tensor(self) -> torch.Tensor:
        """The whole span as one CPU tensor (a copy), what `state` gives."""
        return self.table.span(self.a, self.b)[self.name].clone().cpu()


_spill_dir: str | None = None  # set_spill_dir: where spill files go (None: the system temp directory)


def set_spill_dir(path: str | None) -> None:
    """Where `SpillingRowTable`s create their spill files from now on (made if missing); None: the system temp
    directory. A process setting (the daemon's `--page-spill-dir`): spill files are unlinked as they are made."""
    global _spill_dir
    if path is not None:
        os.makedirs(path, exist_ok=True)
    _spill_dir = path


def spill_dir() -> str:
    return _spill_dir if _spill_dir is not None else tempfile.gettempdir()


class SpillFile:
    """Whole pages of one payload, (pages, *page_shape) of `dtype`, in an unlinked file of the spill directory,
    memory-mapped (shared): nothing is left behind when the process ends. It grows by a quarter at a time:
    the file is extended, its blocks allocated, and mapped again, nothing copied (its pages axis is the outermost)."""

    def __init__(self, page_shape: tuple, dtype: torch.dtype):
        self.page_shape, self.dtype = page_shape, dtype
        self.page_bytes = int(torch.Size(page_shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        fd, path = tempfile.mkstemp(prefix="kakeya-pages-", suffix=".bin", dir=spill_dir())
        os.unlink(path)
        self.fd = fd
        self._closer = weakref.finalize(self, os.close, fd)
        self.pages = 0  # mapped
        self.map: mmap.mmap | None = None
        self.tensor = torch.empty(0, *page_shape, dtype=dtype)

    def reserve(self, pages: int) -> None:
        """Room for `pages` pages. The file's blocks are allocated here (posix_fallocate), not on first write through
        the map: a full disk is an OSError now, not a SIGBUS that would kill the process at the write."""
        if pages <= self.pages:
            return
        want = max(pages, self.pages + self.pages // 4)
        try:
            os.posix_fallocate(self.fd, 0, want * self.page_bytes)
        except OSError as e:
            raise OSError(e.errno, f"the spill directory {spill_dir()} has no room for {want * self.page_bytes} bytes of "
                                   f"pages ({e.strerror}); free space or move it (--page-spill-dir)") from e
        self.map = mmap.mmap(self.fd, want * self.page_bytes)  # the old map lives as long as tensors viewing it
        self.tensor = torch.frombuffer(self.map, dtype=self.dtype).view(want, *self.page_shape)
        self.pages = want


class SpillingRowTable(RowTable[CodecT]):
    """A RowTable that holds at most `ram_rows` rows (whole pages) in host RAM: the newest ones, in a ring (row r at
    slot r % ram_rows once the table has outgrown it). Older pages move, a whole page at a time, to a spill file
    (`SpillFile`, page-major: page j of every layer, stack entry and KV head is one contiguous run) and are read
    from its map when a query recalls them (the kernel's page cache keeps what it can; the file is the session's
    cold tier). Every row is in exactly one tier: `nbytes` is the ring (RAM), `cold_nbytes` the spilled pages.
    ram_rows None: no limit yet (a RowTable) until `limit` sets one.

    Reads (`read`, `gather`, `gather_flat`, `read_pages`, `take`, `span`) take any rows, from either tier, as the
    RowTable gives them; writes append (`write_all` at `rows`). `whole_pages` / `payload` (views of the whole slab)
    refuse once a page has spilled. `state` / `load_state` keep RowTable's format (rows axis 3), so a session saved
    with one budget loads under another."""

    def __init__(self, codec: CodecT, *, ram_rows: int | None, **kw: Any):
        super().__init__(codec, **kw)
        self.ram_rows: int | None = None
        self.cold_pages = 0  # pages [0, cold_pages) are in the spill file; rows [cold_pages * page, rows) in the ring
        self.files: dict[str, SpillFile] = {}
        if ram_rows is not None:
            self.limit(ram_rows)

    @property
    def first_ram_row(self) -> int:
        return self.cold_pages * self.page

    @property
    def row_stride(self) -> int:
        return max(self.capacity, -(-self.rows // self.page) * self.page)

    @property
    def cold_nbytes(self) -> int:
        return self.cold_pages * sum(f.page_bytes for f in self.files.values())

    @property
    def spilled(self) -> bool:
        """A page has spilled: the ring's rows no longer sit at slot = row (until then rows < ram_rows, so slot
        r % ram_rows is r even in a ring at its full size)."""
        return bool(self.cold_pages)

    @property
    def wrapped(self) -> bool:
        """Rows sit at slot r % ram_rows (the ring is at its full size); else at slot r."""
        return self.ram_rows is not None and self.capacity == self.ram_rows

    def _held_rows(self) -> int:
        if self.spilled and self.device.type == "cpu":  # the ring has gone round: every slot written
            return self.capacity
        return super()._held_rows()

    def limit(self, ram_rows: int) -> None:
        """Hold at most `ram_rows` rows (whole pages, at least one) in RAM from now on: the oldest pages past it
        spill now, and the ring is laid out again at that size (rows r at slot r % ram_rows)."""
        if ram_rows < self.page or ram_rows % self.page:
            raise ValueError(f"a spilling table holds whole pages in RAM: ram_rows {ram_rows} is not a multiple of "
                             f"the page ({self.page}) of at least one page")
        if ram_rows == self.ram_rows:
            return
        if not self.spilled and self.rows <= ram_rows and self.capacity <= ram_rows:  # rows already at slot r % ram_rows
            self.ram_rows = ram_rows
            return
        keep_from = max(self.first_ram_row, -(-(self.rows - ram_rows) // self.page) * self.page)
        self._spill((keep_from - self.first_ram_row) // self.page)
        kept = self.span(keep_from, self.rows)
        old = self.rows
        self.ram_rows, self.rows = ram_rows, keep_from
        self._set(self._zeros(0))
        self.capacity = self.written = 0
        self._put(keep_from, kept)
        self.rows = old

    def reserve(self, rows: int, most: int | None = None) -> None:
        """Room for `rows` rows: on the CPU the ring at its full size (`ram_rows`) at the first call (its memory is
        taken as rows are written, so it never grows by copying); elsewhere it grows as a RowTable does, up to
        `ram_rows`. Past it, `_put` spills."""
        if self.ram_rows is None:
            return super().reserve(rows, most)
        if self.capacity >= self.ram_rows or rows <= self.capacity:
            return
        limit = self.ram_rows if most is None else min(most, self.ram_rows)
        super().reserve(limit if self._ring_at_once() else min(rows, limit), most=limit)

    def _ring_at_once(self) -> bool:
        """The ring is allocated at its full size at once where its memory is taken as rows are written (the CPU)."""
        return self.device.type == "cpu"

    def _slot(self, r: int) -> int:
        return r % self.ram_rows if self.wrapped else r  # type: ignore[operator]

    def _put(self, start: int, payload: dict) -> None:
        if self.ram_rows is None:
            return super()._put(start, payload)
        if start != self.rows:
            raise ValueError(f"a spilling table appends: its rows end at {self.rows}, not {start}")
        n = next(iter(payload.values())).shape[3]
        a = start
        while a < start + n:  # a page (or the rest of one) at a time: a piece never wraps the ring
            b = min(start + n, (a // self.page + 1) * self.page)
            slot = self._piece(a, b)
            for name, x in self.data.items():
                x[:, :, :, slot:slot + b - a] = payload[name][:, :, :, a - start:b - start].to(x.device, x.dtype)
            a = b

    def _piece(self, a: int, b: int) -> int:
        """Room in the ring for rows a .. b - 1 (within one page; the ring's oldest pages spilled past ram_rows),
        counted as written: the slot of row a."""
        assert self.ram_rows is not None
        if b - self.first_ram_row > self.ram_rows:
            self.reserve(self.ram_rows)
            self._spill((b - self.first_ram_row - self.ram_rows + self.page - 1) // self.page)
        else:
            self.reserve(b)
        slot = self._slot(a)
        self.written = max(self.written, slot + b - a)
        return slot

    def _views(self, start: int, n: int) -> dict | None:
        if self.ram_rows is None:
            return super()._views(start, n)
        if start != self.rows:
            raise ValueError(f"a spilling table appends: its rows end at {self.rows}, not {start}")
        if n < 1 or start // self.page != (start + n - 1) // self.page:  # more than one piece: _put writes them
            return None
        slot = self._piece(start, start + n)
        return {name: x[:, :, :, slot:slot + n] for name, x in self.data.items()}

    def _spill(self, pages: int) -> None:
        """Move the ring's oldest `pages` (complete) pages to the spill file."""
        if pages <= 0:
            return
        if not self.files:
            self.files = {name: SpillFile((self.num_layers, self.stack, self.num_kv_heads, self.page, *shape), dtype)
                          for name, (shape, dtype) in self.layout.items()}
        for f in self.files.values():
            f.reserve(self.cold_pages + pages)
        for j in range(self.cold_pages, self.cold_pages + pages):
            slot = self._slot(j * self.page)
            for name, x in self.data.items():
                self.files[name].tensor[j] = x[:, :, :, slot:slot + self.page].cpu()
        self.cold_pages += pages

    def _take(self, layer: int, heads: torch.Tensor, rows: torch.Tensor) -> dict:
        """Coded rows (S, N, *trailing) per payload name: row rows[n] of KV head heads[n], from either tier (one
        index_select per tier over rows of the payload's trailing size, placed by index_copy)."""
        n = rows.numel()
        cold = rows < self.first_ram_row
        ci = torch.nonzero(cold).flatten() if self.cold_pages else rows.new_empty(0)
        wi = torch.nonzero(~cold).flatten() if ci.numel() else None  # None: every row warm
        warm_flat = warm_rows = None
        if wi is None or wi.numel():
            r, h = (rows, heads) if wi is None else (rows[wi], heads[wi])
            warm_rows = wi
            warm_flat = h * self.capacity + (r % self.ram_rows if self.wrapped else r)  # type: ignore[operator]
        cold_flat = None
        if ci.numel():  # file row of (page, layer, s, head, offset) in the (pages * L * S * Hkv * P) flattened file
            r, h = rows[ci].cpu(), heads[ci].cpu()
            base = ((r // self.page) * self.num_layers + layer) * self.stack
            s_ax = torch.arange(self.stack)[:, None]
            cold_flat = ((base[None] + s_ax) * self.num_kv_heads + h[None]) * self.page + (r % self.page)[None]  # (S, n_cold)
        out = {}
        for name, x in self.slabs[layer].items():
            warm = None if warm_flat is None else x.flatten(1, 2).index_select(1, warm_flat)  # (S, n_warm, *trailing)
            if cold_flat is None:
                out[name] = warm
                continue
            f = self.files[name].tensor
            c = f.view(-1, *f.shape[5:]).index_select(0, cold_flat.flatten()).view(self.stack, -1, *f.shape[5:]).to(x.device)
            if warm is None:
                out[name] = c
                continue
            got = x.new_empty(self.stack, n, *x.shape[3:])
            got.index_copy_(1, ci.to(x.device), c)
            got.index_copy_(1, warm_rows, warm)
            out[name] = got
        return out

    def take_pages(self, layer: int, pages: torch.Tensor) -> dict:
        """RowTable's `take_pages` from both tiers: one block copy a page (P rows of a layer, stack entry and head:
        contiguous in the ring and in the spill file)."""
        if not self.spilled:
            return super().take_pages(layer, pages)
        h, m = pages.shape
        p, dev = self.page, pages.device
        heads = torch.arange(h, device=dev)[:, None].expand(h, m).flatten()
        j = pages.flatten()
        cold = j < self.cold_pages
        ci = torch.nonzero(cold).flatten()
        wi = torch.nonzero(~cold).flatten()
        s_ax = torch.arange(self.stack)[:, None]
        out = {}
        for name, x in self.slabs[layer].items():
            tail = x.shape[3:]
            got = x.new_empty(self.stack, h * m, p, *tail)
            if wi.numel():  # ring block of page j: slots (j * P) % ram_rows .., a whole page (ram_rows is whole pages)
                slot_page = (j[wi] * p) % self.ram_rows // p if self.wrapped else j[wi]  # type: ignore[operator]
                ring = x.flatten(1, 2).unflatten(1, (-1, p))  # (S, Hkv * cap / P, P, *trailing)
                got.index_copy_(1, wi, ring.index_select(1, heads[wi] * (self.capacity // p) + slot_page))
            if ci.numel():  # file block (page, layer, s, head) of the (pages * L * S * Hkv) flattened file
                f = self.files[name].tensor
                blocks = ((j[ci].cpu()[None] * self.num_layers + layer) * self.stack + s_ax) * self.num_kv_heads + heads[ci].cpu()[None]
                c = f.view(-1, p, *tail).index_select(0, blocks.flatten()).view(self.stack, -1, p, *tail)
                got.index_copy_(1, ci, c.to(x.device))
            out[name] = got.view(self.stack, h, m * p, *tail)
        return out

    def gather_pages(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        if not self.spilled:
            return super().gather_pages(layer, pages)
        h, m = pages.shape
        flat = {name: x.flatten(0, 2) for name, x in self.take_pages(layer, pages).items()}
        return self.codec.decode(flat).reshape(self.stack, h, m * self.page, self.head_dim)

    def take(self, layer: int, rows: torch.Tensor) -> dict:
        if not self.spilled:
            return super().take(layer, rows)
        h, e = rows.shape
        heads = torch.arange(h, device=rows.device)[:, None].expand(h, e)
        return {name: x.view(self.stack, h, e, *x.shape[2:]) for name, x in self._take(layer, heads.flatten(), rows.flatten()).items()}

    def _decoded(self, layer: int, heads: torch.Tensor, rows: torch.Tensor, h: int) -> torch.Tensor:
        part = self._take(layer, heads.flatten(), rows.flatten())
        flat = {name: x.flatten(0, 1) for name, x in part.items()}
        return self.codec.decode(flat).reshape(self.stack, h, -1, self.head_dim)

    def read(self, layer: int, idx: torch.Tensor | None = None) -> torch.Tensor:
        if not self.spilled:
            return super().read(layer, idx)
        idx = torch.arange(self.rows, device=self.device) if idx is None else idx
        hkv = self.num_kv_heads
        heads = torch.arange(hkv, device=idx.device)[:, None].expand(hkv, idx.numel())
        return self._decoded(layer, heads, idx.expand(hkv, -1), hkv)

    def gather(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        if not self.spilled:
            return super().gather(layer, rows)
        heads = torch.arange(self.num_kv_heads, device=rows.device)[:, None].expand_as(rows)
        return self._decoded(layer, heads, rows, self.num_kv_heads)

    def gather_flat(self, layer: int, flat_rows: torch.Tensor, heads: int) -> torch.Tensor:
        if not self.spilled:
            return super().gather_flat(layer, flat_rows, heads)
        stride = self.row_stride
        return self._decoded(layer, flat_rows // stride, flat_rows % stride, heads)

    def read_pages(self, layer: int, rows: int) -> torch.Tensor:
        if not self.spilled and rows <= self.capacity:
            return super().read_pages(layer, rows)
        return self.read(layer, torch.arange(rows, device=self.device).clamp_(max=max(self.rows - 1, 0)))

    def whole_pages(self, layer: int, rows: int) -> dict:
        if self.spilled:
            raise ValueError("a spilled table is read by rows (take, gather), not as whole slabs")
        return super().whole_pages(layer, rows)

    def payload(self, layer: int) -> dict:
        if self.spilled:
            raise ValueError("a spilled table is read by rows (take, gather), not as whole slabs")
        return super().payload(layer)

    def span(self, a: int, b: int, at: tuple[int, ...] = ()) -> dict:
        """RowTable's `span` from both tiers (a copy once anything spilled): the spilled pages' rows in one strided
        copy per payload name, the ring's in pieces of at most a page."""
        if not self.spilled:
            return super().span(a, b, at)
        axis = 3 - len(at)  # the rows axis of what is returned
        ring = {name: x[at] for name, x in self.data.items()}
        parts: dict[str, list] = {name: [] for name in self.layout}
        cold_end = min(b, self.first_ram_row)
        if a < cold_end:  # pages j0 .. j1 - 1 of the spill file, (n, L, S, Hkv, P, ...): the n axis next to the rows
            j0, j1 = a // self.page, -(-cold_end // self.page)
            lo, hi = a - j0 * self.page, cold_end - j0 * self.page
            for name in self.layout:
                pages = self.files[name].tensor[j0:j1][(slice(None),) + at]  # type: ignore[index]
                rows = pages.movedim(0, axis).flatten(axis, axis + 1)
                parts[name].append(rows.narrow(axis, lo, hi - lo).to(self.device))
            a = cold_end
        while a < b:
            e = min(b, (a // self.page + 1) * self.page)
            slot = self._slot(a)
            for name in self.layout:
                parts[name].append(ring[name].narrow(axis, slot, e - a))
            a = e
        return {name: torch.cat(xs, axis) if len(xs) > 1 else xs[0] if xs else ring[name].narrow(axis, 0, 0)
                for name, xs in parts.items()}

    def load_state(self, tensors: dict, rows: int) -> None:
        """The rows stream in a page at a time through `_put`: past `ram_rows` the oldest spill as they arrive, so a
        load holds no more in RAM than the ring (the tensors themselves are the segments' maps)."""
        self.cold_pages, self.files, self.rows = 0, {}, 0
        super().load_state(tensors, rows)


def ram_rows_for(ram_bytes: float, row_bytes: int, page: int) -> int | None:
    """Whole pages of `row_bytes` a row within `ram_bytes` (at least one page); None for a budget of 0 (no limit)."""
    if ram_bytes <= 0:
        return None
    return max(1, int(ram_bytes // (row_bytes * page))) * page
