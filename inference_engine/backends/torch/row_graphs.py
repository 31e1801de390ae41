"""Row steps (decode rows and verify blocks) as one captured graph each: the whole step, attention included.

graphs.py captures the dense work between attentions and leaves attention eager, per session: on an H200
that step decoded at 112 tok/s against 300 for transformers' static cache + torch.compile
(results/gpu_check.json), the ~30 eager attentions per step costing more than the GPU's work. Here a step
whose every row is row-exact (a decode row is a verify block of one) and whose every session keeps its
K/V in the arena (arena.py) runs as one graph, per bucket of (rows, keys):

  ids, positions -> embed; per layer: q, k, v, RoPE; the rows' k, v written into their sessions' arena
  slots at their slots; each row's keys gathered from its session's slot, columns 0..keys-1; attention of
  each row alone over them under its own additive mask (its visible columns: the cache's mask row, padded
  with -inf); the rest of the layer -> final norm -> logits (fp32)

A verify block's rows all belong to one session: each row's keys come from the same slot, where every
row of the step was written first, and its mask row lets it see exactly what a one-token step at its
position sees. Rows attend alone (a row is a batch entry of the attention call), so decode and verify go
through the same graph family. Padding rows (a step's rows up to the bucket) read and write the arena's
scratch slot and see every column of it (finite values), and their outputs are never read.

The dense work between attentions goes through graphs.Segments (the functions the piecewise step's CUDA
graphs capture): inductor's fused kernels with --compile on, and with auto where triton is present (compiled
once per bucket of rows, for every layer; then captured like the rest), else eager pieces. With inductor the
arena read and attention go through it too (`attention.attend_rows`, plain ops, once per bucket of rows and
keys): an H200 profile of the step with eager pieces (results/gpu_check.json, section `profile`) counted
~1,400 kernels a token, SDPA's math path several a layer among them, against 560 with inductor's; the K/V
writes stay eager index_put.

Inputs are static buffers the step copies into (one int64 (4, B) block: ids, positions, slot, write
column; one (B, 1, 1, K) mask); outputs are the graph's own tensors, copied out before the next replay.
Without capture (the CPU, and the test suite) the same body runs eagerly over the same buffers, so its
data flow is tested where no GPU is. A capture that fails turns the graphs off (logged) and the step
runs piecewise, as before.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch
import torch.nn.functional as F

from inference_engine.backends.torch.arena import ArenaStore, KVArena
from inference_engine.backends.torch.graphs import Segments

log = logging.getLogger("kakeya")

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
KEY_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def _bucket(n: int, buckets) -> int | None:
    return next((b for b in buckets if b >= n), None)


class RowGraphs:
    """Graphs of row steps by (rows, keys) bucket, made on first use; `run` declines what they cannot run."""

    def __init__(self, model, arena: KVArena, *, capture: bool, compiled: bool = False, fallback: bool = False):
        """compiled: the dense work and attention through inductor; fallback: if a compile fails, go on with
        eager pieces (--compile auto) rather than turning the graphs off."""
        self.model, self.arena, self.capture = model, arena, capture
        self.fns = Segments(compiled)
        self.fallback = fallback and compiled
        self.key_buckets = tuple(b for b in KEY_BUCKETS if b < arena.rows) + (arena.rows,)
        self._graphs: dict[tuple[int, int], _RowGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.make_s = 0.0
        self.failed: str | None = None  # why the graphs were turned off
        self.steps = 0  # steps run through these graphs (reported)

    def describe(self) -> dict:
        how = ("cuda graphs" if self.capture else "eager") + (" of inductor segments" if self.fns.compiled else "")
        return {"row_graphs": "off: " + self.failed if self.failed else how,
                "row_graphs_made": sorted(self._graphs), "row_graphs_make_s": round(self.make_s, 3),
                "row_graph_steps": self.steps, "arena_sessions": self.arena.sessions, "arena_rows": self.arena.rows,
                "arena_fallbacks": self.arena.fallbacks}

    def run(self, parts: list) -> tuple[torch.Tensor, torch.Tensor] | None:
        """parts: per session (ids (T,), layout, store) of a row-exact step, every layout already prepared.
        Returns (logits (R, V) fp32, hidden (R, hidden)) for the R = sum T rows in order, or None: these
        steps are not for the graphs (a store outside the arena, too many rows or keys)."""
        if self.failed is not None:
            return None
        rows = sum(layout.positions.numel() for _, layout, _ in parts)
        keys = max(layout.key_positions.numel() for _, layout, _ in parts)
        rb, kb = _bucket(rows, ROW_BUCKETS), _bucket(keys, self.key_buckets)
        if rb is None or kb is None:
            return None
        # (every layer is global, use_row_graphs checks it: a layout's one mask is host_masks[None])
        if not all(isinstance(store, ArenaStore) and store.arena is self.arena and layout.key_slots is None
                   for _, layout, store in parts):
            return None
        g = self._graphs.get((rb, kb))
        if g is None:
            t0 = time.perf_counter()
            try:
                g = _RowGraph(self.model, self.arena, rb, kb, self._pool, self.fns)
            except Exception as e:  # a capture that fails leaves the piecewise path, never a broken step
                if self.fallback:  # --compile auto: inductor failed here; the eager pieces, captured, instead
                    log.warning("row graphs: inductor failed for %d rows x %d keys (%s: %s); eager pieces from now on",
                                rb, kb, type(e).__name__, e)
                    self.fns, self.fallback, self._graphs = Segments(False), False, {}
                    return self.run(parts)
                self.failed = f"capturing {rb} rows x {kb} keys failed: {type(e).__name__}: {e}"
                log.warning("row graphs off: %s", self.failed)
                return None
            dt = time.perf_counter() - t0
            self.make_s += dt
            self._graphs[(rb, kb)] = g
            log.info("%s the row step for %d rows x %d keys in %.2f s", "captured" if self.capture else "built", rb, kb, dt)
        self.steps += 1
        return g.run(parts, rows)


class _RowGraph:
    def __init__(self, model, arena: KVArena, rows: int, keys: int, pool, fns: Segments):
        self.model, self.arena, self.rows, self.keys, self.fns = model, arena, rows, keys, fns
        self.attend = fns.attend_rows
        dev = model.device
        self.host = torch.zeros(4, rows, dtype=torch.long)  # ids (set on the device), positions, slot, write column
        self.host_bias = torch.zeros(rows, 1, 1, keys, dtype=model.dtype)
        self._padding(0)
        self.idx = self.host.to(dev)
        self.bias = self.host_bias.to(dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        if pool is not None:
            self._capture(pool)

    def _padding(self, start: int) -> None:
        """Rows start.. of the host buffers: padding (scratch slot, column 0, every column visible)."""
        self.host[:, start:] = 0
        self.host[2, start:] = self.arena.scratch
        self.host_bias[start:] = 0.0

    def _capture(self, pool) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):  # warm-up: cuBLAS handles and workspaces exist before capture
                self.out = self._body()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(g, pool=pool):
            self.out = self._body()
        torch.cuda.synchronize()
        self.graph = g

    def _body(self):
        """The step: the dense work through the segment functions (graphs.Segments: eager, or inductor's fused
        kernels with --compile on), attention between them over the arena."""
        m, s, fns = self.model, self.model.spec, self.fns
        ids, pos, slot, col = self.idx[0], self.idx[1], self.idx[2], self.idx[3]
        rope = m.rope(pos)
        n = s.num_layers
        x, q, _, k, v = fns.first(m, m.layers[0], ids, *rope.for_layer(s, 0))  # q (H, B, D); k, v (Hkv, B, D)
        for i in range(n):
            ak, av = self.arena.k[i], self.arena.v[i]
            ak[slot, :, col] = k.transpose(0, 1)  # (B, Hkv, D) into each row's session slot at its column
            av[slot, :, col] = v.transpose(0, 1)
            if self.attend is not None:  # --compile on: the read and attention as inductor's kernels
                o = self.attend(q, ak, av, slot, self.bias, self.keys, s.attn_scale)
            else:
                o = F.scaled_dot_product_attention(q.transpose(0, 1)[:, :, None], ak[slot, :, :self.keys],
                                                   av[slot, :, :self.keys], attn_mask=self.bias, scale=s.attn_scale,
                                                   enable_gqa=True)  # (B, H, 1, D)
                o = o[:, :, 0].transpose(0, 1)
            if i + 1 < n:
                x, q, _, k, v = fns.middle(m, m.layers[i], m.layers[i + 1], x, o, *rope.for_layer(s, i + 1))
            else:
                x, hidden = fns.last(m, m.layers[i], x, o)
        return m.logits(hidden), hidden

    def run(self, parts: list, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = 0
        self.host_bias[:rows] = float("-inf")
        for _, layout, store in parts:
            t = layout.positions.numel()
            self.host[1, r:r + t] = torch.arange(layout.first_position, layout.first_position + t)
            self.host[2, r:r + t] = store.slot
            self.host[3, r:r + t] = torch.from_numpy(np.ascontiguousarray(layout.host_slots))
            mask = layout.host_masks[None]  # (t, N): the columns each row sees
            n = mask.shape[1]
            self.host_bias[r:r + t, 0, 0, :n].masked_fill_(torch.from_numpy(mask), 0.0)
            r += t
        self._padding(rows)
        self.idx.copy_(self.host)
        self.bias.copy_(self.host_bias)
        # the token ids are on the device already (the engine's step inputs): copied there, no round trip
        self.idx[0, :rows].copy_(parts[0][0] if len(parts) == 1 else torch.cat([ids for ids, _, _ in parts]))
        if self.graph is not None:
            self.graph.replay()
            logits, hidden = self.out
        else:
            logits, hidden = self._body()
        return logits[:rows].clone(), hidden[:rows].clone()
