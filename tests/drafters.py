"""Drafter test doubles speaking the engine's proposer protocol (context_window,
uses_verifier_hidden, draft(context_ids, k, context_hidden=None) -> .ids)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from inference_engine.engine.steps import forward


@dataclass
class Draft:
    ids: torch.Tensor


class HashDrafter:
    """Deterministic drafts that the verifier mostly rejects: exercises the rejection path."""

    context_window = 8
    uses_verifier_hidden = False

    def __init__(self, vocab: int):
        self.vocab = vocab

    def draft(self, context_ids, k, *, context_hidden=None):
        last = int(context_ids[-1])
        return Draft(torch.tensor([(last * 7 + 3 + 5 * i) % self.vocab for i in range(k)]))


class SelfDrafter:
    """Drafts with the verifier itself (greedy, cache-free re-encode of a bounded tail):
    almost always accepted, so blocks cross window edges and earn bonus tokens."""

    uses_verifier_hidden = False

    def __init__(self, model, context_window: int = 4096, corrupt_every: int = 0):
        from inference_engine.kv.factory import make_cache
        from inference_engine.kv.strategy import KVStrategy

        self.model, self.context_window, self.corrupt_every = model, context_window, corrupt_every
        self._make = lambda: make_cache(KVStrategy("full"), model.geometry(), max_step=4096, max_context=model.spec.max_context)
        self.calls = 0

    def draft(self, context_ids, k, *, context_hidden=None):
        self.calls += 1
        ids = context_ids.tolist()
        out = []
        for _ in range(k):
            cache = self._make()
            logits, _ = forward(self.model, torch.tensor(ids), torch.arange(len(ids)), cache, logits="last")
            cache.commit()
            t = int(logits[-1].argmax())
            if self.corrupt_every and (self.calls + len(out)) % self.corrupt_every == 0:
                t = (t + 1) % self.model.spec.vocab_size
            out.append(t)
            ids.append(t)
        return Draft(torch.tensor(out))
