"""Tiny drafters over tiny random verifiers (plain functions, no fixture chains)."""
from __future__ import annotations

import os
import pathlib
import sys

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from factories import smollm2_dir, tiny_model_dir  # noqa: E402,F401

from kv_cache_proposer import Drafter, DrafterConfig, DrafterModel  # noqa: E402


def tiny_verifier(seed: int = 0):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("llama", seed=seed)
    return path, AutoModelForCausalLM.from_pretrained(str(path)).eval()


def tiny_drafter(*, layers: int = 2, context_window: int = 16, draft_vocab: int = 0, seed: int = 0,
                 uses_verifier_hidden: bool = True) -> Drafter:
    _, v = tiny_verifier()
    emb, head = v.get_input_embeddings().weight.detach(), v.get_output_embeddings().weight.detach()
    torch.manual_seed(seed)
    cfg = DrafterConfig(vocab_size=emb.shape[0], verifier_hidden_size=emb.shape[1], hidden_size=32, num_layers=layers,
                        num_heads=4, intermediate_size=64, context_window=context_window, draft_vocab_size=draft_vocab,
                        uses_verifier_hidden=uses_verifier_hidden)
    model = DrafterModel(cfg, emb, head)
    with torch.no_grad():  # make outputs decisive and sensitive to inputs
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return Drafter(model)
