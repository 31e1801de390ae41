"""Decoder-only transformer weights and layer pieces on torch (Llama, Mistral, Qwen2/3, Gemma 3).

safetensors (checkpoint.py, where it reads the config completely) or transformers loads the weights, and
transformers is the reference oracle in tests; the hot path is these pieces, driven by the engine's layer loop
(engine/steps.py): batch 1, fused QKV and gate/up projections, SDPA with masks from the cache layout. Stateless:
per-session state is in caches.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from inference_engine.backends.spec import ModelSpec, spec_from_config
from inference_engine.backends.torch.attention import attend_decode_batch, attend_layout, rotate_keys
from inference_engine.backends.torch.linear import (
    DequantizedLinear, WEIGHT_FORMATS, DenseLinear, Int4Linear, Int8Linear, Linear, RefinedHead, make_linear,
)
from inference_engine.kv.layout import CacheGeometry

log = logging.getLogger("kakeya")

LOADERS = ("auto", "transformers")  # --loader (TorchCausalLM.load)
# a layer's linears: (attribute, the checkpoint weights stacked into it, after "model.layers.{i}."); the first name is
# its name in the packed file
LAYER_LINEARS = (("wqkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
                 ("wo", ("self_attn.o_proj.weight",)),
                 ("w_gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
                 ("w_down", ("mlp.down_proj.weight",)))

if TYPE_CHECKING:
    from inference_engine.backends.torch.graphs import StepGraphs
    from inference_engine.backends.torch.native import NativeRowStep
    from inference_engine.backends.torch.row_graphs import RowGraphs


class _Layer:
    __slots__ = ("wqkv", "wo", "w_gate_up", "w_down", "ln_in", "ln_post_attn", "ln_pre_ff", "ln_post_ff", "q_norm", "k_norm")
    wqkv: Linear
    wo: Linear
    w_gate_up: Linear
    w_down: Linear
    ln_in: torch.Tensor
    ln_post_attn: torch.Tensor
    ln_pre_ff: torch.Tensor | None  # Gemma's extra norms only
    ln_post_ff: torch.Tensor | None
    q_norm: torch.Tensor | None  # qk_norm models only
    k_norm: torch.Tensor | None


class _Deferred:
    """A quantized linear TorchCausalLM.defer_fallback dropped: any use reads every dropped one back first."""

    __slots__ = ("_model", "_slot", "nbytes")

    def __init__(self, model: "TorchCausalLM", slot: tuple, nbytes: int):
        self._model, self._slot, self.nbytes = model, slot, nbytes

    def _real(self):
        self._model.restore_fallback()
        return self._model._get_slot(self._slot)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._real()(x)

    def __getattr__(self, name: str):
        return getattr(self._real(), name)


class Rope:
    """cos/sin tables per rope kind for a set of positions: each (1, T, D)."""

    def __init__(self, tables: dict):
        self.tables = tables

    def for_layer(self, spec: ModelSpec, layer: int):
        return self.tables[spec.layer_rope[layer]]

    def select(self, idx) -> "Rope":
        """The tables at a subset (index tensor or slice) of the positions."""
        return Rope({k: (c[:, idx], s[:, idx]) for k, (c, s) in self.tables.items()})


class TorchCausalLM:
    """Weights + layer pieces of one causal LM: the torch member of the Backend protocol."""

    backend_name = "torch"

    def __init__(self, tensors: dict, rotary, act, spec: ModelSpec, model_id: str, *, weights: str = "fp32",
                 blocks: dict | None = None, packed=None):
        """tensors: the checkpoint's weights by HF name (`lm_head.weight` included, tied or not), all in one dtype on
        one device; rotary: (probe, position_ids[, rope kind]) -> cos, sin tables; act: the MLP's activation;
        weights: fp32 | int8 | int4 (linear.py); blocks: the GGUF's Q4_1 blocks by HF weight name,
        used by int4 instead of quantizing the fp32 weights again; packed: a packed.PackedWeights holding the
        quantized linears of an earlier load (used, and filled with what is packed now)."""
        self._packed = packed
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight format {weights!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
        self.path: pathlib.Path | None = None  # set by load(); tokenizer files live there
        self.spec = spec
        self.model_id = model_id
        self.weights = weights
        self.loader = "transformers"  # or "safetensors" (checkpoint.py): set by load()
        t = tensors
        self.device = t["model.embed_tokens.weight"].device
        self.dtype = t["model.embed_tokens.weight"].dtype
        blocks = blocks or {}
        self.final_norm_weight = self._norm_weight(t["model.norm.weight"])
        self.rotary = rotary
        self.act = act
        head_w = t["lm_head.weight"].detach()
        self._embed_w = t["model.embed_tokens.weight"].detach()
        # quantized formats: int8 scoring, exact fp32 for the top candidates (linear.RefinedHead);
        # off the CPU the weight-only kernels are missing: quantized linears run dequantized in bf16
        self.kernels_row_independent = weights != "fp32" and self.device.type == "cpu"
        self.head = RefinedHead(head_w, packed=packed) if self.kernels_row_independent else DenseLinear(head_w)
        self.layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            L = _Layer()
            qkv_bias = [t.get(a + f"{n}_proj.bias") for n in "qkv"]
            for attr, names in LAYER_LINEARS:
                bias = (torch.cat([b for b in qkv_bias if b is not None]).detach()
                        if attr == "wqkv" and qkv_bias[0] is not None else None)
                setattr(L, attr, self._linear(weights, blocks, [p + n for n in names], t, bias))
            L.ln_in = self._norm_weight(t[p + "input_layernorm.weight"])
            L.ln_post_attn = self._norm_weight(t[p + "post_attention_layernorm.weight"])
            L.ln_pre_ff = self._norm_weight(t[p + "pre_feedforward_layernorm.weight"]) if spec.gemma_norms else None
            L.ln_post_ff = self._norm_weight(t[p + "post_feedforward_layernorm.weight"]) if spec.gemma_norms else None
            L.q_norm = self._norm_weight(t[a + "q_norm.weight"]) if spec.qk_norm else None
            L.k_norm = self._norm_weight(t[a + "k_norm.weight"]) if spec.qk_norm else None
            self.layers.append(L)
        self.graphs: StepGraphs | None = None  # StepGraphs when the step runs as captured graphs (use_step_graphs)
        self.row_graphs: RowGraphs | None = None  # whole row steps as graphs over a K/V arena (use_row_graphs)
        self.native_step: NativeRowStep | None = None  # CPU row steps in C++ (use_native_step)
        self._packed_key: str | None = None  # the packed file's key (load), for defer_fallback
        self._deferred: dict | None = None  # defer_fallback's dropped linears: slot -> (packed name, kind, bias)
        self._packed_file: Any = None  # the packed file kept open while linears are deferred

    def use_step_graphs(self, mode: str, *, planes: int | None = None) -> bool:
        """--compile: the step's dense work (everything but attention) as graphs.py segments.
        off: every piece launched eagerly. on: CUDA captures the segments as CUDA graphs; the CPU runs
        them compiled by inductor (C++), cached under $KAKEYA_HOME/inductor. auto: on where it measures
        faster, which is CUDA (scripts/gpu_check.py); on the CPU inductor's segments measured no faster
        than eager ones (results/research/compile_cpu.json), so auto is eager there, with the native row step
        (its int4 kernel's activations as `planes` int8 planes: use_native_step). Returns whether segments are
        used."""
        if mode not in ("off", "auto", "on"):
            raise ValueError(f"--compile must be off, auto or on, got {mode!r}")
        from inference_engine.backends.torch.graphs import StepGraphs

        on_cuda = self.device.type == "cuda"
        self.use_native_step(False)
        if mode == "auto" and not on_cuda:
            self.use_native_step(planes=planes)
        if mode == "off" or (mode == "auto" and not on_cuda):
            self.graphs = None
        elif on_cuda:
            self.graphs = StepGraphs(self, capture=True)
        else:
            from inference_engine.model_store.store import kakeya_home

            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(kakeya_home() / "inductor"))
            self.graphs = StepGraphs(self, capture=False, compiled=True)
        return self.graphs is not None

    def use_row_graphs(self, sessions: int, *, capture: bool | None = None, compiled: bool = False,
                       memory_share: float = 0.5, fallback: bool = False) -> int:
        """Decode rows and verify blocks as whole-step graphs (row_graphs.py) over a K/V arena of `sessions`
        slots of max_context rows (arena.py): every cache built from geometry() after this keeps its rows
        there while a slot is free. On CUDA at most `memory_share` of the free device memory goes to the
        arena (fewer slots if need be); capture: CUDA graphs (default: on CUDA), else the same body runs
        eagerly (the CPU, tests); compiled: the dense work between attentions as inductor's fused kernels
        (graphs.Segments, compiled once per bucket of rows; --compile on, and auto where triton is present);
        fallback: a failed compile goes on with eager pieces (auto). Returns the slots made (0: none, the step
        stays piecewise)."""
        from inference_engine.backends.torch.arena import KVArena
        from inference_engine.backends.torch.row_graphs import RowGraphs

        s = self.spec
        if any(w is not None for w in s.layer_windows):  # one mask per step: every layer global
            log.info("row graphs off: %s has sliding-window layers", self.model_id)
            return 0
        rows = s.max_context
        per_slot = 2 * s.num_layers * s.num_kv_heads * rows * s.head_dim * torch.finfo(self.dtype).bits // 8
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            sessions = min(sessions, int(free * memory_share) // per_slot - 1)
        if sessions < 1:
            log.info("row graphs off: no room for a K/V arena slot of %.0f MB", per_slot / 1e6)
            return 0
        capture = self.device.type == "cuda" if capture is None else capture
        arena = KVArena(s.num_layers, s.num_kv_heads, s.head_dim, sessions=sessions, rows=rows, dtype=self.dtype,
                        device=self.device)
        if compiled:
            from inference_engine.model_store.store import kakeya_home

            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(kakeya_home() / "inductor"))
        self.row_graphs = RowGraphs(self, arena, capture=capture, compiled=compiled, fallback=fallback)
        log.info("row graphs on: a K/V arena of %d sessions x %d rows (%.2f GB) on %s; steps %s%s", sessions, rows,
                 arena.nbytes / 1e9, self.device, "captured as CUDA graphs" if capture else "eager",
                 ", dense work compiled by inductor (per bucket of rows, on first use)" if compiled else "")
        return sessions

    def use_native_step(self, on: bool = True, *, q4: bool = True, planes: int | tuple[int, int, int, int] | None = None,
                        outliers: int | None = None) -> bool:
        """CPU row steps (decode rows, verify blocks over plain fp32 slabs) through the C++ extension
        (csrc/row_step.cpp), built on first use and cached; False (logged) where the model or the machine
        cannot take it: the Python pieces run every step then. q4: int4 linears (and the head's greedy scoring)
        through the extension's int4 kernel where the CPU has one (native.NativeRowStep): activations as `planes`
        int8 planes (1 or 2, or one per matrix kind; None: native.PLANES), with `outliers` outlier channels added
        exactly where one (None: native.OUTLIERS; 0: none). on=False: off."""
        from inference_engine.backends.torch import native

        self.restore_fallback()
        if isinstance(self.head, RefinedHead):
            self.head.greedy_kernel = self.head.kernel = None
        self.native_step = None
        if not on:
            return False
        why = native.supports(self)
        mod = native.load() if why is None else None
        if mod is None:
            log.info("native CPU row step off: %s", why or native.unavailable_reason())
            return False
        self.native_step = native.NativeRowStep(self, mod, q4=q4, planes=planes, outliers=outliers)
        log.info("native CPU row step on: decode rows and verify blocks run every layer in one C++ call%s",
                 "; int4 matmuls through its own int4 kernel" if self.native_step.q4 else "")
        return True

    def defer_fallback(self) -> bool:
        """Drop the quantized linears' and the head's torch copies while the native step runs every step with its own
        copies (its int4 arenas): in the daemon's configurations no step reaches them after start-up, and they are a
        whole copy of the packed file (SmolLM2 int4: ~190 MB). The first step that does (a configuration the native
        step declines) reads them back from the packed file, kept open for it, the same bytes (restore_fallback).
        Only when every layer's linears are in the native step's own int4 arena (int8 layers and torch's int4 path
        pass torch's tensors to it) and the packed file holds them all. Returns whether they were dropped."""
        from inference_engine.backends.torch import packed

        ns = self.native_step
        if (ns is None or not ns.q4 or self._deferred is not None or self.path is None or self._packed_key is None
                or not isinstance(self.head, RefinedHead) or self.head.greedy_kernel is None):
            return False
        slots: dict = {}
        for i, L in enumerate(self.layers):
            for attr, names in LAYER_LINEARS:
                lin = getattr(L, attr)
                if not isinstance(lin, Int4Linear):
                    return False
                slots[(i, attr)] = (f"model.layers.{i}.{names[0]}", Int4Linear, lin.b, lin.nbytes)
        for attr, name, kind in (("approx", "head.int8", Int8Linear), ("greedy_approx", "head.int4", Int4Linear)):
            lin = getattr(self.head, attr)
            if lin is not None:
                slots[("head", attr)] = (name, kind, None, lin.nbytes)
        f = packed.open_holding(self.path / f".kakeya-packed-{self.weights}.safetensors", self._packed_key,
                                [v[0] for v in slots.values()])
        if f is None:
            return False
        self._packed_file, self._deferred = f, slots
        for slot, (_, _, _, nbytes) in slots.items():
            self._set_slot(slot, _Deferred(self, slot, nbytes))
        log.info("the torch copies of the quantized linears dropped (%.0f MB): the native step has its own; read back "
                 "from %s if a step needs them", sum(v[3] for v in slots.values()) / 2**20, f.name)
        return True

    def restore_fallback(self) -> None:
        """Read the linears defer_fallback dropped back from the packed file (all at once)."""
        if self._deferred is None:
            return
        from inference_engine.backends.torch import packed

        f, key = self._packed_file, self._packed_key
        assert f is not None and key is not None  # set together with _deferred
        loaded = packed.reread(f, key)
        for slot, (name, kind, bias, _) in self._deferred.items():
            self._set_slot(slot, kind.from_state(packed.state_of(loaded, name), bias))
        f.close()
        self._deferred = self._packed_file = None
        log.info("the torch copies of the quantized linears read back (a step the native step does not take)")

    def _set_slot(self, slot, lin) -> None:
        setattr(self.head if slot[0] == "head" else self.layers[slot[0]], slot[1], lin)

    def _get_slot(self, slot):
        return getattr(self.head if slot[0] == "head" else self.layers[slot[0]], slot[1])

    def row_step(self, parts: list, capture: tuple = ()):
        """A row-exact step (parts: per session (ids, layout, store)) through the row graphs or the native CPU
        step, or None (not for them). Returns (logits or None, hidden, captured or None): None logits = the caller
        takes them; captured: the `capture` layers' outputs (row_step_captures)."""
        if self.row_graphs is not None:
            out = self.row_graphs.run(parts)
            return None if out is None else (*out, None)
        return self.native_step.run(parts, capture) if self.native_step is not None else None

    @property
    def resident_rows_attention(self):
        """kv/paged.py's rows that recall nothing attend through this (layer, q (H, T, D), store, layout, rows) ->
        (H, T, D) or None (not a plain slab: the pieces' call): the native whole-step call's attention, so such a row
        in a verify block equals the one-token step at its position, which that call takes. None when there is no
        native step (the pieces' call on both sides; CUDA's row graphs keep paged steps off them altogether)."""
        return self.native_step.attend_rows if self.native_step is not None and self.row_graphs is None else None

    @property
    def recalled_row_attention(self):
        """kv/paged.py's rows that recall pages (below the trained context) attend through this (layer, qj, kr, vr,
        bias_r, store, layout, j) -> (H, D) or None (not a plain slab: torch's two-part call): the native step's
        attention code over the recalled rows and the slab, one softmax. None when there is no native step."""
        return self.native_step.attend_recalled if self.native_step is not None and self.row_graphs is None else None

    @property
    def paged_row_attention(self):
        """kv/paged.py's rows (decode, verify, prefill chunks) take their page choice, page reads and attention
        through this (layer, q (H, T, D), view, fresh, store, layout) -> (H, T, D) or None (not a plain slab: the
        Python path): the native step's `paged_rows`. None when there is no native step."""
        native = self.native_step
        return native.paged_rows if native is not None and self.row_graphs is None and native.paged_recall != "python" else None

    @property
    def row_step_captures(self) -> bool:
        """The row step keeps captured layers (StepInput.capture) itself: the native CPU step does."""
        return self.row_graphs is None and self.native_step is not None

    @property
    def row_step_takes_prefill(self) -> bool:
        """Prefill chunks go through the row step too (engine/steps._row_eligible): the native CPU step's rows
        are independent by construction and its int4 kernel is faster than torch's for any number of rows
        (results/research/native_prefill.json); CUDA's row graphs are captured for small row counts only."""
        return self.native_step is not None and self.native_step.prefill

    @property
    def batches_decode_attention(self) -> bool:
        """Several sessions' decode rows attend in one call (attention.attend_decode_batch) off the CPU;
        on the CPU each session attends alone, so its output stays bit-identical to running alone."""
        return self.device.type != "cpu"

    def attend_decode_batch(self, layer: int, q, kvs, layouts, scratch: dict):
        return attend_decode_batch(self, layer, q, kvs, layouts, scratch)

    def describe_step(self) -> dict:
        """How a step's dense work runs (--compile): eager pieces, or graphs.StepGraphs.describe()."""
        out = {"step": "eager"} if self.graphs is None else self.graphs.describe()
        if self.native_step is not None:
            ns = self.native_step
            kernel = ""
            if ns.q4:
                kernel = ", own int4 kernel (" + (f"one int8 activation plane, {ns.outliers} outlier channels exact"
                                                  if ns.planes == 1 and ns.outliers else f"activation planes {ns.planes}") + ")"
            out |= {"row_step": "native (C++)" + kernel,
                    "native_steps": self.native_step.steps, "native_segment_steps": self.native_step.segment_steps}
        return out | (self.row_graphs.describe() if self.row_graphs is not None else {})

    def step_runner(self, rows: int):
        """The runner of a step of `rows` rows through captured graphs, or the native CPU step's C++ segments (the
        steps its whole-step call does not take: paged recall, sink re-anchoring), or None (the pieces one by one)."""
        if self.graphs is not None:
            return self.graphs.runner(rows)
        return self.native_step.segments(rows) if self.native_step is not None else None

    def _linear(self, fmt: str, blocks: dict, names: list, tensors, bias=None) -> Linear:
        """One (possibly fused) linear layer: rows of the weights `names` stacked, in format `fmt` (quantized on
        the CPU; on another device a quantized format runs as its dequantized bf16 matrix). `tensors` is read only
        when nothing packed has the layer (a checkpoint.LazyTensors reads a weight from its file then)."""
        lin: Linear
        kind: type[Int4Linear] | type[Int8Linear] | None = {"int4": Int4Linear, "int8": Int8Linear}.get(fmt)
        # (a packed file exists for the CPU only: load() makes one there)
        cached = self._packed.lookup(names[0]) if self._packed is not None and kind is not None else None
        if cached is not None and kind is not None:
            return kind.from_state(cached, None if bias is None else bias.cpu())
        if fmt == "int4" and all(n in blocks for n in names):
            q, d, m = (torch.cat(parts) for parts in zip(*(blocks[n] for n in names)))
            lin = Int4Linear.from_blocks(q, d, m, None if bias is None else bias.cpu())
        else:
            w = torch.cat([tensors[n].detach() for n in names]).contiguous()
            lin = make_linear(fmt, w if fmt == "fp32" else w.cpu(), bias if fmt == "fp32" or bias is None else bias.cpu())
        if self._packed is not None and isinstance(lin, (Int4Linear, Int8Linear)):
            self._packed.store(names[0], lin.state())
        return lin if fmt == "fp32" or self.device.type == "cpu" else DequantizedLinear(lin, self.device)

    @classmethod
    def load(cls, path: str | os.PathLike, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
             weights: str = "fp32", loader: str = "auto") -> "TorchCausalLM":
        """loader: auto reads the weights with safetensors where checkpoint.py reads the config completely (the
        common families with the default RoPE; ~5 s less of a daemon start, transformers' imports), and through
        transformers otherwise; transformers: always through transformers' AutoModelForCausalLM."""
        if loader not in LOADERS:
            raise ValueError(f"--loader must be one of {', '.join(LOADERS)}, got {loader!r}")
        path = pathlib.Path(path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a model directory (no config.json); pass a pulled model name or an HF directory")
        read = None
        if loader == "auto":
            from inference_engine.backends.torch.checkpoint import read_checkpoint

            read = read_checkpoint(path, device=device, dtype=dtype)
        if read is not None:
            cfg, tensors, rotary, act = read
            spec = spec_from_config(cfg)
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            hf_cfg = AutoConfig.from_pretrained(path)
            spec = spec_from_config(getattr(hf_cfg, "text_config", hf_cfg))
            # transformers declares PreTrainedModel.to as @wraps(torch.nn.Module.to), which mypy reads as unbound
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
            inner = hf.model
            tensors = {"model." + k: v for k, v in inner.named_parameters()} | {"lm_head.weight": hf.lm_head.weight}
            rotary, act = inner.rotary_emb, inner.layers[0].mlp.act_fn
        meta = path / "kakeya_model.json"
        model_id = json.loads(meta.read_text()).get("name", path.name) if meta.exists() else path.name
        packed = None
        if weights in ("int8", "int4") and str(device) == "cpu":  # the CPU kernels' packed layouts, kept between loads
            from inference_engine.backends.torch.packed import PackedWeights

            packed = PackedWeights(path, weights)

        def build(packed):
            blocks = None
            if weights == "int4" and (path / "source.gguf").exists() and spec.model_type == "llama" and not (packed and packed.loaded):
                from inference_engine.model_store.gguf_blocks import q4_1_blocks

                blocks = q4_1_blocks(path / "source.gguf", num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads)
            return cls(tensors, rotary, act, spec, model_id, weights=weights, blocks=blocks, packed=packed)

        model = build(packed)
        if packed is not None and packed.loaded and packed.misses:  # a file without every linear: pack them all again
            log.warning("packed weights %s lack %d linear(s): packing again", packed.path, packed.misses)
            packed.discard()
            model = build(packed)
        if packed is not None:
            packed.save()
            model._packed = None  # its tensors are the model's now
            model._packed_key = packed.key
        model.path = path
        model.loader = "safetensors" if read is not None else "transformers"
        log.info("weights of %s read through %s", model_id, model.loader)
        return model

    @property
    def weights_format(self) -> str:
        if self.weights != "fp32":
            return self.weights
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype, str(self.dtype))

    @property
    def embed(self) -> torch.Tensor:
        """The token embedding matrix (V, hidden); drafters share it."""
        return self._embed_w

    @property
    def lm_head(self) -> torch.Tensor:
        """The LM head (V, hidden) in fp32; drafters share it."""
        return self.head.w

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (linear layers + head)."""
        return self.head.nbytes + sum(lin.nbytes for L in self.layers for lin in (L.wqkv, L.wo, L.w_gate_up, L.w_down))

    def geometry(self) -> CacheGeometry:
        s = self.spec
        return CacheGeometry(s.num_layers, s.num_kv_heads, s.head_dim, s.layer_windows, self.dtype, str(self.device),
                             make_store=self.row_graphs.arena.make_store if self.row_graphs is not None else None)

    def tensor(self, values, dtype: str = "long") -> torch.Tensor:
        return torch.tensor(values, dtype=getattr(torch, dtype), device=self.device)

    def cat(self, arrays, dim: int) -> torch.Tensor:
        return torch.cat(arrays, dim)

    # -- layer pieces (Backend protocol) ----------------------------------------------------
    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self._embed_w)
        if self.spec.embed_scale != 1.0:
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        return x

    def rope(self, positions: torch.Tensor) -> Rope:
        pid = positions[None]
        probe = self.final_norm_weight[None]  # rotary only reads its dtype and device
        if self.spec.gemma_norms:
            return Rope({t: self.rotary(probe, pid, t) for t in set(self.spec.layer_rope)})
        return Rope({"default": self.rotary(probe, pid)})

    def project(self, layer: int, x: torch.Tensor):
        """x (T, hidden) -> raw q (H, T, D), k, v (Hkv, T, D): input norm + projections, pre-norm, pre-RoPE."""
        return self.project_layer(self.layers[layer], x)

    def position_q(self, layer: int, q: torch.Tensor, rope: Rope):
        return self.position_q_layer(self.layers[layer], q, *rope.for_layer(self.spec, layer))

    def position_k(self, layer: int, k: torch.Tensor, rope: Rope) -> torch.Tensor:
        return self.position_k_layer(self.layers[layer], k, *rope.for_layer(self.spec, layer))

    # The pieces by layer object rather than index: graphs.py compiles each of its segments once for
    # every layer (the layer's weights are inputs of one graph, not constants of thirty).
    def project_layer(self, L: _Layer, x: torch.Tensor):
        s, t = self.spec, x.shape[0]
        nq, nkv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        qkv = L.wqkv(self.rms(x, L.ln_in))
        q = qkv[:, :nq].view(t, s.num_heads, s.head_dim).transpose(0, 1)
        k = qkv[:, nq:nq + nkv].view(t, s.num_kv_heads, s.head_dim).transpose(0, 1)
        v = qkv[:, nq + nkv:].view(t, s.num_kv_heads, s.head_dim).transpose(0, 1)
        return q, k, v

    def position_q_layer(self, L: _Layer, q: torch.Tensor, cos, sin):
        q_normed = self.rms(q, L.q_norm) if self.spec.qk_norm else q
        return self.rotate(q_normed, cos, sin), q_normed

    def position_k_layer(self, L: _Layer, k: torch.Tensor, cos, sin) -> torch.Tensor:
        if self.spec.qk_norm:
            k = self.rms(k, L.k_norm)
        return self.rotate(k, cos, sin)

    def attend(self, layer: int, q, k, v, mask) -> torch.Tensor:
        s = self.spec
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
                                              scale=s.attn_scale, enable_gqa=True)[0]

    def attend_layout(self, layer: int, q, q_normed, k_all, v_all, layout, extra=None, sink_rope=None) -> torch.Tensor:
        return attend_layout(self, layer, q, q_normed, k_all, v_all, layout, extra, sink_rope)

    def finish(self, layer: int, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Attention output o (H, T, D) -> residual stream after the output projection and MLP."""
        return self.finish_layer(self.layers[layer], x, o)

    def finish_layer(self, L: _Layer, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        s = self.spec
        o = L.wo(o.transpose(0, 1).reshape(x.shape[0], -1))
        if s.gemma_norms:
            x = x + self.rms(o, L.ln_post_attn)
            h = self.rms(x, L.ln_pre_ff)
        else:
            x = x + o
            h = self.rms(x, L.ln_post_attn)
        gu = L.w_gate_up(h)
        inter = gu.shape[-1] // 2
        m = L.w_down(self.act(gu[:, :inter]) * gu[:, inter:])
        return x + (self.rms(m, L.ln_post_ff) if s.gemma_norms else m)

    def inference(self):
        return torch.inference_mode()

    def to_host(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.float().cpu()

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.rms(x, self.final_norm_weight)

    def logits(self, hidden: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        """greedy: the caller only takes the argmax (linear.RefinedHead's 4-bit scoring path)."""
        return (self.head(hidden, greedy=True) if greedy and isinstance(self.head, RefinedHead) else self.head(hidden)).float()

    # -- tensor helpers ----------------------------------------------------------------------
    def _norm_weight(self, w: torch.Tensor) -> torch.Tensor:
        # Gemma stores RMSNorm weights as offsets from 1; fold the offset in once.
        w = w.detach()
        return (1.0 + w.float()).to(w.dtype) if self.spec.gemma_norms else w

    def rms(self, x, w):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.spec.rms_eps)
        return (y * w.float()).to(x.dtype) if self.spec.gemma_norms else w * y.to(x.dtype)

    def rotate_keys(self, layer: int | None, k: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """Positioned keys k (Hkv, E, D) moved by deltas (Hkv, E) positions (paged recall past the trained context);
        layer None: k (L, Hkv, E, D), every layer."""
        return rotate_keys(self, layer, k, deltas)

    @staticmethod
    def rotate(x, cos, sin):
        # x: (H, T, D); cos/sin: (1, T, D)
        h = x.shape[-1] // 2
        rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
        return x * cos + rot * sin
