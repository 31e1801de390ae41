"""What every drafter's `draft()` returns, and the error it raises on inputs it cannot use."""
from __future__ import annotations

import dataclasses

import torch


class DrafterInputError(ValueError):
    """The caller passed inputs the drafter cannot use; the message names the value and the fix."""


@dataclasses.dataclass
class DraftResult:
    ids: torch.LongTensor  # (k,)
    probs: torch.Tensor  # (k, V) drafter distribution of each slot at the step it was committed
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V): v1 (H, T + k, D) of the last pass; v2 its context cache
    hidden: torch.Tensor  # (T + k, d) v1 / (block, d) v2: last-layer hidden states of the last pass
    steps_used: int = 0
