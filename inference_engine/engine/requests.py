"""Plain request and info objects crossing the engine boundary. No torch, mlx or grpc here:
the session layer and the servers build and read these without loading a framework."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from inference_engine.errors import InvalidArgument


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
        if not math.isfinite(self.temperature) or self.temperature < 0:  # inf would divide every logit to 0: uniform noise
            raise InvalidArgument(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in [0, 1] (0 or 1 = off), got {self.top_p}")


@dataclass(frozen=True)
class GenerateParams:
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: frozenset = frozenset()


@dataclass(frozen=True)
class ModelInfo:
    """What the servers may know about the loaded model (they never see the backend itself)."""

    model_id: str
    vocab_size: int
    eos_token_ids: tuple
    max_context: int
    backend: str  # "torch" | "mlx"
    device: str
    weights: str  # weight format, e.g. "fp32"
    path: str = ""  # local directory the weights were loaded from ("" = unknown)


@dataclass(frozen=True)
class StrategyInfo:
    """The KV strategy as the product reports it: a name and its parameters as strings."""

    name: str
    params: tuple = ()  # ((key, value), ...) sorted; a tuple so the object stays hashable

    def as_dict(self) -> dict:
        return dict(self.params)
