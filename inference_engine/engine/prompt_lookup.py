"""Draft-free speculation (`--drafter ngram`): prompt lookup over the session's own history.

The last n tokens (n = max_ngram down to min_ngram) are searched for earlier in the history;
the tokens that followed the most recent earlier occurrence are proposed, as many as the match
earns: a match of n tokens drafts at most k_by_match[n - 1] (one token after a one-token match,
two after two, the engine's k from three on, by default), since a short match predicts the next
token about half the time and its later ones less, while a longer block costs more to verify
(scripts/research/ngram_policy.py, results/research/ngram_policy_avx512.json). No match, no draft:
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

    def __init__(self, context_window: int = 4096, max_ngram: int = 5, min_ngram: int = 1,
                 k_by_match: tuple[int, ...] = (1, 2)):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes must satisfy 1 <= min <= max, got min={min_ngram} max={max_ngram}")
        if any(k < 1 for k in k_by_match):
            raise ValueError(f"k_by_match must be positive draft lengths, got {k_by_match}")
        self.context_window, self.max_ngram, self.min_ngram = context_window, max_ngram, min_ngram
        self.k_by_match = tuple(k_by_match)  # caps for matches of 1, 2, ... tokens; longer matches draft k

    def draft(self, context_ids: torch.Tensor, k: int, *, context_hidden: torch.Tensor | None = None) -> LookupDraft:
        ctx = np.asarray(context_ids, dtype=np.int64)
        return LookupDraft(torch.from_numpy(self.lookup(ctx, k)))

    def lookup(self, ctx: np.ndarray, k: int) -> np.ndarray:
        """Up to k tokens (fewer for a short match: k_by_match) that followed the latest earlier occurrence of ctx's
        longest matching suffix."""
        start, n = self.match(ctx)
        if not n:
            return ctx[:0].copy()
        if n <= len(self.k_by_match):
            k = min(k, self.k_by_match[n - 1])
        return ctx[start : start + k].copy()

    def match(self, ctx: np.ndarray) -> tuple[int, int]:
        """(where the tokens that followed the latest earlier occurrence of ctx's longest matching suffix start, the
        suffix's length n); (-1, 0) when no suffix of min_ngram..max_ngram tokens occurs earlier."""
        n_ctx = ctx.size
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            suffix = ctx[n_ctx - n:]
            # candidate starts: positions i with ctx[i:i+n] == suffix and i + n < n_ctx (something follows)
            hits = np.flatnonzero(ctx[: n_ctx - n] == suffix[0])
            for j in range(1, n):
                hits = hits[ctx[hits + j] == suffix[j]]
            if hits.size:
                return int(hits[-1]) + n, n
        return -1, 0
