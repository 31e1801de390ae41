"""`--threads auto`: pick the intra-op thread count that decodes fastest on this machine.

Rule: for each candidate (1, 2, 4, 8 and the core count, up to the core count) run 2 warm-up
and `steps` timed decode steps of the loaded model on a scratch `full` cache; the candidate
with the lowest median step time wins, and a candidate within 5 % of a smaller one loses to it
(fewer threads leave cores to the rest of the machine). Measured once at startup (~1 s per
candidate for SmolLM2): a shared 2-core box and an 8-core laptop get different answers.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch

from inference_engine.engine import steps
from inference_engine.engine.session_kv import SessionKV
from inference_engine.kv.factory import make_cache
from inference_engine.kv.strategy import KVStrategy

if TYPE_CHECKING:
    from inference_engine.backends.protocol import Backend
    from inference_engine.engine.generate import Engine


def thread_candidates(cores: int | None = None) -> list[int]:
    cores = cores or os.cpu_count() or 1
    return sorted({n for n in (1, 2, 4, 8, cores) if n <= cores})


def fastest_thread_count(model: Backend, candidates: list[int] | None = None,
                         timed_steps: int = 8) -> tuple[int, dict[int, float]]:
    """(best thread count, {threads: median decode step seconds})."""
    before = torch.get_num_threads()
    timings: dict[int, float] = {}
    try:
        for n in candidates or thread_candidates():
            torch.set_num_threads(n)
            kv = SessionKV(make_cache(KVStrategy("full"), model.geometry(), max_step=64, max_context=model.spec.max_context))
            steps.prefill_chunk(model, kv, list(range(10, 42)))
            times = []
            for i in range(2 + timed_steps):
                t = time.perf_counter()
                steps.decode_step(model, kv, 100 + i)
                times.append(time.perf_counter() - t)
            timings[n] = statistics.median(times[2:])
    finally:
        torch.set_num_threads(before)
    best = None
    for n in sorted(timings):
        if best is None or timings[n] < 0.95 * timings[best]:
            best = n
    if best is None:
        raise ValueError("no thread count was timed")
    return best, timings


def native_step_pays(model: Any, threads: int | None = None, timed_steps: int = 8) -> tuple[bool, dict[str, float]]:
    """`--compile auto` on the CPU: whether the backend's native row step (backends/torch/native.py) decodes faster
    than its Python pieces on this machine, at `threads`: 2 warm-up and `timed_steps` decode steps each on a scratch
    `full` cache, interleaved one by one; (native faster, {"native": median s, "python": median s}). model: a torch
    backend (TorchCausalLM: its `native_step` is what is switched)."""
    native = getattr(model, "native_step", None)
    if native is None:
        return False, {}
    before = torch.get_num_threads()
    times: dict[str, list[float]] = {"native": [], "python": []}
    try:
        if threads:
            torch.set_num_threads(threads)
        kvs = {}
        for arm in times:  # each arm's cache prefilled by that arm (the native step takes prefill chunks too)
            model.native_step = native if arm == "native" else None
            kvs[arm] = SessionKV(make_cache(KVStrategy("full"), model.geometry(), max_step=64,
                                            max_context=model.spec.max_context))
            steps.prefill_chunk(model, kvs[arm], list(range(10, 42)))
        for i in range(2 + timed_steps):
            for arm, kv in kvs.items():
                model.native_step = native if arm == "native" else None
                t = time.perf_counter()
                steps.decode_step(model, kv, 100 + i, greedy=True)
                if i >= 2:
                    times[arm].append(time.perf_counter() - t)
    finally:
        model.native_step = native
        torch.set_num_threads(before)
    med = {arm: statistics.median(ts) for arm, ts in times.items()}
    return med["native"] < med["python"], med


def verify_costs(model: Backend, k: int, timed_steps: int = 12, context: int = 64) -> list[float]:
    """What a verify block of n drafts costs against a decode step on this machine, for n = 0..k: [1.0, c1, ..,
    ck], each the median of `timed_steps` greedy row-exact forwards of n + 1 rows (after 2 warm-up ones) over the
    median of as many one-row ones, on a scratch `full` cache of `context` tokens, interleaved and never committed;
    then made non-decreasing from 1.0 (a block of more rows never costs less: a dip is the box's noise, which with 6
    steps gave a block of one draft at 0.86 of a decode step on a 2-core VM, 2026-12-01). DraftGate weighs what a
    session's verify steps accept against these."""
    kv = SessionKV(make_cache(KVStrategy("full"), model.geometry(), max_step=max(k + 1, 64),
                              max_context=model.spec.max_context))
    steps.prefill_chunk(model, kv, [10 + i % 200 for i in range(context)])
    cache = kv.cache
    times: dict[int, list[float]] = {n: [] for n in range(k + 1)}
    for i in range(2 + timed_steps):
        for n in times:
            at = cache.next_position
            ids = model.tensor([100 + (i + j) % 100 for j in range(n + 1)])
            t = time.perf_counter()
            steps.forward_batch(model, [steps.StepInput(ids, range(at, at + n + 1), cache, "all", True, greedy=True)])
            dt = time.perf_counter() - t
            cache.abort()
            if i >= 2:
                times[n].append(dt)
    base = statistics.median(times[0])
    costs = [1.0]
    for n in range(1, k + 1):
        costs.append(max(costs[-1], statistics.median(times[n]) / base))
    return costs


def draft_cost(model: Backend, drafter: Any, k: int, timed: int = 12, context: int = 64) -> float:
    """What one draft of k tokens costs against a decode step on this machine: the median of `timed` draft() calls
    over the median of as many greedy one-row decode steps (after 2 warm-up ones each), interleaved, as decoding
    alternates them. Drafts run on synthetic inputs of the shapes the engine passes (a draft's cost does not depend on
    the values): a drafter reading the verifier's captured layers gets random features for `context` positions,
    growing one position a draft as in decoding, and its own state; another, `context` token ids."""
    kv = SessionKV(make_cache(KVStrategy("full"), model.geometry(), max_step=64, max_context=model.spec.max_context))
    steps.prefill_chunk(model, kv, [10 + i % 200 for i in range(context)])
    gen = torch.Generator().manual_seed(0)
    layers = getattr(drafter, "capture_layers", ())
    feats = torch.randn(context + timed + 3, drafter.config.feature_size, generator=gen) if layers else None
    state = drafter.new_state() if layers else None
    ids = [10 + i % 200 for i in range(getattr(drafter, "context_window", context))]
    position = context
    draft_t: list[float] = []
    step_t: list[float] = []
    for i in range(2 + timed):
        t = time.perf_counter()
        if feats is not None:
            drafter.draft(torch.tensor([ids[-1]]), k, context_hidden=feats[:position], state=state, position=position)
            position += 1
        else:
            drafter.draft(torch.tensor(ids), k)
        dt = time.perf_counter() - t
        at = kv.cache.next_position
        t = time.perf_counter()
        steps.forward_batch(model, [steps.StepInput(model.tensor([100 + i % 100]), range(at, at + 1), kv.cache, "all",
                                                    True, greedy=True)])
        st = time.perf_counter() - t
        kv.cache.abort()
        if i >= 2:
            draft_t.append(dt)
            step_t.append(st)
    return statistics.median(draft_t) / statistics.median(step_t)


def warm_up(engine: Engine, tokens: int = 16) -> float:
    """Generate on a scratch session of the engine's own strategy, through `Engine.generate` as a
    client's turn does (a prefill chunk of `tokens`, greedy decode steps, then a sampled one), and
    drop it: the first forward of a process pays one-time costs (kernel and allocator set-up) that
    would otherwise land on the first client's turn, e.g. the first turn of a session resumed after
    a restart. Returns the seconds it took."""
    from inference_engine.engine.requests import GenerateParams, SamplingParams

    t = time.perf_counter()
    kv = engine.new_session_kv()
    history = list(range(10, 10 + tokens))
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=1)):
        for _ in engine.generate(kv, history, GenerateParams(max_tokens=2, sampling=sampling)):
            pass
    return time.perf_counter() - t
