"""Tiny random-weight models built from transformers configs, saved as HF directories.

They exercise every code path of the engine in milliseconds (tests, the TypeScript SDK
suite, demos). They generate noise, not language: never use them to judge quality.
"""
from __future__ import annotations

import json
import pathlib
from typing import Any

TINY_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "mistral")


def tiny_config(arch: str, *, vocab_size: int = 256, max_position_embeddings: int = 2048, num_hidden_layers: int = 2):
    """A 2-layer, 64-wide config of the given family (GQA, tied embeddings where the family ties)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(  # keyword arguments each family's config takes
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "llama":
        return LlamaConfig(head_dim=16, tie_word_embeddings=True, **common)
    if arch == "mistral":
        return MistralConfig(head_dim=16, sliding_window=None, **common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=16, tie_word_embeddings=True, **common)
    if arch == "gemma3":
        # One local (sliding) layer with a short window and one global layer, so the
        # per-layer window is exercised by histories of a few dozen tokens.
        return Gemma3TextConfig(
            head_dim=16,
            sliding_window=16,
            layer_types=(["sliding_attention", "full_attention"] * num_hidden_layers)[:num_hidden_layers],
            query_pre_attn_scalar=16,
            **common,
        )
    raise ValueError(f"unknown tiny arch {arch!r}; choose one of {', '.join(TINY_ARCHS)}")


def make_tiny_model(arch: str, out: str | pathlib.Path, *, seed: int = 0, **config_kwargs) -> pathlib.Path:
    """Build a random-weight causal LM of `arch` and save it (safetensors + config) under `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    out = pathlib.Path(out)
    torch.manual_seed(seed)
    config = tiny_config(arch, **config_kwargs)
    model = AutoModelForCausalLM.from_config(config)
    # Random init in transformers is small; widen it so logits are not near-uniform and
    # greedy decoding is decisive (ties would make exactness tests meaningless).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    (out / "kakeya_model.json").write_text(json.dumps({"name": f"tiny-{arch}", "seed": seed, "random_weights": True}))
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Write a tiny random-weight HF model directory.")
    ap.add_argument("--arch", default="llama", choices=TINY_ARCHS)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(make_tiny_model(args.arch, args.out, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
