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


def check_engine_options(*, prefill_chunk: int, spec_k: int, batching: str, prefill_chunk_shared: int,
                         has_drafter: bool) -> None:
    """The Engine's own option rules (ValueError naming the option), in one place: Engine() applies them and
    the daemon's ServeConfig.validate() applies them before any model loads."""
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1 (tokens per prefill forward), got {prefill_chunk}")
    if spec_k and not has_drafter:
        raise ValueError("spec_k > 0 needs a drafter")
    if spec_k < 0 or spec_k >= prefill_chunk:
        raise ValueError(f"spec_k must be in [0, {prefill_chunk - 1}], got {spec_k}")
    if batching not in ("auto", "on", "off"):
        raise ValueError(f"batching must be auto, on or off, got {batching!r}")
    if prefill_chunk_shared < 0:
        raise ValueError(f"prefill_chunk_shared must be >= 0, got {prefill_chunk_shared}")
