"""Decoder-only transformer forward over our slot caches (Llama, Mistral, Qwen2/3, Gemma 3).

transformers loads the weights and is the reference oracle in tests; the hot path is this
file: batch 1, fused QKV and gate/up projections, SDPA with masks from the cache layout.
`forward(ids, positions, cache)` runs T new tokens and returns their logits; the cache is
left with an uncommitted step that the caller commits (all, or a prefix after verification).
"""
from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inference_engine.kv.resident import AttentionLayout, CacheGeometry

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    rms_eps: float
    attn_scale: float
    layer_windows: tuple  # per layer: sliding window or None
    layer_rope: tuple  # per layer: rope key ("default" or a gemma layer type)
    gemma_norms: bool  # (1 + w) RMSNorm, pre/post feed-forward norms, scaled embeddings
    qk_norm: bool
    embed_scale: float
    eos_token_ids: tuple


def _spec_from_config(cfg) -> ModelSpec:
    mt = cfg.model_type
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    gemma = mt.startswith("gemma3")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n = cfg.num_hidden_layers
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * n
    sw = getattr(cfg, "sliding_window", None)
    if gemma:
        windows = tuple(sw if t == "sliding_attention" else None for t in layer_types)
        rope = tuple(layer_types)
    elif mt == "mistral":
        windows = (sw,) * n  # Mistral's window (often None) applies to every layer
        rope = ("default",) * n
    else:
        # Qwen2/3 mark windowed layers in layer_types (only when use_sliding_window is on).
        windows = tuple(sw if t == "sliding_attention" else None for t in layer_types)
        rope = ("default",) * n
    eos = cfg.eos_token_id
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    scale = (cfg.query_pre_attn_scalar ** -0.5) if gemma else head_dim ** -0.5
    return ModelSpec(
        model_type=mt,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=n,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        max_context=cfg.max_position_embeddings,
        rms_eps=cfg.rms_norm_eps,
        attn_scale=scale,
        layer_windows=windows,
        layer_rope=rope,
        gemma_norms=gemma,
        qk_norm=mt in ("qwen3",) or gemma,
        embed_scale=cfg.hidden_size ** 0.5 if gemma else 1.0,
        eos_token_ids=eos,
    )


class _Layer:
    __slots__ = ("wqkv", "bqkv", "wo", "w_gate_up", "w_down", "ln_in", "ln_post_attn", "ln_pre_ff", "ln_post_ff", "q_norm", "k_norm")


class TorchCausalLM:
    """Weights + forward of one causal LM. Stateless: all per-session state is in the cache."""

    backend_name = "torch"

    def __init__(self, hf_model, spec: ModelSpec, model_id: str):
        self.path: pathlib.Path | None = None  # set by load(); tokenizer files live there
        self.spec = spec
        self.model_id = model_id
        self.device = next(hf_model.parameters()).device
        self.dtype = next(hf_model.parameters()).dtype
        inner = hf_model.model
        self.embed = inner.embed_tokens.weight.detach()
        self.lm_head = hf_model.lm_head.weight.detach()
        self.final_norm = self._norm_weight(inner.norm.weight)
        self.rotary = inner.rotary_emb
        self.act = inner.layers[0].mlp.act_fn
        self.layers = []
        for hl in inner.layers:
            a, m = hl.self_attn, hl.mlp
            L = _Layer()
            L.wqkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach().contiguous()
            L.bqkv = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).detach() if a.q_proj.bias is not None else None
            L.wo = a.o_proj.weight.detach()
            L.w_gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach().contiguous()
            L.w_down = m.down_proj.weight.detach()
            L.ln_in = self._norm_weight(hl.input_layernorm.weight)
            L.ln_post_attn = self._norm_weight(hl.post_attention_layernorm.weight)
            L.ln_pre_ff = self._norm_weight(hl.pre_feedforward_layernorm.weight) if spec.gemma_norms else None
            L.ln_post_ff = self._norm_weight(hl.post_feedforward_layernorm.weight) if spec.gemma_norms else None
            L.q_norm = self._norm_weight(a.q_norm.weight) if spec.qk_norm else None
            L.k_norm = self._norm_weight(a.k_norm.weight) if spec.qk_norm else None
            self.layers.append(L)
        self._verifier_source = None

    @property
    def weights_format(self) -> str:
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype, str(self.dtype))

    @classmethod
    def load(cls, path: str | os.PathLike, *, device: str = "cpu", dtype: torch.dtype = torch.float32) -> "TorchCausalLM":
        from transformers import AutoConfig, AutoModelForCausalLM

        path = pathlib.Path(path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a model directory (no config.json); pass a pulled model name or an HF directory")
        cfg = AutoConfig.from_pretrained(path)
        spec = _spec_from_config(getattr(cfg, "text_config", cfg))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        meta = path / "kakeya_model.json"
        model_id = json.loads(meta.read_text()).get("name", path.name) if meta.exists() else path.name
        model = cls(hf, spec, model_id)
        model.path = path
        return model

    def _norm_weight(self, w: torch.Tensor) -> torch.Tensor:
        # Gemma stores RMSNorm weights as offsets from 1; fold the offset in once.
        w = w.detach()
        return (1.0 + w.float()).to(w.dtype) if self.spec.gemma_norms else w

    def geometry(self) -> CacheGeometry:
        s = self.spec
        return CacheGeometry(s.num_layers, s.num_kv_heads, s.head_dim, s.layer_windows, self.dtype, str(self.device))

    # -- forward -------------------------------------------------------------------------
    def _rms(self, x, w):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.spec.rms_eps)
        return (y * w.float()).to(x.dtype) if self.spec.gemma_norms else w * y.to(x.dtype)

    def _rope_tables(self, positions: torch.Tensor, x: torch.Tensor) -> dict:
        pid = positions[None]
        if self.spec.gemma_norms:
            return {t: self.rotary(x, pid, t) for t in set(self.spec.layer_rope)}
        return {"default": self.rotary(x, pid)}

    @staticmethod
    def _rotate(x, cos, sin):
        # x: (H, T, D); cos/sin: (1, T, D)
        h = x.shape[-1] // 2
        rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
        return x * cos + rot * sin

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache, *, logits: str = "all", restored=None):
        """Run new tokens `ids` (T,) at `positions` (T,) through the model, writing their K/V.

        logits: "all" -> (T, V), "last" -> (1, V), "none" -> None. Also returns the final
        normed hidden states (T, H) (the LM head's input), which drafters condition on.
        restored: a RestoreSource (kv/restore.py) for a dlm_restore cache; None = the
        cache's own source, else its `restore_from` ("verifier": this model, f_θ = identity).
        """
        s = self.spec
        layout: AttentionLayout = cache.prepare(positions, ids)
        plan = layout.restore
        step = None
        if plan is not None and plan.positions.numel():
            step = plan.open_step(self._restore_source(cache, restored))
        try:
            x = self._embed(ids)
            ropes = self._rope_tables(positions, x)
            sink_rope = self._sink_rope(layout, x)
            restored_ropes = self._rope_tables(plan.positions, x) if step is not None else None
            t = ids.numel()
            for i, L in enumerate(self.layers):
                q, k, v = self._project(L, self._rms(x, L.ln_in))
                q_pre = self._rms(q, L.q_norm) if s.qk_norm else q
                cos, sin = ropes[s.layer_rope[i]]
                q = self._rotate(q_pre, cos, sin)
                k = self._position_keys(L, k, cos, sin)
                k_all, v_all = cache.update_and_fetch(i, k.contiguous(), v.contiguous())
                mask = layout.masks[s.layer_windows[i]]
                if step is not None:
                    # Restored K/V live from here to the end of this layer's attention only.
                    k_all, v_all, mask = self._with_restored(i, L, step, plan, restored_ropes, k_all, v_all, mask)
                if sink_rope is not None and s.layer_windows[i] is None:
                    o = self._attend_with_sink_shift(q, q_pre, k_all, v_all, mask, layout, sink_rope[s.layer_rope[i]])
                else:
                    o = F.scaled_dot_product_attention(q[None], k_all[None], v_all[None], attn_mask=mask, scale=s.attn_scale, enable_gqa=True)[0]
                del k_all, v_all
                x = self._finish_layer(L, x, o.transpose(0, 1).reshape(t, -1))
        finally:
            if step is not None:
                step.close()
        hidden = self._rms(x, self.final_norm)
        if logits == "none":
            return None, hidden
        out = hidden[-1:] if logits == "last" else hidden
        return F.linear(out, self.lm_head).float(), hidden

    # -- layer pieces, shared by forward and the same-model restore proposer -------------
    def _embed(self, ids):
        x = F.embedding(ids, self.embed)
        if self.spec.embed_scale != 1.0:
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        return x

    def _project(self, L, h):
        """h (T, hidden) -> q (H, T, D), k, v (Hkv, T, D): raw projections, pre-norm, pre-RoPE."""
        s, t = self.spec, h.shape[0]
        nq, nkv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        qkv = F.linear(h, L.wqkv, L.bqkv)
        q = qkv[:, :nq].view(t, s.num_heads, s.head_dim).transpose(0, 1)
        k = qkv[:, nq:nq + nkv].view(t, s.num_kv_heads, s.head_dim).transpose(0, 1)
        v = qkv[:, nq + nkv:].view(t, s.num_kv_heads, s.head_dim).transpose(0, 1)
        return q, k, v

    def _position_keys(self, L, k, cos, sin):
        """Raw k -> the keys attention reads: the layer's k_norm, then RoPE at the keys' positions."""
        if self.spec.qk_norm:
            k = self._rms(k, L.k_norm)
        return self._rotate(k, cos, sin)

    def _finish_layer(self, L, x, o):
        """Attention output o (T, H*D) -> residual stream after the output projection and MLP."""
        s = self.spec
        o = F.linear(o, L.wo)
        if s.gemma_norms:
            x = x + self._rms(o, L.ln_post_attn)
            h = self._rms(x, L.ln_pre_ff)
        else:
            x = x + o
            h = self._rms(x, L.ln_post_attn)
        gu = F.linear(h, L.w_gate_up)
        inter = gu.shape[-1] // 2
        m = F.linear(self.act(gu[:, :inter]) * gu[:, inter:], L.w_down)
        return x + (self._rms(m, L.ln_post_ff) if s.gemma_norms else m)

    # -- dlm_restore -------------------------------------------------------------------
    def verifier_restore_source(self) -> "VerifierRestoreSource":
        if self._verifier_source is None:
            self._verifier_source = VerifierRestoreSource(self)
        return self._verifier_source

    def _restore_source(self, cache, restored):
        source = restored if restored is not None else getattr(cache, "restore_source", None)
        if source is not None:
            return source
        name = getattr(cache, "restore_from", None)
        if name == "verifier":
            return self.verifier_restore_source()
        raise ValueError(f"this cache restores evicted K/V from {name!r}, which this model cannot supply; pass restored=<RestoreSource>")

    def _with_restored(self, i, L, step, plan, restored_ropes, k_all, v_all, mask):
        """Prepend the restored K/V of layer i (those any query of the step may see) to the resident keys."""
        s = self.spec
        k_r, v_r = step.kv_for_layer(i)  # (Hkv, E, D) pre-norm, pre-RoPE
        r_mask = plan.masks[s.layer_windows[i]]
        visible = r_mask.any(0)
        if not bool(visible.any()):  # a local layer whose window lies inside the resident keys
            return k_all, v_all, mask
        cos, sin = restored_ropes[s.layer_rope[i]]
        if not bool(visible.all()):
            idx = visible.nonzero().flatten()
            k_r, v_r, r_mask, cos, sin = k_r[:, idx], v_r[:, idx], r_mask[:, idx], cos[:, idx], sin[:, idx]
        k_r = self._position_keys(L, k_r, cos, sin)
        mask = torch.cat([r_mask, mask], 1)
        bias = getattr(step, "logit_bias", None)
        if bias is not None:  # attention-mass calibration: a per-head logit offset on the restored columns
            ninf = torch.tensor(float("-inf"), dtype=k_all.dtype, device=k_all.device)
            col = torch.zeros(s.num_heads, 1, mask.shape[1], dtype=k_all.dtype, device=k_all.device)
            col[:, :, : r_mask.shape[1]] = bias[i].to(k_all.dtype)[:, None, None]
            mask = torch.where(mask, col, ninf)  # (H, T, N) float mask
        return torch.cat([k_r.to(k_all.dtype), k_all], 1), torch.cat([v_r.to(v_all.dtype), v_all], 1), mask

    # -- positions past the trained context (SinkWindowCache docstring) ----------------
    def _sink_rope(self, layout: AttentionLayout, x):
        shift = layout.sink_shift
        if shift is None or int(layout.positions[-1]) < shift.from_position:
            return None
        return self._rope_tables(torch.full_like(layout.positions, shift.virtual_query_position), x)

    def _attend_with_sink_shift(self, q, q_pre, k_all, v_all, mask, layout, sink_cos_sin):
        s = self.spec
        groups = s.num_heads // s.num_kv_heads
        kx = k_all.repeat_interleave(groups, 0)
        vx = v_all.repeat_interleave(groups, 0)
        scores = (q @ kx.transpose(1, 2)) * s.attn_scale  # (H, T, N)
        q_virt = self._rotate(q_pre, *sink_cos_sin)
        sink_scores = (q_virt @ kx.transpose(1, 2)) * s.attn_scale
        shift = layout.sink_shift
        kp = layout.key_positions[None, :]
        shifted = (layout.positions[:, None] >= shift.from_position) & (kp >= 0) & (kp < shift.sink)
        scores = torch.where(shifted, sink_scores, scores).masked_fill(~mask, float("-inf"))
        return torch.softmax(scores.float(), -1).to(v_all.dtype) @ vx


class VerifierRestoreSource:
    """Same-model restoration (f_θ = identity): the verifier itself, run causally and without a
    cache over the history up to the last evicted position, one layer per `kv_for_layer`
    call. Causality makes its K/V at every evicted position the ones `full` would hold."""

    name = "verifier"

    def __init__(self, model: TorchCausalLM):
        self.model = model

    def open_step(self, history: torch.Tensor, evicted: torch.Tensor) -> "_VerifierRestoreStep":
        return _VerifierRestoreStep(self.model, history, evicted)


class _VerifierRestoreStep:
    """The proposer's residual stream over positions 0..last evicted, advanced one layer per call."""

    def __init__(self, model: TorchCausalLM, history: torch.Tensor, evicted: torch.Tensor):
        self.model = model
        n = int(evicted[-1]) + 1
        self.n = n
        self.evicted = evicted.to(model.device)
        self.x = model._embed(history[:n].to(model.device))  # (n, hidden)
        self.ropes = model._rope_tables(torch.arange(n, device=model.device), self.x)
        self.local_masks = {}  # sliding window -> (n, n) causal band, built once per step
        self.next_layer = 0

    def kv_for_layer(self, layer: int):
        m, s = self.model, self.model.spec
        if self.x is None or layer != self.next_layer:
            raise RuntimeError(f"restore step asked for layer {layer}, expected {self.next_layer} (layers run in order, once)")
        L = m.layers[layer]
        q, k, v = m._project(L, m._rms(self.x, L.ln_in))
        k_out, v_out = k[:, self.evicted], v[:, self.evicted]  # (Hkv, E, D) pre-norm, pre-RoPE
        self.next_layer += 1
        if self.next_layer == s.num_layers:  # nothing reads the last layer's output
            self.close()
            return k_out, v_out
        cos, sin = self.ropes[s.layer_rope[layer]]
        q = m._rotate(m._rms(q, L.q_norm) if s.qk_norm else q, cos, sin)
        k = m._position_keys(L, k, cos, sin)
        w = s.layer_windows[layer]
        if w is None:
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=s.attn_scale, enable_gqa=True)[0]
        else:
            if w not in self.local_masks:
                p = torch.arange(self.n, device=m.device)
                self.local_masks[w] = (p[None, :] <= p[:, None]) & (p[None, :] > p[:, None] - w)  # (n, n)
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=self.local_masks[w], scale=s.attn_scale,
                                               enable_gqa=True)[0]
        del q, k, v
        self.x = m._finish_layer(L, self.x, o.transpose(0, 1).reshape(self.n, -1))
        return k_out, v_out

    def close(self) -> None:
        self.x = None
        self.ropes = None
        self.local_masks = {}
