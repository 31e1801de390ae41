"""Decoder-only transformer weights and layer pieces on MLX (Llama, Mistral, Qwen2/3).

mlx-lm loads the weights (its model classes read the HF safetensors directory); the hot path
is these pieces, driven by the engine's one layer loop (engine/steps.py) over the project's
own caches (kv/, through backends/mlx/store.py). Batch 1, fused QKV and gate/up projections,
`mx.fast.scaled_dot_product_attention` with masks from the cache layout. Sampling stays on the
host: `to_host` hands float32 torch logits to engine/sampling.py, so seeds mean the same on
both backends. Stateless: per-session state is in caches.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys

import mlx.core as mx
import numpy as np
import torch

from inference_engine.backends.mlx.attention import StepLayout, attend_layout
from inference_engine.backends.mlx.linear import DenseLinear, Int4Linear
from inference_engine.backends.mlx.store import make_mlx_store
from inference_engine.backends.spec import ModelSpec, spec_from_config
from inference_engine.kv.layout import CacheGeometry

WEIGHT_FORMATS = ("fp32", "fp16", "int4")
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


class _Layer:
    __slots__ = ("wqkv", "wo", "w_gate_up", "w_down", "ln_in", "ln_post_attn", "q_norm", "k_norm")
    wqkv: DenseLinear | Int4Linear
    wo: DenseLinear | Int4Linear
    w_gate_up: DenseLinear | Int4Linear
    w_down: DenseLinear | Int4Linear
    ln_in: mx.array
    ln_post_attn: mx.array
    q_norm: mx.array | None  # qk_norm models only
    k_norm: mx.array | None


class Rope:
    """cos/sin tables for a set of positions: each (T, D), in the model's activation dtype."""

    def __init__(self, cos: mx.array, sin: mx.array):
        self.cos, self.sin = cos, sin

    def for_layer(self, spec: ModelSpec, layer: int):
        return self.cos, self.sin

    def select(self, idx) -> "Rope":
        """The tables at a subset (a slice or index) of the positions."""
        return Rope(self.cos[idx], self.sin[idx])


class MlxCausalLM:
    """Weights + layer pieces of one causal LM: the MLX member of the Backend protocol."""

    backend_name = "mlx"

    def __init__(self, module, spec: ModelSpec, model_id: str, rope_inv_freq: np.ndarray, rope_scaling: float, *,
                 weights: str = "fp32", blocks: dict | None = None):
        """module: an mlx-lm model with loaded weights; weights: fp32 | fp16 | int4; blocks: the GGUF's
        Q4_1 blocks by HF weight name (int4 uses them instead of quantizing the fp32 weights)."""
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"the MLX backend has weight formats {', '.join(WEIGHT_FORMATS)}, not {weights!r}")
        self.path: pathlib.Path | None = None
        self.spec = spec
        self.model_id = model_id
        self.weights = weights
        self.device = mx.default_device().type.name  # "cpu" | "gpu"
        self.act_dtype = mx.float16 if weights == "fp16" else mx.float32
        self.int4_source = "none"
        # int4 on MLX's CPU kernels: a row's output does not depend on the other rows of the call
        # (tests/backends/test_backend_parity.py: batched sessions == solo, bit for bit), so the
        # engine batches concurrent sessions by default (batching auto), as for torch's int8/int4.
        # Not claimed for Metal (not measured) nor for dense fp32/fp16.
        self.kernels_row_independent = weights == "int4" and self.device == "cpu"
        blocks = blocks or {}
        dense = self._dense_dtype = self.act_dtype
        inner = module.model
        self._embed_w = inner.embed_tokens.weight.astype(dense)
        head_w = inner.embed_tokens.weight if getattr(module.args, "tie_word_embeddings", True) or not hasattr(module, "lm_head") \
            else module.lm_head.weight
        self.head = DenseLinear(head_w.astype(dense))  # the head stays dense: its top logits decide tokens
        self.final_norm_weight = inner.norm.weight.astype(dense)
        self._inv_freq = mx.array(rope_inv_freq.astype(np.float32))
        self._rope_scaling = float(rope_scaling)
        self.layers = []
        for i, ml in enumerate(inner.layers):
            a, m = ml.self_attn, ml.mlp
            prefix = f"model.layers.{i}."
            L = _Layer()
            L.wqkv = self._linear(blocks, [prefix + f"self_attn.{n}_proj.weight" for n in "qkv"], [a.q_proj, a.k_proj, a.v_proj])
            L.wo = self._linear(blocks, [prefix + "self_attn.o_proj.weight"], [a.o_proj])
            L.w_gate_up = self._linear(blocks, [prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"], [m.gate_proj, m.up_proj])
            L.w_down = self._linear(blocks, [prefix + "mlp.down_proj.weight"], [m.down_proj])
            L.ln_in = ml.input_layernorm.weight.astype(dense)
            L.ln_post_attn = ml.post_attention_layernorm.weight.astype(dense)
            L.q_norm = a.q_norm.weight.astype(dense) if spec.qk_norm else None
            L.k_norm = a.k_norm.weight.astype(dense) if spec.qk_norm else None
            self.layers.append(L)
        mx.eval(self._params())  # MLX streams are per thread: gRPC workers must find nothing lazy
        self._steps: dict = {}  # id(layout) -> StepLayout of the forward in progress

    def _linear(self, blocks: dict, names: list, linears: list) -> DenseLinear | Int4Linear:
        """One (possibly fused) linear layer: the rows of `linears` stacked, in this model's format."""
        biases = [lin.bias for lin in linears if getattr(lin, "bias", None) is not None]
        b = mx.concatenate(biases).astype(self.act_dtype) if len(biases) == len(linears) else None
        if self.weights == "int4":
            if all(n in blocks for n in names):
                self.int4_source = "gguf Q4_1 blocks"
                parts = [Int4Linear.from_blocks(*(t.numpy() for t in blocks[n])) for n in names]
            else:
                self.int4_source = "Q4_1 min/max quantization of the fp32 weights"
                parts = [Int4Linear.from_float(lin.weight) for lin in linears]
            fused = Int4Linear.stacked(parts)
            fused.b = b
            return fused
        return DenseLinear(mx.concatenate([lin.weight for lin in linears]).astype(self._dense_dtype), b)

    def _params(self) -> list:
        out = [self._embed_w, self.head.w, self.final_norm_weight, self._inv_freq]
        for L in self.layers:
            for lin in (L.wqkv, L.wo, L.w_gate_up, L.w_down):
                out += [v for v in vars(lin).values() if isinstance(v, mx.array)]
            out += [x for x in (L.ln_in, L.ln_post_attn, L.q_norm, L.k_norm) if x is not None]
        return out

    @classmethod
    def load(cls, path: str | os.PathLike, *, weights: str = "fp32") -> "MlxCausalLM":
        from mlx_lm.utils import load_model
        from transformers import AutoConfig

        path = pathlib.Path(path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a model directory (no config.json); pass a pulled model name or an HF directory")
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"the MLX backend has weight formats {', '.join(WEIGHT_FORMATS)}, not {weights!r}")
        cfg = AutoConfig.from_pretrained(path)
        cfg = getattr(cfg, "text_config", cfg)
        spec = spec_from_config(cfg)
        if spec.model_type not in SUPPORTED:
            raise ValueError(f"the MLX backend runs {', '.join(SUPPORTED)} models; {spec.model_type} needs --backend torch")
        inv_freq, scaling = _rope_parameters(cfg)
        module, _ = load_model(path)
        meta = path / "kakeya_model.json"
        model_id = json.loads(meta.read_text()).get("name", path.name) if meta.exists() else path.name
        blocks = None
        if weights == "int4" and (path / "source.gguf").exists() and spec.model_type == "llama":
            from inference_engine.model_store.gguf_blocks import q4_1_blocks

            blocks = q4_1_blocks(path / "source.gguf", num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads)
        model = cls(module, spec, model_id, inv_freq, scaling, weights=weights, blocks=blocks)
        model.path = path
        return model

    @property
    def weights_format(self) -> str:
        return self.weights

    @property
    def embed(self) -> torch.Tensor:
        """The token embedding matrix (V, hidden) as a float32 torch tensor (drafters share it)."""
        return torch.from_numpy(np.array(self._embed_w.astype(mx.float32)))

    @property
    def lm_head(self) -> torch.Tensor:
        return torch.from_numpy(np.array(self.head.w.astype(mx.float32)))

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (linear layers + head)."""
        return self.head.nbytes + sum(lin.nbytes for L in self.layers for lin in (L.wqkv, L.wo, L.w_gate_up, L.w_down))

    def geometry(self) -> CacheGeometry:
        s = self.spec
        dtype = torch.float16 if self.act_dtype == mx.float16 else torch.float32
        return CacheGeometry(s.num_layers, s.num_kv_heads, s.head_dim, s.layer_windows, dtype, "cpu", make_store=make_mlx_store)

    def tensor(self, values, dtype: str = "long") -> mx.array:
        return mx.array(list(values), dtype={"long": mx.int32, "int": mx.int32}.get(dtype, getattr(mx, dtype, mx.int32)))

    # -- layer pieces (Backend protocol) ----------------------------------------------------
    def embed_ids(self, ids: mx.array) -> mx.array:
        return self._embed_w[ids]

    def rope(self, positions) -> Rope:
        pos = _as_mx(positions).astype(mx.float32)
        freqs = pos[:, None] * self._inv_freq[None, :]  # (T, D/2), as transformers computes them (fp32)
        emb = mx.concatenate([freqs, freqs], axis=-1)
        cos, sin = mx.cos(emb) * self._rope_scaling, mx.sin(emb) * self._rope_scaling
        return Rope(cos.astype(self.act_dtype), sin.astype(self.act_dtype))

    def project(self, layer: int, x: mx.array):
        """x (T, hidden) -> raw q (H, T, D), k, v (Hkv, T, D)."""
        s, L, t = self.spec, self.layers[layer], x.shape[0]
        nq, nkv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        qkv = L.wqkv(self.rms(x, L.ln_in))
        q = qkv[:, :nq].reshape(t, s.num_heads, s.head_dim).transpose(1, 0, 2)
        k = qkv[:, nq:nq + nkv].reshape(t, s.num_kv_heads, s.head_dim).transpose(1, 0, 2)
        v = qkv[:, nq + nkv:].reshape(t, s.num_kv_heads, s.head_dim).transpose(1, 0, 2)
        return q, k, v

    def position_q(self, layer: int, q: mx.array, rope: Rope):
        q_norm = self.layers[layer].q_norm  # set when spec.qk_norm
        q_normed = self.rms(q, q_norm) if q_norm is not None else q
        return self.rotate(q_normed, *rope.for_layer(self.spec, layer)), q_normed

    def position_k(self, layer: int, k: mx.array, rope: Rope) -> mx.array:
        k_norm = self.layers[layer].k_norm  # set when spec.qk_norm
        if k_norm is not None:
            k = self.rms(k, k_norm)
        return self.rotate(k, *rope.for_layer(self.spec, layer))

    def attend(self, layer: int, q, k, v, mask) -> mx.array:
        m = "causal" if mask is None else _as_mx(mask)
        return mx.fast.scaled_dot_product_attention(q[None], k[None], v[None], scale=self.spec.attn_scale, mask=m)[0]

    def attend_layout(self, layer: int, q, q_normed, k_all, v_all, layout, extra=None, sink_rope=None) -> mx.array:
        key = id(layout)
        step = self._steps.get(key)
        if step is None or step.source is not layout:  # once per step (per session of a batch), not per layer
            step = self._steps[key] = StepLayout(layout)
        return attend_layout(self, layer, q, q_normed, k_all, v_all, step, extra, sink_rope)

    batches_decode_attention = False  # each session attends alone

    def attend_decode_batch(self, layer: int, q, kvs, layouts, scratch: dict):
        raise NotImplementedError("the MLX backend attends per session (batches_decode_attention is False)")

    def step_runner(self, rows: int):
        """No captured graphs on MLX (its lazy graph already batches the launches): the engine runs the pieces."""
        return None

    def finish(self, layer: int, x: mx.array, o: mx.array) -> mx.array:
        """Attention output o (H, T, D) -> residual stream after the output projection and MLP."""
        L = self.layers[layer]
        o = _as_mx(o)  # the paged strategy's recall attends on host torch tensors (kv/paged.py)
        x = x + L.wo(o.transpose(1, 0, 2).reshape(x.shape[0], -1))
        gu = L.w_gate_up(self.rms(x, L.ln_post_attn))
        inter = gu.shape[-1] // 2
        g = gu[:, :inter]
        return x + L.w_down(g * mx.sigmoid(g) * gu[:, inter:])

    def inference(self):
        return contextlib.nullcontext()

    def to_host(self, logits: mx.array) -> torch.Tensor:
        self._steps = {}  # the step is over; drop its layouts
        return torch.from_numpy(np.array(logits.astype(mx.float32)))

    # MLX evaluates a graph only on the thread that built it ("There is no Stream(cpu, N) in current
    # thread"), and in-process the engine loop may run a session's forward on another session's thread: so the
    # forward's results (and with them the cache writes they read) are evaluated here, where it runs.
    def final_norm(self, x: mx.array) -> mx.array:
        out = self.rms(x, self.final_norm_weight)
        mx.eval(out)
        return out

    def logits(self, hidden: mx.array, greedy: bool = False) -> mx.array:
        out = self.head(hidden).astype(mx.float32)  # one head for greedy and sampled steps
        mx.eval(out)
        return out

    def cat(self, arrays, dim: int) -> mx.array | torch.Tensor:
        """Concatenate MLX arrays (and layout position tensors) along `dim` (engine/loop.py)."""
        if all(isinstance(a, torch.Tensor) for a in arrays):
            return torch.cat(list(arrays), dim)
        return mx.concatenate([_as_mx(a) for a in arrays], axis=dim)

    # -- array helpers -----------------------------------------------------------------------
    def rms(self, x: mx.array, w: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, w, self.spec.rms_eps)

    @staticmethod
    def rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        # x: (H, T, D); cos/sin: (T, D)
        h = x.shape[-1] // 2
        return x * cos + mx.concatenate([-x[..., h:], x[..., :h]], axis=-1) * sin


def _as_mx(values) -> mx.array:
    if isinstance(values, mx.array):
        return values
    if isinstance(values, torch.Tensor):
        return mx.array(values.cpu().numpy())
    return mx.array(np.asarray(list(values) if isinstance(values, range) else values))


def _rope_parameters(cfg) -> tuple[np.ndarray, float]:
    """(inv_freq (D/2,), attention scaling) from transformers' own rotary embedding for this config,
    so every rope type transformers knows (default, llama3, yarn, ...) means the same here."""
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping[type(cfg)]
    mod = sys.modules[cls.__module__]
    rotary = next(getattr(mod, n) for n in dir(mod) if n.endswith("RotaryEmbedding") and not n.startswith("_"))
    r = rotary(config=cfg)
    return r.inv_freq.float().numpy(), float(getattr(r, "attention_scaling", 1.0))
