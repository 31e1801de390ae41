"""ModelSpec: the shape of a decoder-only model, read from a transformers config. No framework."""
from __future__ import annotations

from dataclasses import dataclass

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


def spec_from_config(cfg) -> ModelSpec:
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
