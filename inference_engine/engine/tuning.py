"""`--threads auto`: pick the intra-op thread count that decodes fastest on this machine.

Rule: for each candidate (1, 2, 4, 8 and the core count, up to the core count) run 2 warm-up
and `steps` timed decode steps of the loaded model on a scratch `full` cache; the candidate
with the lowest median step time wins, and a candidate within 5 % of a smaller one loses to it
(fewer threads leave cores to the rest of the machine). Measured once at startup (~1 s per
candidate for SmolLM2): a shared 2-core box and an 8-core laptop get different answers.
"""
from __future__ import annotations

import os
from collections.abc import Callable
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


def verify_costs(model: Backend, k: int, timed_steps: int = 12, context: int = 64,
                 drafter: Any = None) -> tuple[list[float], float]:
    """What a step that feeds a block of n drafts costs against a decode step on this machine, for n = 0..k: ([1.0,
    c1, .., ck], the draft's share). Each block: the median of `timed_steps` greedy row-exact forwards of n + 1 rows
    (after 2 warm-up ones) over the median of as many one-row ones, on a scratch `full` cache of `context` tokens,
    interleaved and never committed; then made non-decreasing from 1.0 (a block of more rows never costs less: a dip
    is the box's noise, which with 6 steps gave a block of one draft at 0.86 of a decode step on a 2-core VM,
    2026-12-01). With a drafter, one draft of k tokens is timed in the same rounds (its median over the decode step's:
    the share, added to every block of 1..k drafts, since a step that drafts pays its draft too), on made-up inputs of
    the shapes the engine passes (a draft's cost does not depend on the values): a drafter reading the verifier's
    captured layers gets random features for `context` positions, one more a draft as in decoding, and its own state;
    another, `context` token ids. DraftGate weighs what a session's verify steps accept against these."""
    kv = SessionKV(make_cache(KVStrategy("full"), model.geometry(), max_step=max(k + 1, 64),
                              max_context=model.spec.max_context))
    steps.prefill_chunk(model, kv, [10 + i % 200 for i in range(context)])
    cache = kv.cache
    times: dict[int, list[float]] = {n: [] for n in range(k + 1)}
    drafts: list[float] = []
    draft = _timed_draft(drafter, k, context, 2 + timed_steps) if drafter is not None else None
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
        if draft is not None:
            dt = draft()
            if i >= 2:
                drafts.append(dt)
    base = statistics.median(times[0])
    share = statistics.median(drafts) / base if drafts else 0.0
    verify = [1.0]
    for n in range(1, k + 1):
        verify.append(max(verify[-1], statistics.median(times[n]) / base))
    return [1.0] + [c + share for c in verify[1:]], share


def _timed_draft(drafter: Any, k: int, context: int, calls: int) -> Callable[[], float]:
    """A function that runs the next of `calls` drafts on made-up inputs (verify_costs) and returns its seconds."""
    layers = getattr(drafter, "capture_layers", ())
    feats = (torch.randn(context + calls, drafter.config.feature_size, generator=torch.Generator().manual_seed(0))
             if layers else None)
    state = drafter.new_state() if layers else None
    ids = [10 + i % 200 for i in range(getattr(drafter, "context_window", context))]
    position = [context]

    def run() -> float:
        t = time.perf_counter()
        if feats is not None:
            p = position[0]
            drafter.draft(torch.tensor([ids[-1]]), k, context_hidden=feats[:p], state=state, position=p)
            position[0] += 1
        else:
            drafter.draft(torch.tensor(ids), k)
        return time.perf_counter() - t

    return run


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
