"""Token selection from next-token logits: greedy at temperature 0, seeded sampling otherwise."""
from __future__ import annotations

import torch

from inference_engine.engine.requests import SamplingParams

__all__ = ["SamplingParams", "sample", "target_distribution"]


def target_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: (..., V) logits -> (..., V) probabilities."""
    x = logits.float()
    # Shift before scaling: softmax is shift-invariant, and a tiny temperature (say 1e-38) then
    # sends every non-maximal logit to -inf instead of overflowing the maximum to +inf.
    x = (x - x.amax(-1, keepdim=True)) / params.temperature
    v = x.shape[-1]
    if 0 < params.top_k < v:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        p = torch.softmax(sorted_x, -1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (torch.cumsum(p, -1) - p) >= params.top_p
        x = x.scatter(-1, idx, sorted_x.masked_fill(drop, float("-inf")))
    return torch.softmax(x, -1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token from (V,) logits."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = target_distribution(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))
