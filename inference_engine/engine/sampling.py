"""Token selection from next-token logits: greedy at temperature 0, seeded sampling otherwise."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> None:
        from inference_engine.errors import InvalidArgument

        if self.temperature < 0 or self.temperature != self.temperature:
            raise InvalidArgument(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in [0, 1] (0 or 1 = off), got {self.top_p}")


def target_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: (..., V) logits -> (..., V) probabilities."""
    x = logits.float() / params.temperature
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
