"""The layer loop's dense work as captured CUDA graphs, attention left eager (piecewise graphs).

A decode step of a 135M model is ~1,000 small kernels; launched one by one from Python they
cost far more than they compute (the daemon decoded at 42-58 tok/s on an H200). Everything of a
layer but attention (input norm, fused QKV projection, q/k norms, RoPE, output projection, MLP,
the next layer's projections) has static shapes for a given number of rows, so it is captured
once per bucket of rows and replayed: L + 1 graph launches per step instead of ~1,000 kernels.
Attention stays outside the graphs, eager, per session: kv/ decides what each query reads
(sink + window, recalled pages, masks), and its shapes change every step. This is the split
vLLM's piecewise CUDA graphs make.

Segments, for a bucket of B rows (a step's rows padded up to B):
  seg 0     ids -> x = embed(ids); q, k, v of layer 0
  seg i     x, o (layer i-1's attention output) -> x = finish(i-1); q, k, v of layer i
  seg L     x, o -> x = finish(L-1); hidden = final_norm(x)
Inputs live in static buffers (ids, RoPE tables, o) that each step copies into; each segment's
outputs are the tensors its capture produced, read back as views. Padding rows compute on
whatever the buffers hold and are never read: linear layers and norms are row-independent.

Without capture (`capture=False`: the CPU, and the test suite) the same runner calls the segment
functions directly over the same buffers, so its data flow is tested where no GPU is.
"""
from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("kakeya")

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class StepGraphs:
    """Runners by bucket, made (and captured) on first use."""

    def __init__(self, model, *, capture: bool, compiled: bool = False, buckets: tuple = BUCKETS):
        self.model = model
        self.capture = capture
        self.fns = Segments(compiled)
        self.buckets = buckets
        self._runners: dict[int, _Runner] = {}
        self.capture_s = 0.0  # total time spent capturing (logged)

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def runner(self, rows: int) -> "_Runner | None":
        bucket = next((b for b in self.buckets if b >= rows), None)
        if bucket is None:
            return None
        r = self._runners.get(bucket)
        if r is None:
            t0 = time.perf_counter()
            r = self._runners[bucket] = _Runner(self.model, bucket, self.capture, self.fns)
            dt = time.perf_counter() - t0
            self.capture_s += dt
            if self.capture:
                log.info("captured the step's CUDA graphs for %d rows in %.2f s (%d segments)", bucket, dt,
                         self.model.spec.num_layers + 1)
        return r

    def describe(self) -> dict:
        """How the step's dense work runs, for logs and reports: the mode, the buckets made so far and
        the seconds spent making them (capture, or inductor compiles on first use)."""
        return {"step": "cuda graphs" if self.capture else ("inductor segments" if self.fns.compiled else "segments"),
                "buckets": list(self.buckets), "buckets_made": sorted(self._runners), "make_s": round(self.capture_s, 3)}

    def prepare(self, rows: tuple = BUCKETS) -> float:
        """Capture the runners for these buckets now (at startup); returns the seconds it took."""
        t0 = time.perf_counter()
        for b in rows:
            self.runner(b)
        return time.perf_counter() - t0


class _Runner:
    def __init__(self, model, rows: int, capture: bool, fns: "Segments"):
        self.model, self.rows, self.fns = model, rows, fns
        s = model.spec
        dev, dt = model.device, model.dtype
        with torch.inference_mode():
            self.ids = torch.zeros(rows, dtype=torch.long, device=dev)
            probe = model.rope(torch.zeros(rows, dtype=torch.long, device=dev))
            self.tables = {kind: (c.clone(), si.clone()) for kind, (c, si) in probe.tables.items()}
            self.rope = type(probe)(self.tables)
            self.o = torch.zeros(s.num_heads, rows, s.head_dim, dtype=dt, device=dev)
            self.outs: list = [None] * (s.num_layers + 1)
            self.graphs: list = []
            if capture:
                self._capture()
            else:
                for i in range(s.num_layers + 1):  # shapes and dtypes, as a capture would leave them
                    self.outs[i] = self._segment(i)

    # -- segments ------------------------------------------------------------------------
    def _segment(self, i: int):
        m, n, fns = self.model, self.model.spec.num_layers, self.fns
        if i == 0:
            return fns.first(m, m.layers[0], self.ids, *self._rope(0))
        if i == n:
            return fns.last(m, m.layers[n - 1], self.outs[i - 1][0], self.o)
        return fns.middle(m, m.layers[i - 1], m.layers[i], self.outs[i - 1][0], self.o, *self._rope(i))

    def _rope(self, i: int):
        return self.rope.for_layer(self.model.spec, i)

    def _capture(self) -> None:
        """Warm up on a side stream (cuBLAS handles and workspaces exist before capture), then capture
        the segments in order into one memory pool: they replay in that order, and each one's outputs
        (the next one's inputs) stay referenced, so the pool never hands them out again."""
        n = self.model.spec.num_layers
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                for i in range(n + 1):
                    self.outs[i] = self._segment(i)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for i in range(n + 1):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outs[i] = self._segment(i)
            self.graphs.append(g)
        torch.cuda.synchronize()

    def _run(self, i: int) -> None:
        if self.graphs:
            self.graphs[i].replay()
        else:
            self.outs[i] = self._segment(i)

    # -- a step ----------------------------------------------------------------------------
    def start(self, ids: torch.Tensor, rope) -> tuple:
        """A step's `ids` (T,) and RoPE tables (1, T, D) in; returns layer 0's (q, q_normed, k, v), T rows each."""
        self.t = t = ids.shape[0]
        self.ids[:t].copy_(ids)
        for kind, (c, s) in rope.tables.items():
            sc, ss = self.tables[kind]
            sc[:, :t].copy_(c)
            ss[:, :t].copy_(s)
        self._run(0)
        return self._qkv(0)

    def advance(self, layer: int, o: torch.Tensor):
        """Layer `layer`'s attention output o (H, T, D) in; returns the residual stream after it and
        the next layer's (q, q_normed, k, v), or, after the last layer, (x, final-normed hidden)."""
        self.o[:, : self.t].copy_(o)
        self._run(layer + 1)
        if layer + 1 == self.model.spec.num_layers:
            x, hidden = self.outs[layer + 1]
            return x[: self.t], hidden[: self.t]
        return self.outs[layer + 1][0][: self.t], self._qkv(layer + 1)

    def _qkv(self, i: int) -> tuple:
        _, q, q_normed, k, v = self.outs[i]
        t = self.t
        return q[:, :t], q_normed[:, :t], k[:, :t], v[:, :t]


def _first(m, L, ids, cos, sin):
    """ids -> x = embed(ids) and layer 0's q, q_normed, k, v."""
    return _qkv(m, L, m.embed_ids(ids), cos, sin)


def _middle(m, L_prev, L, x, o, cos, sin):
    """x and the previous layer's attention output o -> that layer's residual stream, and this layer's q, q_normed, k, v."""
    return _qkv(m, L, m.finish_layer(L_prev, x, o), cos, sin)


def _last(m, L_prev, x, o):
    """The last layer's residual stream and the final-normed hidden states."""
    x = m.finish_layer(L_prev, x, o)
    return x, m.final_norm(x)


def _qkv(m, L, x, cos, sin):
    q, k, v = m.project_layer(L, x)
    q, q_normed = m.position_q_layer(L, q, cos, sin)
    return x, q, q_normed, m.position_k_layer(L, k, cos, sin), v


def inductor_available() -> bool:
    """Inductor can compile for CUDA here (it needs triton)."""
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return bool(has_triton())


class Segments:
    """The three segment functions, eager or through torch.compile (inductor). A layer's weights are
    arguments, not constants, so each function compiles once for every layer, per bucket of rows."""

    def __init__(self, compiled: bool):
        self.compiled = compiled
        wrap = (lambda f: torch.compile(f, dynamic=False)) if compiled else (lambda f: f)
        self.first, self.middle, self.last = wrap(_first), wrap(_middle), wrap(_last)
        self.attend_rows = None  # row_graphs: the arena read and attention, compiled per (rows, keys) bucket
        if compiled:
            from inference_engine.backends.torch.attention import attend_rows

            # one compile per bucket of rows x keys (row_graphs.ROW_BUCKETS x KEY_BUCKETS): past dynamo's default
            # limit of 8 per function it would silently run the rest eagerly
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 128))
            self.attend_rows = wrap(attend_rows)
