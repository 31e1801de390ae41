"""The CPU row step as a small C++ extension (csrc/row_step.cpp): decode rows and verify blocks through every
layer in one call; int4 matmuls through its own int4 kernel (csrc/q4_matmul.h) where the CPU has AVX2
or AVX-512 VNNI, int8 ones through torch's weight-only kernel; the rest as plain loops.

Built with torch.utils.cpp_extension on first use (`python -m inference_engine.backends.torch.native`
builds it ahead, as `make setup` does) with -O3 -march=native -fno-math-errno -fopenmp (at::parallel_for is a
header: without -fopenmp its loops run on one thread), and cached under
$KAKEYA_HOME/native/<key>, the key covering the source (its path and bytes), torch's version and the CPU's
model and flags: a restart loads it in well under a second; a build takes ~30-60 s on 2 cores. Without a C++ compiler,
or if the build fails, the step stays in Python (logged once) and nothing else changes.

Which steps it takes whole (`NativeRowStep.run` returns None for the rest):
  - a Llama-family model (no qk-norm, Gemma norms, biases or sliding-window layers), SiLU MLP, on the
    CPU with int8 or int4 weights (their kernels are row-independent; fp32 dense GEMM is not);
  - every row row-exact (decode rows, verify blocks) or a prefill chunk, with or without captured layers (a
    drafter's features), no recalled pages, extra keys or sink re-anchoring (engine/steps._row_step checks those);
  - every session's K/V in a plain fp32 slab store (kv/stores.SlabStore), keys read as its first N slots.
The rest (a paged session's rows, whose keys kv/paged.py chooses per query and layer; sink re-anchoring) run the
same C++ code in segments (`NativeSegments`, engine/steps._forward_plain's runner): each layer's norm, q/k/v
projection and RoPE, then the caller's attention, then the output projection and MLP, as one call each.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pathlib
import platform
import threading
import time

import numpy as np
import torch

from inference_engine.backends.torch import hugepages

log = logging.getLogger("kakeya")

LINEAR_KINDS = ("wqkv", "wo", "w_gate_up", "w_down")
# the int4 kernel's activations in the layers by default: two int8 planes (~16 bits): 99.34 % top-1 agreement with
# fp32 on SmolLM2, the >= 99 % gate issue 28 keeps for the CPU kernels. `--activations int8` (planes=1) takes one
# plane with OUTLIERS outlier channels per linear (outlier_channels) taken out and added exactly: 98.83 %, under the
# gate but above llama.cpp's 97.70 % on the same GGUF and positions (its Q8 activations), each extra row's matmuls
# ~22 % cheaper (results/research/native_step_llama_cpp_quality_avx2.json, verify_split_avx2.json). It was the
# default from 13f9de2 to 2026-11-29 (twenty-fourth session), against the gate.
PLANES = 2
OUTLIERS = 16
# --activations: the daemon's names for the layers' activation planes
ACTIVATIONS = {"int16": 2, "int8": 1}

SOURCE = pathlib.Path(__file__).with_name("csrc") / "row_step.cpp"
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]
# `--compile auto` keeps its measurement for later starts when the native step took at most this share of the Python
# pieces' step (keep_verdict; 0.30-0.33 on the 2-core AVX2 EPYC: 12.7 vs 41.4 ms)
VERDICT_MARGIN = 0.5
_lock = threading.Lock()
_module = None
_failed: str | None = None
build_seconds: float | None = None  # the last build's (or load's) seconds, for logs and benches


def _cpu_key() -> str:
    """The CPU's model and flags (-march=native code runs only where it was built)."""
    model, flags = platform.processor(), ""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}|{flags}"


def build_dir() -> pathlib.Path:
    """$KAKEYA_NATIVE_DIR (benches time a cold start with an empty one) or $KAKEYA_HOME/native, then the key."""
    from inference_engine.model_store.store import kakeya_home

    h = hashlib.sha256(str(SOURCE).encode())  # the build tracks its sources' paths: one build per checkout
    h.update(" ".join(CFLAGS).encode())
    for f in sorted(SOURCE.parent.iterdir()):  # the source and the headers it includes
        h.update(f.name.encode() + f.read_bytes())
    h.update(torch.__version__.encode())
    h.update(_cpu_key().encode())
    root = pathlib.Path(os.environ["KAKEYA_NATIVE_DIR"]) if os.environ.get("KAKEYA_NATIVE_DIR") else kakeya_home() / "native"
    return root / f"row_step-{h.hexdigest()[:16]}"


def load(verbose: bool = False):
    """The built extension module, building it if needed; None if it cannot be built here (the reason is logged)."""
    global _module, _failed, build_seconds
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        if os.environ.get("KAKEYA_NATIVE", "1") == "0":
            _failed = "KAKEYA_NATIVE=0"
            return None
        d = build_dir()
        cached = (d / "kakeya_row_step.so").exists()
        t0 = time.perf_counter()
        try:
            from torch.utils import cpp_extension

            d.mkdir(parents=True, exist_ok=True)
            if not cached:
                log.info("building the native CPU row step (C++, once per machine and torch version) in %s", d)
            with _build_lock(d):
                _module = cpp_extension.load(name="kakeya_row_step", sources=[str(SOURCE)], build_directory=str(d),
                                             extra_cflags=CFLAGS,
                                             extra_ldflags=["-fopenmp"], verbose=verbose)
        except Exception as e:  # no compiler, headers or a failed build: the Python step stays
            _failed = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            log.warning("native CPU row step unavailable (%s); decode steps run in Python", _failed)
            return None
        build_seconds = time.perf_counter() - t0
        log.info("native CPU row step %s in %.1f s", "loaded" if cached else "built", build_seconds)
        return _module


@contextlib.contextmanager
def _build_lock(d: pathlib.Path):
    """Held around a build in d: an flock, which the kernel releases when its holder dies. torch's own build lock (a
    `lock` file in d, waited on while it exists) outlives a process killed mid-build, and every later start then waited
    on it forever; holding the flock, no other process of ours is building in d, so such a file is stale and goes."""
    import fcntl

    with open(d / "build.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # another process building the same key: wait for it (then load its build)
        try:
            stale = d / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build that was killed before it finished", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def unavailable_reason() -> str | None:
    return _failed


def supports(model) -> str | None:
    """Why this model cannot take the native row step, or None if it can."""
    from inference_engine.backends.torch.linear import Int4Linear, Int8Linear

    s = model.spec
    if model.device.type != "cpu":
        return "not on the CPU"
    if not getattr(model, "kernels_row_independent", False):
        return f"{model.weights} weights (the native step needs int8 or int4: row-independent kernels)"
    if s.gemma_norms or s.qk_norm or any(w is not None for w in s.layer_windows) or s.embed_scale != 1.0:
        return "not a plain Llama-family model"
    if set(s.layer_rope) != {"default"} or model.dtype != torch.float32:
        return "rope kinds or dtype"
    if not isinstance(model.act, torch.nn.SiLU) and type(model.act).__name__ not in ("SiLUActivation", "SiLU"):
        return f"activation {type(model.act).__name__}"
    if s.head_dim not in (16, 32, 64, 128) or s.hidden_size % 16:
        return "head_dim must be 16, 32, 64 or 128 and hidden a multiple of 16"
    for L in model.layers:
        for lin in (L.wqkv, L.wo, L.w_gate_up, L.w_down):
            if not isinstance(lin, (Int4Linear, Int8Linear)) or lin.b is not None:
                return "a linear layer with a bias or another format"
    return None


class NativeRowStep:
    """The model's weights handed to the C++ RowStep once; `run(parts)` as backend.row_step.

    int4 linears run through the extension's own int4 kernel (csrc/q4_matmul.h: activations as one int8 plane with outlier
    channels added exactly by default, or two planes; integer dot products, AVX-512 VNNI or AVX2; results/research/
    native_step.json) where the CPU has one, repacked once at start (`q4=False` keeps torch's kernel). The head's
    greedy scoring (linear.RefinedHead, the 4-bit pass before its exact top 64) takes the same kernel with one
    plane."""

    def __init__(self, model, module, *, q4: bool = True, planes: int | tuple[int, int, int, int] | None = None,
                 outliers: int | None = None):
        """planes: the int4 kernel's activation planes in the layers (None: PLANES; 2: ~16 bits; 1: int8), or one
        per matrix kind (wqkv, wo, w_gate_up, w_down). outliers: where a kind takes one plane, that many input
        channels of each linear (`outlier_channels`) taken out of the quantized activations and added exactly
        (None: OUTLIERS; 0: none, one plane alone)."""
        planes = PLANES if planes is None else planes
        outliers = OUTLIERS if outliers is None else outliers
        from inference_engine.backends.torch.linear import Int4Linear, RefinedHead

        s = model.spec
        self.model = model
        self.q4 = bool(q4 and module.q4_isa() > 0)
        kinds, tensors, packed = [], [], []  # packed: where tensors holds the int4 kernel's blocks
        per_kind = (planes,) * 4 if isinstance(planes, int) else tuple(planes)
        if len(per_kind) != 4 or any(p not in (1, 2) for p in per_kind):
            raise ValueError(f"planes must be 1, 2 or four of them (wqkv, wo, w_gate_up, w_down), got {planes!r}")
        self.outliers = outliers if self.q4 and 1 in per_kind else 0  # only where a kind takes one plane
        self.planes = planes
        chosen = cached_outlier_channels(model, self.outliers) if self.outliers else {}
        blocks = layer_blocks(module, model) if self.q4 else {}
        for i, L in enumerate(model.layers):
            tensors += [L.ln_in.float().contiguous(), L.ln_post_attn.float().contiguous()]
            for kind, lin, p in zip(LINEAR_KINDS, (L.wqkv, L.wo, L.w_gate_up, L.w_down), per_kind):
                if isinstance(lin, Int4Linear) and self.q4 and p == 1 and (i, kind) in chosen:
                    channels = chosen[i, kind]
                    kinds.append(5)
                    packed.append(len(tensors))
                    tensors += [blocks[i, kind], channels]
                elif isinstance(lin, Int4Linear) and self.q4:
                    kinds.append(3 if p == 2 else 4)
                    packed.append(len(tensors))
                    tensors += [blocks[i, kind], torch.empty(0)]
                elif isinstance(lin, Int4Linear):
                    kinds.append(2)
                    tensors += [lin.packed, lin.scale_zero]
                else:
                    kinds.append(1)
                    tensors += [lin.q, lin.scales]
        tensors.append(model.final_norm_weight.float().contiguous())
        # the int4 kernel's blocks (made here, streamed once a step) in one map with huge pages where the OS gives them
        self.arena = None
        if packed:
            self.arena = hugepages.Arena([tensors[i] for i in packed])
            for i, v in zip(packed, self.arena.views):
                tensors[i] = v
        down = model.layers[0].w_down
        inter = down.shape[1] if isinstance(down, Int4Linear) else down.q.shape[1]
        scale = s.attn_scale if s.attn_scale is not None else s.head_dim ** -0.5
        self.step = module.RowStep(s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, inter, float(s.rms_eps),
                                   float(scale), kinds, tensors)
        head = model.head
        self.head_arena = None
        if self.q4 and isinstance(head, RefinedHead) and isinstance(head.greedy_approx, Int4Linear):
            rows, n = head.w, head.w.shape[0]
            # the head's 4-bit copy, then its residual (what the kernel's copy leaves of the fp32 rows) in 4 bits
            both = head_blocks(module, model, head)
            self.head_arena = hugepages.Arena([both])
            both = self.head_arena.views[0]
            first = both[: n // 16]
            greedy_refine, refine = min(head.greedy_refine, n), min(head.refine, n)
            # greedy: the copy with one int8 plane (only which 64 candidates the exact rescoring sees depends on it);
            # sampled: the copy with two planes and the residual with one, ~8-bit weights (their logits are used), more
            # exact than torch's int8 kernel with bf16 activations and faster where bf16 is emulated
            # (scripts/research/sampled_head.py)
            head.greedy_kernel = lambda x: module.refined_head(x.float(), first, rows, greedy_refine, 1)
            head.kernel = lambda x: module.refined_head(x.float(), both, rows, refine, 2)
        arenas = [a for a in (self.arena, self.head_arena) if a is not None]
        if arenas:
            log.info("native step: %.1f MB of int4 blocks, %.1f MB of them in huge pages (asked: %s)",
                     sum(a.nbytes for a in arenas) / 2**20, sum(a.huge_bytes() for a in arenas) / 2**20, arenas[0].huge)
        from inference_engine.kv import paged_store

        # the page choice's one-pass scoring of compact keys (kv/paged_store measures whether it is the fastest path)
        paged_store.set_score_kernel(module.group_max_scores, module.score_q8)
        paged_store.set_row_quant_kernel(module.row_quant8_into)  # a decode step's archived key row, in one call
        rotary = model.rotary
        # paged recall past the trained context turns queries by RoPE in C++: plain rotary tables only
        plain = getattr(rotary, "attention_scaling", 1.0) == 1.0 and getattr(rotary, "rope_type", "default") == "default"
        self.inv_freq = rotary.inv_freq.float().contiguous() if plain and hasattr(rotary, "inv_freq") else None
        self.steps = 0  # whole steps run natively (reported)
        self.segment_steps = 0  # steps whose dense work ran in C++ segments (NativeSegments)
        self.paged_steps = 0  # whole steps that recalled pages (paged decode steps)
        # how a paged session's steps recall (research scripts compare them): "whole" (a decode step is one
        # whole-step call, recall included), "segments" (layer by layer, the recall in C++: csrc/paged_rows.h),
        # "python" (layer by layer, the recall in kv/paged.py)
        self.paged_recall = "whole"
        self.module = module
        self.prefill = True  # prefill chunks too (model.row_step_takes_prefill); research scripts turn it off

    def run(self, parts: list, capture: tuple = ()) -> tuple[None, torch.Tensor, torch.Tensor | None] | None:
        """parts: per session (ids (T,), layout, store) of a row-exact step; capture: layers whose output (the
        residual stream after them) to keep, in order. Returns (None, hidden (R, hidden), captured): the
        final-normed hidden states of the R rows in order (the caller takes logits from them), the rows' k, v
        written into every layer's slab, and (R, len(capture) * hidden) or None; or None: not a step for it (the
        Python pieces run it)."""
        paged_sessions, paged_views = [], []
        for i, (_, layout, store) in enumerate(parts):
            if not plain_slab(layout, store):
                return None
            if layout.recall is not None:  # a paged decode step (kv/paged.py recall_hook): its rows recall in C++
                view = self._paged_view(layout.recall, layout) if self.paged_recall == "whole" else None
                if view is None:
                    return None
                paged_sessions.append(i)
                paged_views.append(view)
        m = self.model
        n_max = max(layout.key_positions.numel() for _, layout, _ in parts)
        rows = sum(layout.positions.numel() for _, layout, _ in parts)
        mask = np.zeros((rows, n_max), dtype=bool)
        meta = np.empty((3, rows), dtype=np.int64)  # session, slot, keys
        r = 0
        for i, (_, layout, _) in enumerate(parts):
            t, hm = layout.positions.numel(), layout.host_masks[None]
            mask[r:r + t, :hm.shape[1]] = hm
            meta[0, r:r + t] = i
            meta[1, r:r + t] = layout.host_slots
            meta[2, r:r + t] = layout.key_positions.numel()
            r += t
        if len(parts) == 1:
            ids, positions = parts[0][0], parts[0][1].positions
        else:
            ids = torch.cat([p[0] for p in parts])
            positions = torch.cat([p[1].positions for p in parts])
        cos, sin = m.rope(positions).tables["default"]
        x = m.embed_ids(ids)
        meta_t = torch.from_numpy(meta)
        hidden, captured = self.step.run(x, cos[0], sin[0], [store.k for _, _, store in parts],
                                         [store.v for _, _, store in parts], meta_t[0], meta_t[1], torch.from_numpy(mask),
                                         meta_t[2], list(capture), paged_sessions, paged_views)
        self.steps += 1
        self.paged_steps += bool(paged_sessions)
        return None, hidden, (captured if capture else None)

    def attend_rows(self, layer: int, q: torch.Tensor, store, layout, rows: list[int]) -> torch.Tensor | None:
        """Rows `rows` of a step (q (H, len(rows), D)) attending to the session's slab as the whole-step call attends
        them: (H, len(rows), D); None where that call would not take the step (not plain_slab)."""
        if not plain_slab(layout, store):
            return None
        mask, n_keys = _row_masks(layout, rows)
        keys = torch.full((len(rows),), n_keys, dtype=torch.long)
        return self.step.attend_rows(q.float(), store.k[layer], store.v[layer], mask, keys)

    def attend_recalled(self, layer: int, qj: torch.Tensor, kr: torch.Tensor, vr: torch.Tensor, bias_r, store, layout,
                        j: int) -> torch.Tensor | None:
        """Row j of a paged step (qj: its H query rows) over its recalled rows kr, vr (Hkv, E, D) (bias_r: None or an
        additive 0 / -inf mask broadcastable to (Hkv, E)) and its session's slab as the whole-step call masks that row:
        (H, D); None where that call would not take the step (not plain_slab)."""
        if not plain_slab(layout, store):
            return None
        hkv, e = kr.shape[0], kr.shape[1]
        mask_r = (torch.ones(hkv, e, dtype=torch.bool) if bias_r is None
                  else (bias_r.reshape(-1, e) == 0).expand(hkv, e))
        mask, n_keys = _row_masks(layout, j)
        return self.step.attend_recalled(qj.reshape(-1, qj.shape[-1]).float(), kr.float(), vr.float(), mask_r,
                                         store.k[layer], store.v[layer], mask, n_keys)

    def paged_rows(self, layer: int, q: torch.Tensor, view: dict, fresh: list, store, layout) -> torch.Tensor | None:
        """A paged session's rows (q (H, T, D)) at `layer`, each as the one-token step at its position: page choice,
        page reads and attention in one call (csrc/paged_rows.h) over the tables kv/paged.py's `_native_view` hands
        over -> (H, T, D); None where the whole-step call would not take the step (not plain_slab) or the rotary is not
        plain RoPE."""
        pv = self._paged_view(view, layout) if plain_slab(layout, store) else None
        if pv is None:
            return None
        return self.step.paged_rows(layer, q.float(), pv, fresh, store.k[layer], store.v[layer])

    def _paged_view(self, view: dict, layout):
        """The extension's PagedView of kv/paged.py's step view (made once a step, kept in it); None without plain
        RoPE."""
        if self.inv_freq is None:
            return None
        if "pv" not in view:  # each row's position, candidates and slab keys; its visible slab columns
            t = len(view["positions"])
            mask, n_keys = _row_masks(layout, list(range(t)))
            rows = np.stack([view["positions"], view["candidates"], np.full(t, n_keys)], 1).astype(np.int64)
            view["pv"] = self.module.PagedView(view["tables"], view["meta"], torch.from_numpy(rows), mask, view["sink_cols"],
                                               self.inv_freq)
        return view["pv"]

    def segments(self, rows: int) -> "NativeSegments":
        """A runner of one step's dense work in C++ segments, attention left to the caller (engine/steps)."""
        return NativeSegments(self)


class NativeSegments:
    """engine/steps._forward_plain's runner (the interface of graphs._Runner) over the C++ step's own pieces:
    `start` embeds and returns layer 0's (q, q before RoPE, k, v); `advance(i, o)` takes layer i's attention
    output and returns the residual stream after layer i and layer i+1's (q, q before RoPE, k, v), or after
    the last layer (x, final-normed hidden). Every tensor is new (a kept residual stream is never written)."""

    def __init__(self, native: NativeRowStep):
        self.native, self.layers = native, native.model.spec.num_layers

    def start(self, ids: torch.Tensor, rope) -> tuple:
        cos, sin = rope.tables["default"]
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        self.x = self.native.model.embed_ids(ids).float().contiguous()
        self.native.segment_steps += 1
        return self.native.step.layer_qkv(0, self.x, self.cos, self.sin)

    def advance(self, layer: int, o: torch.Tensor):
        step = self.native.step
        self.x = step.layer_finish(layer, self.x, o.float())
        if layer + 1 == self.layers:
            x, self.x = self.x, None
            return x, step.final_hidden(x)
        return self.x, step.layer_qkv(layer + 1, self.x, self.cos, self.sin)


def _row_masks(layout, rows) -> tuple[torch.Tensor, int]:
    """The visible-column masks of a step's rows (an index or a list of them) and the key count, as run() builds them."""
    hm = layout.host_masks[None]
    return torch.from_numpy(np.ascontiguousarray(hm[rows])), min(hm.shape[1], layout.key_positions.numel())


def plain_slab(layout, store) -> bool:
    """A session's step the whole-step call takes: K/V in a plain fp32 (or fp16: HalfSlabStore) slab store, keys read
    as its first N slots."""
    from inference_engine.kv.stores import HalfSlabStore, SlabStore

    return not (type(store) not in (SlabStore, HalfSlabStore) or layout.key_slots is not None or layout.whole_rows
                or layout.host_masks is None or None not in layout.host_masks or layout.host_slots is None
                or not store.k or store.k[0].dtype not in (torch.float32, torch.float16))


def q4_pack(module, lin) -> torch.Tensor:
    """An Int4Linear's codes and groups (w = (q - 8) * scale + zero = q * d + m) as the extension's q4x16 blocks."""
    d = lin.scale.float()
    return module.q4_pack(lin.codes().to(torch.uint8).contiguous(), d, lin.zero.float() - 8 * d)


def q4_weights(lin) -> torch.Tensor:
    """The fp32 matrix (N, K) q4_pack's blocks compute with: q * d + m, d and m rounded to fp16 as the blocks hold
    them."""
    from inference_engine.backends.torch.linear import GROUP

    n, k = lin.shape
    d = lin.scale.float()
    d16, m16 = d.half().float(), (lin.zero.float() - 8 * d).half().float()
    return (lin.codes().float().view(n, k // GROUP, GROUP) * d16[..., None] + m16[..., None]).view(n, k)


def outlier_channels(model, count: int, *, tokens: int = 256, seed: int = 0) -> dict[tuple[int, str], torch.Tensor]:
    """Each int4 linear's `count` input channels with the largest |activation| (sorted, int64), from the model's own
    Python pieces run over `tokens` seeded random token ids: {(layer, kind): channels}. Random ids, not text, so no
    tokenizer or data is needed; the channels a model's outliers sit in are mostly the same whatever it reads (for
    SmolLM2, one plane with 16 channels chosen this way: 98.83 % top-1 agreement with fp32 against one plane
    alone's 98.40 %, still under the 99 % gate: scripts/research/native_step.py --outliers 16 ->
    results/research/native_step_outliers_avx2.json)."""
    from inference_engine.backends.torch.linear import Int4Linear
    from inference_engine.engine.steps import forward
    from inference_engine.kv.factory import make_cache
    from inference_engine.kv.strategy import KVStrategy

    peaks: dict[tuple[int, str], torch.Tensor] = {}

    class Recorder:
        def __init__(self, key, lin):
            self.key, self.lin = key, lin

        def __call__(self, x):
            a = x.detach().float().abs().amax(0)
            peaks[self.key] = torch.maximum(peaks[self.key], a) if self.key in peaks else a
            return self.lin(x)

    saved_step = model.native_step
    model.native_step = None  # the Python pieces call the linears below
    wrapped = []
    try:
        for i, L in enumerate(model.layers):
            for kind in LINEAR_KINDS:
                lin = getattr(L, kind)
                if isinstance(lin, Int4Linear) and lin.shape[1] >= count:
                    setattr(L, kind, Recorder((i, kind), lin))
                    wrapped.append((L, kind, lin))
        if wrapped:
            gen = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, model.spec.vocab_size, (tokens,), generator=gen)
            cache = make_cache(KVStrategy("full"), model.geometry(), max_step=tokens, max_context=model.spec.max_context)
            with torch.inference_mode():
                forward(model, ids, range(tokens), cache)
    finally:
        for L, kind, lin in wrapped:
            setattr(L, kind, lin)
        model.native_step = saved_step
    return {key: torch.sort(torch.topk(a, count).indices).values.to(torch.int64).contiguous() for key, a in peaks.items()}


def cached_outlier_channels(model, count: int) -> dict[tuple[int, str], torch.Tensor]:
    """outlier_channels, kept next to a pulled model (`.kakeya-outliers-<weights>.json`, packed.load_derived): made
    once (a few seconds of the Python pieces at a daemon start), read after."""
    from inference_engine.backends.torch import packed

    path = getattr(model, "path", None)
    data = packed.load_derived(path, "outliers", model.weights_format) if path is not None else None
    if data is not None and str(count) in data:
        return {(int(i), kind): torch.tensor(ch, dtype=torch.int64)
                for key, ch in data[str(count)].items() for i, kind in [key.split(".", 1)]}
    t0 = time.perf_counter()
    chosen = outlier_channels(model, count)
    log.info("outlier channels: %d per linear chosen in %.1f s", count, time.perf_counter() - t0)
    if path is not None:
        packed.save_derived(path, "outliers", model.weights_format,
                            (data or {}) | {str(count): {f"{i}.{kind}": ch.tolist() for (i, kind), ch in chosen.items()}})
    return chosen


def _verdict_key(model, threads: int | None) -> str:
    step = model.native_step
    return f"{build_dir().name}|threads={threads}|planes={step.planes}|outliers={step.outliers}"


def kept_verdict(model, threads: int | None) -> dict[str, float] | None:
    """`--compile auto`'s measurement of an earlier start on this machine (keep_verdict), when it found the native step
    decisively faster for this model file, weight format, extension build (CPU included), thread count and
    activations; else None (measure now)."""
    from inference_engine.backends.torch import packed

    path = getattr(model, "path", None)
    data = packed.load_derived(path, "compile-auto", model.weights_format) if path is not None else None
    return (data or {}).get(_verdict_key(model, threads))


def keep_verdict(model, threads: int | None, med: dict[str, float]) -> bool:
    """Keep a measurement for the next start when it is decisive (the native step at most half the Python pieces'
    median step: no later start on this machine would measure the other way), never a close or a losing one (those
    are measured at every start). Whether it was kept."""
    from inference_engine.backends.torch import packed

    path = getattr(model, "path", None)
    if path is None or not med["native"] <= VERDICT_MARGIN * med["python"]:
        return False
    data = packed.load_derived(path, "compile-auto", model.weights_format) or {}
    packed.save_derived(path, "compile-auto", model.weights_format,
                        data | {_verdict_key(model, threads): {k: float(v) for k, v in med.items()}})
    return True


def _derived_extra() -> str:
    """What the native step's files next to the model depend on beside the model: this extension build and the Python
    that makes them."""
    return build_dir().name + ":" + hashlib.sha256(b"".join(
        pathlib.Path(__file__).with_name(f).read_bytes() for f in ("native.py", "linear.py"))).hexdigest()[:16]


def layer_blocks(module, model) -> dict[tuple[int, str], torch.Tensor]:
    """The layers' int4 linears as the kernel's blocks (q4_pack), per (layer, kind): kept next to a pulled model
    (`.kakeya-native-layers-<weights>-<tag>.safetensors`, packed.load_derived_tensors) as the head's are (head_blocks),
    since reading the linears' codes and packing them took ~0.3 s of every start on the 2-core box; made and written
    on a miss (the same bytes either way: q4_pack is a function of the model's weights)."""
    from inference_engine.backends.torch import packed
    from inference_engine.backends.torch.linear import Int4Linear

    lins = {(i, kind): lin for i, L in enumerate(model.layers) for kind, lin in zip(LINEAR_KINDS, (L.wqkv, L.wo, L.w_gate_up, L.w_down))
            if isinstance(lin, Int4Linear)}
    path, extra = getattr(model, "path", None), _derived_extra()
    if path is not None and lins:
        cached = packed.load_derived_tensors(path, "native-layers", model.weights_format, extra)
        if cached is not None and set(cached) == {f"{i}.{kind}" for i, kind in lins}:
            return {(i, kind): cached[f"{i}.{kind}"] for i, kind in lins}
    blocks = {key: q4_pack(module, lin) for key, lin in lins.items()}
    if path is not None and lins:
        packed.save_derived_tensors(path, "native-layers", model.weights_format, extra,
                                    {f"{i}.{kind}": b for (i, kind), b in blocks.items()})
    return blocks


def head_blocks(module, model, head) -> torch.Tensor:
    """The head's 4-bit copy's blocks, then its residual's (q4_pack_residual), as one tensor: kept next to a pulled
    model (`.kakeya-native-head-<weights>-<tag>.safetensors`, packed.load_derived_tensor) for the model files, this
    extension build and the Python that makes them, since the residual's quantization took most of the native step's
    start (1.35 of its 1.73 s on the loaded 2-core box); made and written on a miss."""
    from inference_engine.backends.torch import packed

    path = getattr(model, "path", None)
    extra = _derived_extra()
    if path is not None:
        cached = packed.load_derived_tensor(path, "native-head", model.weights_format, extra)
        if cached is not None:
            return cached
    both = torch.cat([q4_pack(module, head.greedy_approx), q4_pack_residual(module, head.w, head.greedy_approx)])
    if path is not None:
        packed.save_derived_tensor(path, "native-head", model.weights_format, extra, both)
    return both


def q4_pack_residual(module, w: torch.Tensor, lin) -> torch.Tensor:
    """What the kernel's copy of `lin` (q4_pack: d and m as fp16) leaves of the fp32 matrix w, quantized as Q4_1 and
    packed the same way: scored beside lin's blocks and summed, ~8-bit weights."""
    from inference_engine.backends.torch.linear import quantize_q4_1

    q, dr, mr = quantize_q4_1(w.float() - q4_weights(lin))
    return module.q4_pack(q.to(torch.uint8).contiguous(), dr.float(), mr.float())


def main() -> int:
    """Build (or load) the extension now and say where and how long: `make setup` runs this."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mod = load(verbose=False)
    if mod is None:
        print(f"native CPU row step: not built ({_failed}); the Python step is used")
        return 0
    print(f"native CPU row step ready in {build_dir()} ({build_seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
