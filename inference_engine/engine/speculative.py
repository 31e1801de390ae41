"""Speculative verification: accept/reject a block of drafted tokens against verifier logits.

Drafts are treated as point proposals (q = one-hot at the drafted token). That keeps the
output exactly the verifier's for any drafting procedure, including block-diffusion
drafting whose unmasking order is not left to right (its per-position probabilities are
not the conditional proposal distributions Leviathan et al. need):
  greedy:   accept d_i while d_i == argmax(L_{i-1}); the first mismatch is replaced by the
            argmax, and a fully accepted block earns the bonus argmax(L_k);
  sampling: accept d_i with probability p_i(d_i); on rejection draw from p_i with d_i
            removed (the normalized residual max(0, p - q)); a fully accepted block draws
            the bonus token from p_k.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inference_engine.engine.sampling import SamplingParams, draw, target_distribution


def accept_drafts(drafts: Sequence[int], logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> tuple[list, int]:
    """logits: (len(drafts) + 1, V), row i scores the position of drafts[i] (row -1: bonus).

    Returns (accepted drafts, next token drawn from the verifier).
    """
    if params.greedy:
        choice = torch.argmax(logits, dim=-1).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == choice[n]:
            n += 1
        return list(drafts[:n]), choice[n]
    probs = target_distribution(logits, params)
    for i, d in enumerate(drafts):
        u = torch.rand((), generator=gen)
        if u < probs[i, d]:
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        if residual.sum() <= 0:  # p was one-hot at d: rejection had probability 0
            return list(drafts[: i + 1]), draw(probs[i + 1], gen)
        return list(drafts[:i]), draw(residual, gen)
    return list(drafts), draw(probs[len(drafts)], gen)


@dataclass
class DraftGate:
    """Per session: stop drafting for a while when drafting does not pay.

    A verify block costs more than a decode step, so a drafter that keeps missing - prompt lookup on
    prose, say - would make decoding slower than without it. With the engine's measured cost of a verify
    block (`cost[n]`: a block of n drafts over one decode step, engine.Engine.measure_verify_cost), a step
    is a miss while the session's recent verify steps yield less than they cost: `gain`, a moving average
    of (1 + accepted) / cost[drafted], the tokens a verify step gives per decode step's time, below 1.
    Without one, a verify step that accepted nothing is a miss. After the 2nd miss in a row drafting
    pauses for 2 steps, then 4, 8, ... up to 32; a step that pays resets it. Which steps draft never
    changes the output (acceptance keeps it exact)."""

    misses: int = 0
    skip: int = 0
    gain: float = 1.0  # moving average of (1 + accepted) / cost[drafted] (with a measured cost)
    MAX_SKIP = 32
    WEIGHT = 0.25  # of the newest verify step in `gain`

    def open(self) -> bool:
        if self.skip:
            self.skip -= 1
            return False
        return True

    def record(self, accepted: int, drafted: int = 0, cost: Sequence[float] | None = None, *, by_gain: bool = True) -> None:
        """by_gain: with a measured cost for the block's size, the step is a miss when `gain` is below 1 and only then
        (an empty block of one draft, ~1.01-1.07 decode steps, while the average pays is not one); False: every empty
        block is a miss too, as before 2026-12-01, which paused prompt lookup's one-token drafts, whose misses cost
        almost nothing (scripts/research/ngram_policy.py)."""
        measured = cost is not None and 0 < drafted < len(cost)
        if measured:
            assert cost is not None
            self.gain += self.WEIGHT * ((1 + accepted) / cost[drafted] - self.gain)
        if measured and by_gain:
            pays = self.gain >= 1.0
        else:
            pays = bool(accepted) and (cost is None or self.gain >= 1.0)
        if pays:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= 2:
            self.skip = min(self.MAX_SKIP, 2 ** (self.misses - 1))
