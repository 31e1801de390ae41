"""Prefill + decode loops over a session's resident cache.

The engine knows nothing about sessions, tokenization or transports: it takes the tokens
a session has not yet run through the model, prefills them in bounded chunks, then
decodes, yielding events as tokens commit. Per call it does work proportional to the
pending + generated tokens; the history before them lives in the cache.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from inference_engine.engine.events import GenerationDone, HistoryTruncated, TokenGenerated
from inference_engine.engine.loop import PAUSE, EngineLoop, Pause
from inference_engine.engine.requests import GenerateParams, ModelInfo, StrategyInfo, check_engine_options
from inference_engine.engine.sampling import sample
from inference_engine.engine.session_kv import SessionKV
from inference_engine.engine import steps
from inference_engine.errors import CacheInvariantError, KakeyaError, NothingToGenerateFrom
from inference_engine.kv import registry
from inference_engine.kv.factory import make_cache
from inference_engine.kv.paged import PagedCache
from inference_engine.kv.strategy import KVStrategy

if TYPE_CHECKING:
    from inference_engine.backends.protocol import Backend
    from inference_engine.engine.model_thread import ModelThread
    from inference_engine.engine.steps import StepInput, StepResult

Event = TokenGenerated | HistoryTruncated | GenerationDone


class Engine:
    """One model, one KV strategy; many sessions' states. Thread-safe at step granularity: each
    session's steps run in order, different sessions' steps may share a forward (batching)."""

    def __init__(self, model: Backend, strategy: KVStrategy, *, prefill_chunk: int = 256, max_threads: int | None = None,
                 drafter: Any = None, spec_k: int = 0, drafter_name: str = "", strategy_resources: object = None,
                 batching: str = "auto", prefill_chunk_shared: int = 8, model_thread: ModelThread | None = None):
        """strategy_resources: what the strategy's plugin built for this engine (kv/plugins.py
        StrategyPlugin.build_resources), shared by every cache it makes; None for the built-ins.
        batching: "on" = concurrent sessions' steps share forwards (engine/loop.py), "off" = one
        session's step per forward, "auto" = on where it is exact (row-independent int8/int4 kernels
        of the torch backend), off otherwise. prefill_chunk_shared: with batching on, a forward's tokens
        while other sessions generate: their decode rows first, the prefill chunk the rest, at least half of it
        (0 = whole prefill chunks). model_thread: the ModelThread that runs the
        engine loop (the daemon's), or None to run it on the callers' threads (in-process use).
        drafter: engine/prompt_lookup.py's PromptLookupDrafter or one of kv_cache_proposer's, read by duck typing
        (their `draft` signatures differ: a v2 drafter takes its state and position), hence Any."""
        check_engine_options(prefill_chunk=prefill_chunk, spec_k=spec_k, batching=batching,
                             prefill_chunk_shared=prefill_chunk_shared, has_drafter=drafter is not None)
        self.model = model
        self.strategy = strategy
        self.prefill_chunk = prefill_chunk
        self.drafter = drafter if spec_k else None
        self.spec_k = spec_k
        # [1.0, c1, .., ck]: a verify block of n drafts over a decode step, measured (measure_verify_cost; the daemon
        # does at startup); the draft gate weighs acceptance against it. None: the gate counts empty blocks only.
        self.verify_cost: list[float] | None = None
        # a draft's own cost in decode steps, added to the table's blocks of 1..k drafts (measure_verify_cost); False:
        # the table holds the verify blocks only, as before 2026-12-01 (scripts/bench_speculative.py --draft-gates
        # cost-verify)
        self.draft_cost_in_gate = True
        self.draft_cost = 0.0
        # False: every step drafts spec_k (room permitting), for measuring a drafter's acceptance apart from the gate's
        # timing-dependent choice of which steps draft (scripts/bench_speculative.py --draft-gates none)
        self.gate_drafts = True
        # False: the draft gate counts every empty verify block as a miss, as before 2026-12-01 (DraftGate.record by_gain;
        # scripts/bench_speculative.py --draft-gates cost-before)
        self.gate_by_gain = True
        self.drafter_name = drafter_name if self.drafter is not None else ""
        self.strategy_resources = strategy_resources
        # One forward at a time; concurrent sessions' steps share it when batching is on.
        exact = getattr(model, "kernels_row_independent", False)  # torch int8/int4 on the CPU
        on = batching == "on" or (batching == "auto" and exact)
        if on and not hasattr(model, "cat"):
            raise ValueError(f"the {getattr(model, 'backend_name', '?')} backend cannot batch sessions' steps; use batching off")
        # A forward takes up to one prefill chunk plus 64 rows of decode/verify steps, so sessions
        # that are decoding ride along a long append (one chunk per forward) instead of waiting behind it.
        # While other sessions generate, a forward holds about prefill_chunk_shared tokens (their rows, then a
        # prefill chunk; 0 = whole chunks): their inter-token latency is then one short forward's.
        self.loop = EngineLoop(model, prefill_chunk, row_budget=64, batching=on,
                               shared_prefill=prefill_chunk_shared, model_thread=model_thread)
        if max_threads:
            torch.set_num_threads(max_threads)
        self.new_session_kv()  # fail at startup on a cache this model cannot hold (e.g. a lattice needing head_dim 2^k)

    def measure_verify_cost(self) -> list[float] | None:
        """Measure what a step that drafts 1..spec_k tokens costs here against a decode step - its verify block
        and its draft (tuning.verify_costs, on a scratch cache) - and let the draft gate use it.
        Call it from the thread that owns the model, before serving."""
        if self.drafter is None:
            return None
        from inference_engine.engine.tuning import verify_costs

        with self.model.inference():
            # a step that drafts pays its draft too (a v2 drafter's ~0.8 of a decode step on a 2-core CPU, prompt
            # lookup's ~0.01): in the table, so the gate weighs what drafting costs in all (since 2026-12-01)
            self.verify_cost, self.draft_cost = verify_costs(self.model, self.spec_k,
                                                             drafter=self.drafter if self.draft_cost_in_gate else None)
        return self.verify_cost

    @property
    def model_info(self) -> ModelInfo:
        m, s = self.model, self.model.spec
        path = getattr(m, "path", None)
        return ModelInfo(model_id=m.model_id, vocab_size=s.vocab_size, eos_token_ids=tuple(s.eos_token_ids),
                         max_context=s.max_context, backend=m.backend_name, device=str(m.device), weights=m.weights_format,
                         path=str(path) if path else "")

    def strategy_info(self) -> StrategyInfo:
        """The strategy's name and parameters, with what its resources add (e.g. which model they come from)."""
        params = registry.describe(self.strategy, self.strategy_resources)
        return StrategyInfo(self.strategy.name, tuple(sorted(params.items())))

    @property
    def max_context(self) -> int:
        return self.model.spec.max_context

    @property
    def vocab_size(self) -> int:
        return self.model.spec.vocab_size

    def new_session_kv(self) -> SessionKV:
        cache = make_cache(self.strategy, self.model.geometry(), max_step=self.prefill_chunk, max_context=self.max_context,
                           resources=self.strategy_resources)
        d = self.drafter
        keep = d.context_window if d is not None and d.uses_verifier_hidden else 0
        return SessionKV(cache, hidden_keep=keep, capture_layers=getattr(d, "capture_layers", ()) if keep else ())

    def history_limit(self) -> int | None:
        """Longest history the strategy can serve; None = unbounded (sink_window: positions past
        the trained context use the sink re-anchoring documented in SinkWindowCache; paged: InfLLM's
        layout, kv/paged.py). `full` attends at true positions and stops at the trained context."""
        if self.strategy.name == "paged" and not hasattr(self.model, "rotate_keys"):
            return self.max_context  # past the context paged moves recalled keys with the backend's rotate_keys (torch)
        return None if self.strategy.unbounded else self.max_context

    def prefill(self, kv: SessionKV, pending: Sequence[int], should_stop: Callable[[], bool] = lambda: False,
                written: Sequence[int] | None = None) -> tuple[int, bool]:
        """Run pending tokens in chunks (through the engine loop); returns (positions dropped from attention, completed).
        written: the tokens the session holds (needed only where `_switch_far` must re-encode them)."""
        return self.loop.run(self._prefill(kv, pending, should_stop, written))

    def _prefill(self, kv: SessionKV, pending: Sequence[int], should_stop: Callable[[], bool],
                 written: Sequence[int] | None = None) -> Generator[StepInput | Pause, Any, tuple[int, bool]]:
        """prefill's task: a chunk per forward, shorter while other sessions generate."""
        if pending and not (yield from self._switch_far(kv, lambda: written, kv.next_position + len(pending), should_stop)):
            return 0, False
        dropped, i = 0, 0
        while i < len(pending):
            if should_stop():
                return dropped, False
            n = self.loop.prefill_tokens(self.prefill_chunk)
            dropped += (yield from steps.prefill_chunk_task(self.model, kv, pending[i : i + n])).dropped
            i += n
        return dropped, True

    def _switch_far(self, kv: SessionKV, written: Callable[[], Sequence[int] | None], end: int,
                    should_stop: Callable[[], bool]) -> Generator[StepInput | Pause, Any, bool]:
        """Before writing positions up to `end` (exclusive): a `paged` session with far_after "context" that would pass
        the trained context runs from now on as one that ran far_from from its start (docs/paged.md, "far_from once
        past the context"). Holding no position past far_from, it is only switched; else it is re-encoded first into a
        new cache that runs far_from throughout, which it then adopts: its K/V of the positions under far_from copied
        (PagedCache.copy_rows: nothing under far_from depends on it), its tokens from there on (`written()`: positions
        0 .. next_position - 1, asked for only then) prefilled (all of them where the copy cannot be exact). It then
        equals, bit for bit, a session that ran far_from from its start and prefilled those tokens in the same chunks
        (a prefill chunk past far_from is not the one-token steps bit for bit on the Python recall path). False:
        should_stop ended the re-encode (the session is as before; the next turn starts it again). Both caches are held
        while it runs, and counted as the session's (`kv.reencoding`)."""
        cache = kv.cache
        if not isinstance(cache, PagedCache) or not cache.far_switch_due(end):
            return True
        if kv.next_position <= cache.far_target:
            cache.switch_far()
            return True
        tokens = written()
        if tokens is None or len(tokens) < kv.next_position:
            raise ValueError(f"the session must be re-encoded from its {kv.next_position} tokens to pass the trained "
                             f"context (far_after 'context'), and they were not given")
        fresh = self.new_session_kv()
        assert isinstance(fresh.cache, PagedCache)
        fresh.cache.switch_far()
        kv.reencoding = fresh  # counted as the session's bytes while both are held
        try:
            # positions under far_from are the same bits either way: copied, not encoded again (0 where they cannot be),
            # unless the drafter's features would then miss rows the encode gives them
            copied = (cache.copyable_prefix(fresh.cache) if self._chunk_invariant()
                      and kv.next_position - cache.far_target >= fresh.hidden_keep else 0)
            for a in range(0, copied, self.prefill_chunk):  # a chunk at a time, the other sessions' forwards between
                if should_stop():
                    return False
                cache.copy_rows(fresh.cache, a, min(copied, a + self.prefill_chunk))
                yield PAUSE
            _, completed = yield from self._prefill(fresh, tokens[copied: kv.next_position], should_stop)
        except CacheInvariantError as e:  # the new cache's, not the session's: that one is intact and stays
            raise KakeyaError(f"re-encoding the session to pass the trained context failed ({e}); the session keeps the "
                              f"cache it had (what this turn committed before stays)") from e
        finally:
            kv.reencoding = None
        if completed:
            kv.adopt(fresh)
            kv.reencoded_tokens += fresh.next_position - copied
        return completed

    def _chunk_invariant(self) -> bool:
        """Whether a position's K/V are the same bits however the prefill was chunked, on either side of far_from: the
        backend's fused row step takes prefill chunks and paged recall (each row as the one-token step at its position)
        over row-independent kernels (the native CPU step on int8/int4 weights). Only then may a re-encode copy the K/V
        under far_from (`_switch_far`): elsewhere a chunk spanning far_from attends its rows under it batched in one
        layout and in the other as a far_from session's would (kv/paged.py `_attend_rows`), and fp32 linears differ
        with the rows beside them, so those positions are encoded again."""
        m = self.model
        return bool(getattr(m, "kernels_row_independent", False) and getattr(m, "row_step_takes_prefill", False)
                    and getattr(m, "paged_row_attention", None) is not None)

    def _draft(self, kv: SessionKV, context: list, k: int) -> list:
        """Ask the drafter for up to k tokens after `context` (which ends with the token about
        to be fed); the drafter re-encodes a bounded tail and keeps no state."""
        if k <= 0:
            return []
        d = self.drafter
        if d is None:  # no drafter, no drafts (spec_k 0)
            return []
        layers = getattr(d, "capture_layers", ())
        if layers:  # v2: the last token + the captured layers' features of the positions before it, and its own cache
            if kv.capture_layers != tuple(layers):  # a session saved under another drafter: features rebuild from here
                kv.capture_layers, kv.recent_hidden, kv.hidden_keep = tuple(layers), None, d.context_window
            if kv.drafter_state is None:
                kv.drafter_state = d.new_state()
            last = torch.tensor(context[-1:], dtype=torch.long)
            res = d.draft(last, k, context_hidden=kv.recent_hidden, state=kv.drafter_state, position=kv.next_position)
            return [int(t) for t in res.ids[:k]]
        tail = context[-d.context_window :]
        hidden = None
        if d.uses_verifier_hidden and kv.recent_hidden is not None:
            have = min(len(tail) - 1, kv.recent_hidden.shape[0])  # the last token was not fed yet
            hidden = kv.recent_hidden[kv.recent_hidden.shape[0] - have :] if have > 0 else None
            tail = tail[len(tail) - 1 - have :] if hidden is not None else tail
        ids = torch.tensor(tail, dtype=torch.long)
        res = d.draft(ids, k, context_hidden=hidden)
        return [int(t) for t in res.ids[:k]]

    def _advance(self, kv: SessionKV, token: int, drafts: list, params: GenerateParams, gen: torch.Generator | None,
                 budget: int) -> Generator[StepInput, Any, StepResult]:
        """Feed `token` (and a drafted block) in one step (a task); the result's `emitted` are the next tokens."""
        # A greedy session reads only the argmax of these logits, and every one is consumed by this call
        # (the last emitted token is fed by the next turn's prefill), so its steps take the cheaper head.
        greedy = params.sampling.greedy
        if drafts:
            return (yield from steps.verify_block_task(self.model, kv, token, drafts, params.sampling, gen, budget=budget,
                                                       eos_token_ids=params.eos_token_ids, greedy=greedy))
        step = yield from steps.decode_step_task(self.model, kv, token, greedy=greedy)
        if kv.last_logits is None:
            raise RuntimeError("decode_step left the session without logits to sample")
        return dataclasses.replace(step, emitted=(sample(kv.last_logits, params.sampling, gen),))

    def generate(self, kv: SessionKV, history: Sequence[int], params: GenerateParams, should_stop: Callable[[], bool] = lambda: False,
                 arrived_at: float | None = None, on_token: Callable[[int], None] | None = None) -> Iterator:
        """Prefill what `history` holds past the cache, then decode. Yields TokenGenerated /
        HistoryTruncated events, then one GenerationDone. `history` is read, never written.
        Times count from `arrived_at` (a perf_counter reading; default: now). The turn runs as a task
        of the engine loop, which may run ahead of this iterator by a step: `on_token(id)` is called
        there as each token is emitted, before the next is computed (the runtime records history with
        it, so history and cache agree even when the caller stops reading). Closing the iterator ends
        the turn at its next step boundary."""
        return self.loop.stream(self._generate(kv, history, params, should_stop, arrived_at, on_token))

    def _generate(self, kv: SessionKV, history: Sequence[int], params: GenerateParams, should_stop: Callable[[], bool],
                  arrived_at: float | None,
                  on_token: Callable[[int], None] | None) -> Generator[StepInput | Event | Pause, Any, None]:
        t0 = time.perf_counter() if arrived_at is None else arrived_at
        reencoded = kv.reencoded_tokens
        pending = history[kv.next_position :]
        if not pending and kv.last_logits is None:
            raise NothingToGenerateFrom("the session history is empty; append tokens before Generate")
        params.sampling.validate()  # the one check of the sampling parameters (servers and in-process callers alike)
        t_prefill = time.perf_counter()
        dropped, completed = yield from self._prefill(kv, pending, should_stop, history)
        prefill_s = time.perf_counter() - t_prefill
        if dropped:
            yield HistoryTruncated(dropped, kv.dropped_total)
        gen = torch.Generator().manual_seed(params.sampling.seed) if not params.sampling.greedy else None
        limit = self.history_limit()
        context = list(history[-self.drafter.context_window :]) if self.drafter is not None else []
        n, ttft, decode_dropped, drafted, accepted, reason = 0, 0.0, 0, 0, 0, "max_tokens"
        reencode_decode_s = 0.0
        position = kv.next_position  # position of the next token to sample
        token = None  # sampled, not yet fed
        out: list = []
        # the tokens emitted so far: with the history's, what a paged session's `_switch_far` may re-encode
        held, emitted = kv.next_position, []
        if completed and params.max_tokens > 0 and (limit is None or position < limit) and not should_stop():
            assert kv.last_logits is not None  # the prefill's, or checked above when nothing was pending
            out = [sample(kv.last_logits, params.sampling, gen)]
        elif completed and limit is not None and position >= limit:
            reason = "context_full"  # the history already fills what the strategy can attend to
        while out:
            for t in out:
                n += 1
                if n == 1:
                    ttft = time.perf_counter() - t0
                if on_token is not None:
                    on_token(t)
                yield TokenGenerated(t, position)
                position += 1
            token = out[-1]
            if token in params.eos_token_ids:
                reason = "eos"
                break
            if n >= params.max_tokens:
                break
            if should_stop():
                reason = "cancelled"
                break
            if limit is not None and position >= limit:
                reason = "context_full"
                break
            # Feed `token` (plus a drafted block); keep what the verifier accepts.
            if self.drafter is not None:
                context = (context + out)[-self.drafter.context_window :]
            budget = params.max_tokens - n  # tokens this step may still emit
            room = budget - 1 if limit is None else min(budget - 1, limit - position - 1)
            room = min(room, kv.cache.exact_step_room() - 1)  # a verify block must reproduce decode steps exactly
            if isinstance(kv.cache, PagedCache) and position <= self.max_context and kv.cache.far_switch_due(position + room):
                # drafts would take a session not yet switched (far_after "context") past the trained context: the block
                # stops under it, so the switch comes at the step that feeds position max_context, drafting or not (the
                # output never depends on the drafts)
                room = self.max_context - position
            drafting = self.drafter is not None and (not self.gate_drafts or kv.draft_gate.open())
            drafts = self._draft(kv, context, min(self.spec_k, room)) if drafting else []
            emitted += out
            t_switch, before = time.perf_counter(), kv.reencoded_tokens
            switched = yield from self._switch_far(kv, lambda: list(history[:held]) + emitted,
                                                   kv.next_position + 1 + len(drafts), should_stop)
            if kv.reencoded_tokens != before or not switched:
                reencode_decode_s += time.perf_counter() - t_switch
            if not switched:
                reason = "cancelled"
                break
            step = yield from self._advance(kv, token, drafts, params, gen, budget)
            if drafts:
                kv.draft_gate.record(step.accepted, len(drafts), self.verify_cost, by_gain=self.gate_by_gain)
            out = list(step.emitted)
            drafted, accepted, decode_dropped = drafted + len(drafts), accepted + step.accepted, decode_dropped + step.dropped
        if not completed:
            reason = "cancelled"
        if decode_dropped:
            yield HistoryTruncated(decode_dropped, kv.dropped_total)
        yield GenerationDone(reason, n, len(pending), prefill_s, time.perf_counter() - t0, ttft, drafted, accepted,
                             kv.reencoded_tokens - reencoded, reencode_decode_s)
