"""What a generation yields: plain dataclasses the servicer maps to protobuf."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenGenerated:
    token_id: int
    position: int


@dataclass(frozen=True)
class HistoryTruncated:
    dropped_tokens: int
    total_dropped_tokens: int


@dataclass(frozen=True)
class GenerationDone:
    stop_reason: str  # "max_tokens" | "eos" | "cancelled" | "context_full"
    generated_tokens: int
    prefill_tokens: int
    prefill_seconds: float
    total_seconds: float
    time_to_first_token_seconds: float
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # positions the turn ran through the model again: a paged session re-encoded as it passed the trained context
    # (far_after "context", Engine._switch_far); not in prefill_tokens
    reencoded_tokens: int = 0
    # seconds of such a re-encode after the first token (a crossing while decoding): in total_seconds, not decoding
    reencode_decode_seconds: float = 0.0
