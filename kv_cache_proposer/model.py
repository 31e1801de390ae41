"""The drafter network: a small bidirectional transformer body between the verifier's frozen
token embedding and frozen LM head.

Input at window position i is fuse(norm(embed(x_i)), norm(h_{i-1})), where h_{i-1} is the
verifier's final (post-norm) hidden state of the previous token when the engine has it and a
learned `missing_hidden` vector otherwise; block slots that are still masked use a learned
`mask_embed` instead of a token embedding. Attention is non-causal (every position sees every
other one). The output at position i, projected by the learned `out_proj` into the verifier's
hidden space, predicts token i+1 through the verifier's LM head (the EAGLE pairing: the last
context token predicts the first block token, block slot j predicts slot j+1).

The shared embedding and head are non-persistent buffers: never trained, never saved.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class DrafterConfig:
    vocab_size: int
    verifier_hidden_size: int
    hidden_size: int = 576
    num_layers: int = 1
    num_heads: int = 9
    intermediate_size: int = 1536
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    uses_verifier_hidden: bool = True
    # FR-Spec-style draft vocabulary: the drafter predicts only the `draft_vocab_size` most frequent
    # tokens (rows of the shared head); 0 = the full vocabulary.
    draft_vocab_size: int = 0
    # drafting defaults (the engine may override steps/threshold per call)
    context_window: int = 32
    block_size: int = 4
    denoise_steps: int = 1
    confidence_threshold: float = 0.0
    verifier: str = ""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rope_tables(n: int, head_dim: int, theta: float, device, dtype):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(n, device=device, dtype=torch.float32), inv)  # (T, D/2)
    ang = torch.cat([ang, ang], dim=-1)  # (T, D)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x, cos, sin):
    # x: (B, H, T, D)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class BidirectionalBlock(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        d, h = cfg.hidden_size, cfg.num_heads
        self.n_heads, self.head_dim = h, cfg.head_dim
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_up = nn.Linear(d, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, d, bias=False)

    def forward(self, x, cos, sin, pad_mask=None):
        # x: (B, T, d); pad_mask: (B, 1, 1, T) bool, True = attendable, or None
        B, T, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (B, H, T, D)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=pad_mask, is_causal=False)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, d))
        g, u = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        x = x + self.down(F.silu(g) * u)
        return x, k, v


class DraftHeadModule(nn.Module):
    """What both drafter models share: the frozen verifier head restricted to a draft vocabulary
    (FR-Spec) and the initialisation of their linear layers (residual branches start small)."""

    @staticmethod
    def _check_verifier(cfg, embed_weight: torch.Tensor, head_weight: torch.Tensor) -> tuple[int, int]:
        """(vocab, hidden) of the shared embedding and head, which must be the config's verifier's."""
        V, Hv = embed_weight.shape
        if (V, Hv) != (cfg.vocab_size, cfg.verifier_hidden_size) or head_weight.shape != (V, Hv):
            raise ValueError(
                f"verifier embedding {tuple(embed_weight.shape)} / LM head {tuple(head_weight.shape)} do not match "
                f"the drafter config (vocab {cfg.vocab_size}, hidden {cfg.verifier_hidden_size}); "
                "pass the embedding and head of the verifier this drafter was trained for"
            )
        return V, Hv

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=1.0 / math.sqrt(m.in_features))
        for blk in self.layers:  # residual branches start small so the input path dominates early
            blk.o.weight.data.mul_(0.1)
            blk.down.weight.data.mul_(0.1)

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """Restrict predictions to the shared-head rows `ids` (ascending token ids)."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.head_weight.device)
        if ids.numel() != self.draft_vocab.numel():
            raise ValueError(f"draft vocabulary has {ids.numel()} ids; the config says {self.draft_vocab.numel()}")
        self.draft_vocab = ids
        self.draft_head = self.head_weight[ids]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.draft_head = self.head_weight[self.draft_vocab]


class DrafterModel(DraftHeadModule):
    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor):
        super().__init__()
        V, Hv = self._check_verifier(cfg, embed_weight, head_weight)
        self.cfg = cfg
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("head_weight", head_weight.detach(), persistent=False)
        n_draft = cfg.draft_vocab_size or V
        self.register_buffer("draft_vocab", torch.arange(n_draft), persistent=True)
        self.register_buffer("draft_head", self.head_weight[:n_draft], persistent=False)
        self.mask_embed = nn.Parameter(torch.randn(Hv) * 0.02)
        self.emb_norm = RMSNorm(Hv, cfg.rms_norm_eps)
        n_in = Hv
        if cfg.uses_verifier_hidden:
            self.missing_hidden = nn.Parameter(torch.randn(Hv) * 0.02)
            self.hid_norm = RMSNorm(Hv, cfg.rms_norm_eps)
            n_in = 2 * Hv
        self.fuse = nn.Linear(n_in, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList(BidirectionalBlock(cfg) for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(cfg.hidden_size, Hv, bias=False)
        self._init_weights()

    def encode(self, ids, masked, in_hidden=None, has_hidden=None, pad_mask=None):
        """ids (B, T) long (any value where masked); masked (B, T) bool; in_hidden (B, T, Hv) the verifier
        hidden of the PREVIOUS token at each position; has_hidden (B, T) bool. Returns the last-layer
        hidden (B, T, d) and per-layer (K, V) each (B, H, T, D)."""
        B, T = ids.shape
        emb = F.embedding(ids.clamp(0, self.cfg.vocab_size - 1), self.embed_weight)
        emb = torch.where(masked[..., None], self.mask_embed.to(emb.dtype), emb)
        parts = [self.emb_norm(emb)]
        if self.cfg.uses_verifier_hidden:
            if in_hidden is None:
                hid = self.missing_hidden.expand(B, T, -1)
            else:
                hid = torch.where(has_hidden[..., None], in_hidden.to(emb.dtype), self.missing_hidden.to(emb.dtype))
            parts.append(self.hid_norm(hid))
        x = self.fuse(torch.cat(parts, dim=-1))
        cos, sin = rope_tables(T, self.cfg.head_dim, self.cfg.rope_theta, x.device, x.dtype)
        kv = []
        for blk in self.layers:
            x, k, v = blk(x, cos, sin, pad_mask)
            kv.append((k, v))
        return self.final_norm(x), kv

    def forward(self, ids, masked, in_hidden=None, has_hidden=None, pad_mask=None):
        return self.encode(ids, masked, in_hidden, has_hidden, pad_mask)

    def project(self, h):
        """Drafter hidden (…, d) -> the verifier's hidden space (…, Hv): the alignment projection."""
        return self.out_proj(h)

    def logits(self, h):
        """(…, d) -> (…, N) logits over the draft vocabulary (column c is token draft_vocab[c])."""
        return self.project(h) @ self.draft_head.T.to(h.dtype)
