"""What every drafter's `draft()` returns, and the error it raises on inputs it cannot use."""
from __future__ import annotations

from collections.abc import Callable

import torch


class DrafterInputError(ValueError):
    """The caller passed inputs the drafter cannot use; the message names the value and the fix."""


class DraftResult:
    """ids (k,); probs (k, V): the drafter's distribution of each slot at the step it was committed, given as the tensor
    or as a function that makes it on first read (the engine accepts drafts as point proposals and never reads them; a
    v2 draft's (k, V) scatter over the verifier's vocabulary is work nobody used, though side by side it was within the
    noise of a draft's time: results/research/drafter_cost_avx512.json, arm `probs`); kv: per layer
    (K, V), v1 (H, T + k, D) of the last pass, v2 its context cache; hidden: (T + k, d) v1 / (block, d) v2, the
    last-layer hidden states of the last pass; steps_used: the passes run."""

    def __init__(self, ids: torch.Tensor, probs: torch.Tensor | Callable[[], torch.Tensor],
                 kv: list[tuple[torch.Tensor, torch.Tensor]], hidden: torch.Tensor, steps_used: int = 0):
        self.ids, self._probs, self.kv, self.hidden, self.steps_used = ids, probs, kv, hidden, steps_used

    @property
    def probs(self) -> torch.Tensor:
        if callable(self._probs):
            self._probs = self._probs()
        return self._probs
