"""The v2 drafter network (DFlash-style): a block [last token, MASK x (B-1)] is drafted in one
bidirectional pass whose every layer also attends to the verifier's context, injected as extra
keys/values projected from the verifier's hidden states of a few layers.

Context features: c_t = ctx_norm(fc(concat_l feat_norm_l(h_t^l))) for the captured verifier layers l
(the residual stream after those layers, each RMS-normed first: the mid-layer streams carry outliers
in the thousands). Each drafter layer projects c_t with its own k/v projections (the ones its block
tokens use too) and RoPE at c_t's position, so a context position's K/V never change once made: the
drafter caches them (dflash_drafter.DraftCache). Block slot j >= 1 (a MASK) predicts its own token
through out_proj and the verifier's frozen LM head restricted to the draft vocabulary (FR-Spec).

The shared embedding and head are non-persistent buffers: never trained, never saved.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from kv_cache_proposer.model import DraftHeadModule, RMSNorm, apply_rope


@dataclasses.dataclass
class DFlashConfig:
    vocab_size: int
    verifier_hidden_size: int
    capture_layers: tuple = (1, 8, 15, 22, 28)
    hidden_size: int = 576
    num_layers: int = 2
    num_heads: int = 9
    num_kv_heads: int = 3
    intermediate_size: int = 1536
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    draft_vocab_size: int = 8192  # 0 = the full vocabulary
    context_window: int = 128  # verifier positions each block attends to (the drafter's cache size)
    block_size: int = 5  # [last token, block_size - 1 masks]: up to block_size - 1 drafts per call
    verifier: str = ""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def feature_size(self) -> int:
        return len(self.capture_layers) * self.verifier_hidden_size

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["capture_layers"] = list(self.capture_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DFlashConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["capture_layers"] = tuple(kw.get("capture_layers", ()))
        return cls(**kw)


def rope_at(positions: torch.Tensor, head_dim: int, theta: float, dtype):
    """cos/sin (…, T, D) at arbitrary integer positions (…, T)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    ang = positions.float()[..., None] * inv
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


class ContextBlock(nn.Module):
    """One drafter layer: the block's queries attend to [context K/V ; block K/V]."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        d, D = cfg.hidden_size, cfg.head_dim
        self.h, self.hkv, self.D = cfg.num_heads, cfg.num_kv_heads, D
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q = nn.Linear(d, self.h * D, bias=False)
        self.kv = nn.Linear(d, 2 * self.hkv * D, bias=False)
        self.o = nn.Linear(self.h * D, d, bias=False)
        self.mlp_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_up = nn.Linear(d, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, d, bias=False)

    def project_kv(self, c, cos, sin):
        # c: (B, T, d) normed context features or normed block inputs -> k, v (B, Hkv, T, D)
        B, T, _ = c.shape
        k, v = self.kv(c).view(B, T, 2, self.hkv, self.D).permute(2, 0, 3, 1, 4)
        return apply_rope(k, cos[:, None], sin[:, None]), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        # x: (B, Q, d) block rows; cos/sin (B, Q, D); ctx_k/v (B, Hkv, C, D); mask (B, 1, Q, C + Q) bool
        B, Q, d = x.shape
        hx = self.attn_norm(x)
        q = apply_rope(self.q(hx).view(B, Q, self.h, self.D).transpose(1, 2), cos[:, None], sin[:, None])
        bk, bv = self.project_kv(hx, cos, sin)
        k = torch.cat([ctx_k, bk], dim=2).repeat_interleave(self.h // self.hkv, dim=1)
        v = torch.cat([ctx_v, bv], dim=2).repeat_interleave(self.h // self.hkv, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.o(a.transpose(1, 2).reshape(B, Q, self.h * self.D))
        g, u = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class Int8Linear(nn.Module):
    """y = x @ w^T with w as per-row int8 (scale = max |row| / 127) through torch's weight-only int8 kernel, bf16
    activations; `weight` is an empty tensor of the fp32 rows' dtype and device (the drafter reads them there), so the
    fp32 rows are not kept."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(1).clamp_min(1e-12) / 127
        self.register_buffer("weight", weight.detach().new_empty(0), persistent=False)
        self.q = torch.round(w / scale[:, None]).to(torch.int8).contiguous()
        self.scale = scale.to(torch.bfloat16)

    def forward(self, x):
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16).contiguous(), self.q, self.scale)
        return y.to(x.dtype).reshape(*shape[:-1], -1)


class DFlashModel(DraftHeadModule):
    def __init__(self, cfg: DFlashConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor):
        super().__init__()
        V, Hv = self._check_verifier(cfg, embed_weight, head_weight)
        if cfg.num_heads % cfg.num_kv_heads or not cfg.capture_layers:
            raise ValueError(f"bad drafter config: heads {cfg.num_heads} / kv heads {cfg.num_kv_heads}, layers {cfg.capture_layers}")
        self.cfg = cfg
        d = cfg.hidden_size
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("head_weight", head_weight.detach(), persistent=False)
        n_draft = cfg.draft_vocab_size or V
        self.register_buffer("draft_vocab", torch.arange(n_draft), persistent=True)
        self.register_buffer("draft_head", self.head_weight[:n_draft], persistent=False)
        L = len(cfg.capture_layers)
        self.feat_norm = nn.Parameter(torch.ones(L, Hv))
        self.fc = nn.Linear(L * Hv, d, bias=False)
        self.ctx_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.mask_embed = nn.Parameter(torch.randn(Hv) * 0.02)
        self.emb_norm = RMSNorm(Hv, cfg.rms_norm_eps)
        self.in_proj = nn.Linear(Hv, d, bias=False) if d != Hv else nn.Identity()
        self.layers = nn.ModuleList(ContextBlock(cfg) for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(d, Hv, bias=False)
        # inference logits of a few rows as head @ rows^T (`logits`); False: rows @ head^T, the form before 2026-11-29
        # (scripts/research/drafter_cost.py times both)
        self.stream_head = True
        self._init_weights()

    def context_features(self, feats):
        """feats (…, T, L*Hv) verifier layer outputs -> (…, T, d) normed context features."""
        L, Hv = self.feat_norm.shape
        f = feats.to(self.fc.weight.dtype).unflatten(-1, (L, Hv))
        f = f * torch.rsqrt(f.float().pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps).to(f.dtype) * self.feat_norm
        return self.ctx_norm(self.fc(f.flatten(-2)))

    def context_kv(self, c, positions):
        """c (B, T, d) context features at positions (B, T) -> per layer (K, V), each (B, Hkv, T, D)."""
        cos, sin = rope_at(positions, self.cfg.head_dim, self.cfg.rope_theta, c.dtype)
        return [blk.project_kv(c, cos, sin) for blk in self.layers]

    def block_inputs(self, first_ids):
        """first_ids (B, N) -> block inputs (B, N * block_size, d): [embed(first), mask, ...] per block."""
        B, N = first_ids.shape
        e = F.embedding(first_ids.clamp(0, self.cfg.vocab_size - 1), self.embed_weight).to(self.mask_embed.dtype)
        blk = torch.cat([e[:, :, None], self.mask_embed.expand(B, N, self.cfg.block_size - 1, -1)], dim=2)
        return self.in_proj(self.emb_norm(blk)).flatten(1, 2)

    def run_blocks(self, first_ids, block_pos, ctx_kv, mask):
        """first_ids (B, N); block_pos (B, N * bs) positions; ctx_kv per layer; mask (B, 1, N*bs, C + N*bs).
        Returns the final normed hidden of every block row (B, N * bs, d)."""
        x = self.block_inputs(first_ids)
        cos, sin = rope_at(block_pos, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        for blk, (ck, cv) in zip(self.layers, ctx_kv):
            x = blk(x, cos, sin, ck, cv, mask)
        return self.final_norm(x)

    def forward(self, feats, ctx_pos, first_ids, block_pos, mask, feat_dropout: float = 0.0):
        """Training pass (through forward, so DDP syncs gradients): verifier features (B, C, L*Hv) at ctx_pos (B, C),
        blocks starting with first_ids (B, N) at block_pos (B, N * bs) -> out_proj of every block row (B, N * bs, Hv)."""
        c = F.dropout(self.context_features(feats), feat_dropout, self.training)
        ctx_kv = self.context_kv(c, ctx_pos)
        return self.project(self.run_blocks(first_ids, block_pos, ctx_kv, mask))

    def project(self, h):
        return self.out_proj(h)

    def int8_weights(self) -> None:
        """Inference only, CPU: every linear and the draft vocabulary head as per-row int8 weights through torch's
        weight-only int8 kernel (bf16 activations), a quarter of the fp32 bytes a draft streams
        (scripts/bench_speculative.py's `NAME+int8` drafters measure what it costs in acceptance)."""
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(module, name, Int8Linear(child.weight))
        self.head_int8 = Int8Linear(self.draft_head)

    def logits(self, h):
        """(…, d) -> (…, N) logits over the draft vocabulary (column c is token draft_vocab[c])."""
        if getattr(self, "head_int8", None) is not None and not torch.is_grad_enabled():
            return self.head_int8(self.project(h))
        p, w = self.project(h), self.draft_head.to(h.dtype)
        if self.stream_head and p.dim() == 2 and p.shape[0] <= 16 and not torch.is_grad_enabled():
            # a draft's few rows against the (N, d) head as head @ rows^T: the BLAS streams the head once, where the
            # rows @ head^T form repacks all of it (19 MB in fp32) every call: a draft 10.4 vs 16.6 ms on an AVX2 EPYC
            # (results/research/drafter_cost_avx2.json; the same logits up to float summation order)
            return torch.mm(w, p.T).T
        return p @ w.T
