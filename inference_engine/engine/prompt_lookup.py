"""Draft-free speculation (`--drafter ngram`): prompt lookup over the session's own history.

The last n tokens (n = max_ngram down to min_ngram) are searched for earlier in the history;
the tokens that followed the most recent earlier occurrence are proposed. No match, no draft:
the engine then runs a plain decode step, so a session whose text never repeats decodes
exactly as without speculation. Acceptance is the engine's (speculative.accept_drafts), so
the output is the verifier's whatever is proposed. Agents re-quote tool output, code and
their own earlier turns, which is where the matches come from.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LookupDraft:
    ids: torch.Tensor  # (<= k,) proposed tokens; empty when nothing matched


class PromptLookupDrafter:
    """Stateless: every call searches the context it is given (the engine passes the last
    `context_window` tokens of the history, ending with the token about to be fed)."""

    uses_verifier_hidden = False

    def __init__(self, context_window: int = 4096, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes must satisfy 1 <= min <= max, got min={min_ngram} max={max_ngram}")
        self.context_window, self.max_ngram, self.min_ngram = context_window, max_ngram, min_ngram

    def draft(self, context_ids: torch.Tensor, k: int, *, context_hidden: torch.Tensor | None = None) -> LookupDraft:
        ctx = np.asarray(context_ids, dtype=np.int64)
        return LookupDraft(torch.from_numpy(self.lookup(ctx, k)))

    def lookup(self, ctx: np.ndarray, k: int) -> np.ndarray:
        """Up to k tokens that followed the latest earlier occurrence of ctx's longest matching suffix."""
        n_ctx = ctx.size
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            suffix = ctx[n_ctx - n:]
            # candidate starts: positions i with ctx[i:i+n] == suffix and i + n < n_ctx (something follows)
            hits = np.flatnonzero(ctx[: n_ctx - n] == suffix[0])
            for j in range(1, n):
                hits = hits[ctx[hits + j] == suffix[j]]
            if hits.size:
                start = int(hits[-1]) + n
                return ctx[start : start + k].copy()
        return ctx[:0].copy()
