"""Prefill + decode loops over a session's resident cache.

The engine knows nothing about sessions, tokenization or transports: it takes the tokens
a session has not yet run through the model, prefills them in bounded chunks, then
decodes, yielding events as tokens commit. Per call it does work proportional to the
pending + generated tokens; the history before them lives in the cache.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from inference_engine.engine.events import GenerationDone, HistoryTruncated, TokenGenerated
from inference_engine.engine.sampling import SamplingParams, sample
from inference_engine.errors import NothingToGenerateFrom
from inference_engine.kv.resident import KVStrategy, make_cache


@dataclass
class GenerateParams:
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: frozenset = frozenset()


class SessionKV:
    """A session's engine-side state: its resident cache and the logits of its last token."""

    def __init__(self, cache):
        self.cache = cache
        self.last_logits: torch.Tensor | None = None  # (V,) after the last committed token
        self.last_hidden: torch.Tensor | None = None  # (T, H) hidden states of the last forward

    @property
    def next_position(self) -> int:
        return self.cache.next_position

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    @property
    def resident_positions(self) -> int:
        return self.cache.resident_positions

    @property
    def dropped_total(self) -> int:
        return self.cache.dropped_total


class Engine:
    """One model, one KV strategy; many sessions' states. Thread-safe at step granularity."""

    def __init__(self, model, strategy: KVStrategy, *, prefill_chunk: int = 256, max_threads: int | None = None):
        self.model = model
        self.strategy = strategy
        self.prefill_chunk = prefill_chunk
        # One forward at a time: concurrent sessions interleave step by step.
        self._step_lock = threading.Lock()
        if max_threads:
            torch.set_num_threads(max_threads)

    @property
    def max_context(self) -> int:
        return self.model.spec.max_context

    @property
    def vocab_size(self) -> int:
        return self.model.spec.vocab_size

    def new_session_kv(self) -> SessionKV:
        cache = make_cache(self.strategy, self.model.geometry(), max_step=self.prefill_chunk, max_context=self.max_context)
        return SessionKV(cache)

    def history_limit(self) -> int | None:
        """Longest history the strategy can serve; None = unbounded (positions past the
        trained context use the sink re-anchoring documented in SinkWindowCache)."""
        return None if self.strategy.bounded else self.max_context

    def _forward(self, kv: SessionKV, ids: Sequence[int], logits: str):
        start = kv.cache.next_position
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.model.device)
        pos = torch.arange(start, start + len(ids), device=self.model.device)
        with self._step_lock:
            try:
                out, hidden = self.model.forward(ids_t, pos, kv.cache, logits=logits)
            except BaseException:
                kv.cache.abort()
                raise
            dropped = kv.cache.commit()
        kv.last_hidden = hidden
        return out, dropped

    def prefill(self, kv: SessionKV, pending: Sequence[int], should_stop: Callable[[], bool] = lambda: False) -> tuple[int, bool]:
        """Run pending tokens in chunks; returns (positions dropped from attention, completed)."""
        dropped = 0
        for i in range(0, len(pending), self.prefill_chunk):
            if should_stop():
                return dropped, False
            chunk = pending[i : i + self.prefill_chunk]
            logits, d = self._forward(kv, chunk, "last")
            kv.last_logits = logits[-1]
            dropped += d
        return dropped, True

    def generate(self, kv: SessionKV, pending: Sequence[int], params: GenerateParams, should_stop: Callable[[], bool] = lambda: False) -> Iterator:
        """Yield TokenGenerated / HistoryTruncated events, then one GenerationDone."""
        t0 = time.perf_counter()
        if not pending and kv.last_logits is None:
            raise NothingToGenerateFrom("the session history is empty; append tokens before Generate")
        params.sampling.validate()
        dropped, completed = self.prefill(kv, pending, should_stop)
        prefill_s = time.perf_counter() - t0
        if dropped:
            yield HistoryTruncated(dropped, kv.dropped_total)
        gen = torch.Generator().manual_seed(params.sampling.seed) if not params.sampling.greedy else None
        limit = self.history_limit()
        n, ttft, decode_dropped, reason = 0, 0.0, 0, "max_tokens"
        position = kv.next_position  # position of the next token to sample
        while completed:
            if n >= params.max_tokens:
                break
            if should_stop():
                reason = "cancelled"
                break
            if limit is not None and position >= limit:
                reason = "context_full"
                break
            if n > 0:  # feed the previously sampled token
                logits, d = self._forward(kv, [token], "last")
                kv.last_logits = logits[-1]
                decode_dropped += d
            token = sample(kv.last_logits, params.sampling, gen)
            n += 1
            if n == 1:
                ttft = time.perf_counter() - t0
            yield TokenGenerated(token, position)
            position += 1
            if token in params.eos_token_ids:
                reason = "eos"
                break
        if not completed:
            reason = "cancelled"
        if decode_dropped:
            yield HistoryTruncated(decode_dropped, kv.dropped_total)
        yield GenerationDone(reason, n, len(pending), prefill_s, time.perf_counter() - t0, ttft)
