"""The engine's steps: free functions over a Backend and a session's cache.

`forward_batch` holds the one layer loop of the project (`forward` is a batch of one);
`prefill_chunk_task`, `decode_step_task` and `verify_block_task` each run one committed step as a
task: a generator that yields the StepInput of its forward and gets the forward's result back.
`Engine` runs them in its EngineLoop (engine/loop.py), which batches concurrent sessions' steps;
`prefill_chunk`, `decode_step` and `verify_block` run one alone (benches, tests). No locks here.
"""
from __future__ import annotations

import itertools
from collections.abc import Container, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from inference_engine.engine.requests import SamplingParams
from inference_engine.engine.session_kv import SessionKV
from inference_engine.engine.speculative import accept_drafts

if TYPE_CHECKING:
    import torch

    from inference_engine.backends.protocol import Backend
    from inference_engine.kv.layout import ExtraKeyStep
    from inference_engine.kv.slot_cache import SlotKVCache

R = TypeVar("R")
# A forward's result per StepInput: (logits (T, V) / (1, V) / None, final hidden (T, hidden)), backend arrays.
ForwardResult = tuple[Any, Any]


@dataclass
class StepInput:
    """One session's part of a forward: new tokens `ids` (T,) at `positions`, into `cache`."""

    ids: Any  # (T,) backend tensor
    positions: range
    cache: SlotKVCache
    logits: str = "all"  # "all" -> (T, V), "last" -> (1, V), "none" -> None
    row_exact: bool = False  # each query row attends as a one-token step would (decode, verify)
    capture: tuple = ()  # layers whose output (residual stream) to keep for a v2 drafter; () = none, no cost
    greedy: bool = False  # the caller takes only the argmax of these logits (backend.logits' cheaper scoring)
    captured: Any = None  # set by the forward when `capture`: (T, len(capture) * hidden), layers in order


# A step as a task: yields its StepInput, is sent the forward's result (None to start it), returns its value.
StepTask = Generator[StepInput, Any, R]


def forward(backend: Backend, ids: Any, positions: range, cache: SlotKVCache, *, logits: str = "all",
            row_exact: bool = False) -> ForwardResult:
    """Run new tokens `ids` (T,) at `positions` (a range) through the model, writing their K/V
    into `cache`; the step is left uncommitted (the caller commits all or a prefix).

    logits: "all" -> (T, V), "last" -> (1, V), "none" -> None. Also returns the final normed
    hidden states (T, hidden), which drafters condition on. row_exact: every query row attends
    as a one-token step would (decode and verify steps), so a verified block reproduces
    sequential decoding bit for bit; prefill chunks attend batched.
    """
    return forward_batch(backend, [StepInput(ids, positions, cache, logits, row_exact)])[0]


def forward_batch(backend: Backend, inputs: Sequence[StepInput]) -> list[ForwardResult]:
    """One forward over several sessions' steps: the linear layers run on every session's rows
    at once, attention runs per session over its own cache. Returns (logits, hidden) per input.
    With row-independent kernels (int8/int4 weights) each session's result is bit for bit what
    it would be alone. On failure every step is aborted (each cache as before) and it raises."""
    with backend.inference():
        items = []
        try:
            for inp in inputs:
                items.append(_Item(backend, inp))
            return _forward_items(backend, items)
        except BaseException:
            for inp in inputs:
                inp.cache.abort()
            raise
        finally:
            for item in items:
                item.close()


class _Item:
    """A StepInput during the forward: its cache's layout, the layout's extra keys and RoPE tables."""

    def __init__(self, backend: Backend, inp: StepInput):
        self.inp, self.cache = inp, inp.cache
        self.extra: ExtraKeyStep | None = None
        self.t = len(inp.positions)
        layout = self.layout = inp.cache.prepare(inp.positions, inp.ids)
        layout.row_exact = inp.row_exact
        if layout.extra_keys is not None:  # keys the cache supplies besides its store's (kv/layout.py)
            self.extra = layout.extra_keys.open(backend)
        shift = layout.sink_shift  # sink_shift_active implies it is set
        self.sink_rope = (backend.rope(layout.positions * 0 + shift.virtual_query_position)
                          if shift is not None and layout.sink_shift_active else None)
        # paged: queries also attend to the pages they recall (None: this step recalls nothing, as sink_window attends)
        hook = getattr(inp.cache, "recall_hook", None)
        self.paged = (hook(getattr(backend, "rotate_keys", None), getattr(backend, "resident_rows_attention", None),
                           getattr(backend, "recalled_row_attention", None), getattr(backend, "paged_row_attention", None))
                      if hook is not None else None)

    def attend(self, backend: Backend, i: int, q: Any, q_normed: Any, k: Any, v: Any) -> Any:
        """Layer i's attention output (H, T, D) for this item's rows (k positioned, v raw)."""
        k_all, v_all = self.cache.update_and_fetch(i, k, v)
        extra = self.extra.for_layer(i) if self.extra is not None else None
        o = (self.paged(i, q, k_all, v_all, self.layout, backend.spec.attn_scale, getattr(backend, "rotate_keys", None))
             if self.paged is not None else None)
        if o is None:  # not paged, or nothing out of the window yet
            o = backend.attend_layout(i, q, q_normed, k_all, v_all, self.layout, extra, self.sink_rope)
        return o

    def close(self) -> None:
        if self.extra is not None:
            self.extra.close()
            self.extra = None


def _forward_items(backend: Backend, items: list[_Item]) -> list[ForwardResult]:
    fused = _row_step(backend, items)
    if fused is not None:
        return fused
    # A step that mixes rows the backend's fused row step takes (decode rows, verify blocks) with others (a prefill
    # chunk, a paged session's rows): the former still go through it, so a session's row step runs the same kernels
    # whatever else shares its forward (its output stays what it is alone), the rest through the layer loop.
    exact = [i for i, it in enumerate(items) if _row_eligible(backend, it)]
    if exact and len(exact) < len(items):
        fused = _row_step(backend, [items[i] for i in exact])
        if fused is not None:
            taken = set(exact)
            rest = iter(_forward_plain(backend, [it for i, it in enumerate(items) if i not in taken]))
            done = iter(fused)
            return [next(done) if i in taken else next(rest) for i in range(len(items))]
    return _forward_plain(backend, items)


def _forward_plain(backend: Backend, items: list[_Item]) -> list[ForwardResult]:
    """The layer loop over every item's rows: the backend's pieces, attention per session."""
    if len(items) == 1:  # the common case: no concatenation, the tensors as they are
        it = items[0]
        ids, rope, bounds = it.inp.ids, backend.rope(it.layout.positions), None
    else:
        ids = backend.cat([it.inp.ids for it in items], 0)
        rope = backend.rope(backend.cat([it.layout.positions for it in items], 0))
        ends = list(itertools.accumulate(it.t for it in items))
        bounds = list(zip([0, *ends[:-1]], ends))
    want = {i for it in items for i in it.inp.capture}
    kept = {}
    # the dense work between attentions as captured graphs (backends/torch/graphs.py), if the backend has them;
    # not while extra keys are served (their source may run the model's pieces between the segments)
    runner = backend.step_runner(sum(it.t for it in items)) if all(it.extra is None for it in items) else None
    if runner is not None:  # it embeds inside its first graph
        q, q_normed, k, v = runner.start(ids, rope)
    else:
        x = backend.embed_ids(ids)
    batched = bounds is not None and _batched_decode(backend, items)
    scratch: dict = {}
    n = backend.spec.num_layers
    for i in range(n):
        if runner is None:
            q, k, v = backend.project(i, x)
            q, q_normed = backend.position_q(i, q, rope)
            k = backend.position_k(i, k, rope)
        if bounds is None:
            o = items[0].attend(backend, i, q, q_normed, k, v)
        elif batched:  # one attention call for every session's decode row
            kvs = [it.cache.update_and_fetch(i, k[:, a:b], v[:, a:b]) for it, (a, b) in zip(items, bounds)]
            o = backend.attend_decode_batch(i, q, kvs, [it.layout for it in items], scratch)
        else:
            o = backend.cat([it.attend(backend, i, q[:, a:b], q_normed[:, a:b], k[:, a:b], v[:, a:b])
                             for it, (a, b) in zip(items, bounds)], 1)
        if runner is None:
            x = backend.finish(i, x, o)
        elif i + 1 < n:
            x, (q, q_normed, k, v) = runner.advance(i, o)
        else:
            x, hidden = runner.advance(i, o)
            hidden = hidden.clone()  # the runner's buffers are overwritten by its next step; drafters keep this
        if i in want:
            kept[i] = x
        del o
    if want:
        for it, (a, b) in zip(items, bounds or [(0, items[0].t)]):
            if it.inp.capture:
                it.inp.captured = backend.cat([kept[i][a:b] for i in it.inp.capture], -1)
    if runner is None:
        hidden = backend.final_norm(x)
    if bounds is None:
        return [_logits(backend, items[0].inp, hidden)]
    return [_logits(backend, it.inp, hidden[a:b]) for it, (a, b) in zip(items, bounds)]


def _row_step(backend: Backend, items: list[_Item]) -> list[ForwardResult] | None:
    """A step of decode rows and verify blocks only (and prefill chunks, where the backend's row step takes
    them), over plain slabs (no recalled pages, extra keys or sink re-anchoring), as the backend's fused row
    step if it has one (backends/torch/row_graphs.py: the whole step as one captured graph over its K/V arena;
    backends/torch/native.py: one C++ call), which writes every layer's rows into the caches' stores itself.
    None: not such a step, or the backend declined it."""
    row_step = getattr(backend, "row_step", None)
    if row_step is None or not all(_row_eligible(backend, it) for it in items):
        return None
    want = sorted({i for it in items for i in it.inp.capture})
    out = row_step([(it.inp.ids, it.layout, it.cache.store) for it in items], tuple(want))
    if out is None:
        return None
    logits, hidden, captured = out
    for it in items:
        it.cache.rows_written()
    if want:  # each item's captured layers, in its order, from the step's (R, len(want) * hidden)
        h, a = hidden.shape[-1], 0
        for it in items:
            if it.inp.capture:
                cols = [want.index(i) for i in it.inp.capture]
                rows = captured[a:a + it.t].view(it.t, len(want), h)
                it.inp.captured = rows[:, cols].reshape(it.t, len(cols) * h)
            a += it.t
    if logits is None:  # the backend left the head to us
        return _row_logits(backend, items, hidden)
    results: list[ForwardResult] = []
    a = 0
    for it in items:
        b, kind = a + it.t, it.inp.logits
        results.append((None if kind == "none" else logits[b - 1:b] if kind == "last" else logits[a:b], hidden[a:b]))
        a = b
    return results


def _row_eligible(backend: Backend, it: _Item) -> bool:
    """An item for the backend's fused row step: row-exact (or a prefill chunk, where that step takes them: its
    rows then attend as one-token steps would, so a prompt's K/V is what decoding it token by token writes), over
    plain slabs: no extra keys, and no recalled pages or sink re-anchoring unless the kv layer hands the backend the
    step (layout.recall: a paged decode step, its recall moving the sink past the trained context itself), and no
    captured layers unless that step keeps them."""
    return ((it.inp.row_exact or getattr(backend, "row_step_takes_prefill", False))
            and (not it.inp.capture or getattr(backend, "row_step_captures", False))
            and it.extra is None and ((it.sink_rope is None and it.paged is None) or it.layout.recall is not None))


def _row_logits(backend: Backend, items: list[_Item], hidden: Any) -> list[ForwardResult]:
    """Each item's logits from the step's hidden rows: the rows they want through one head call when every
    item takes the same kind of scoring (the head's kernels are row-independent on the backends that get
    here, so a row's logits do not depend on the others'), else item by item."""
    spans, a = [], 0
    for it in items:
        spans.append((a, a + it.t))
        a += it.t
    if len(items) == 1 or len({it.inp.greedy for it in items}) != 1:
        return [_logits(backend, it.inp, hidden[a:b]) for it, (a, b) in zip(items, spans)]
    pick: list[int] = []
    for it, (a, b) in zip(items, spans):
        kind = it.inp.logits
        pick += [] if kind == "none" else [b - 1] if kind == "last" else list(range(a, b))
    logits: Any = None
    if pick:
        rows = hidden if len(pick) == hidden.shape[0] else hidden[backend.tensor(pick)]
        logits = backend.logits(rows, greedy=True) if items[0].inp.greedy else backend.logits(rows)
    results: list[ForwardResult] = []
    at = 0
    for it, (a, b) in zip(items, spans):
        kind = it.inp.logits
        n = 0 if kind == "none" else 1 if kind == "last" else b - a
        results.append((None if kind == "none" else logits[at:at + n], hidden[a:b]))
        at += n
    return results


def _batched_decode(backend: Backend, items: list[_Item]) -> bool:
    """Whether these sessions' attention runs as one batched call: every item a one-token decode row
    over a plain slab (no recalled pages, extra keys, sink re-anchoring or encoded rows), on a
    backend that batches it (CUDA: one call instead of one per session; on the CPU the per-session
    calls keep a session's output bit-identical to running alone)."""
    return backend.batches_decode_attention and all(
        it.t == 1 and it.extra is None and it.sink_rope is None and it.paged is None and it.layout.key_slots is None
        and not it.layout.whole_rows for it in items)


def _logits(backend: Backend, inp: StepInput, hidden: Any) -> ForwardResult:
    if inp.logits == "none":
        return None, hidden
    h = hidden[-1:] if inp.logits == "last" else hidden
    return (backend.logits(h, greedy=True) if inp.greedy else backend.logits(h)), hidden


@dataclass(frozen=True)
class StepResult:
    committed: int  # tokens kept in the cache
    dropped: int  # positions that left attention for good
    emitted: tuple = ()  # verify_block: accepted drafts + the verifier's next token (not yet fed)
    accepted: int = 0  # verify_block: drafts accepted


def solo(backend: Backend, task: StepTask[R]) -> R:
    """Run a step task (the `*_task` functions below) alone: each StepInput it yields is one forward."""
    send, err = None, None
    while True:
        try:
            inp = task.throw(err) if err is not None else task.send(send)
        except StopIteration as stop:
            return stop.value
        send = err = None
        try:
            send = forward_batch(backend, [inp])[0]
        except BaseException as e:  # thrown into the task, which aborts its step and re-raises
            err = e


def _open(backend: Backend, kv: SessionKV, ids: Sequence[int], logits: str, row_exact: bool = False,
          greedy: bool = False) -> StepTask[tuple[torch.Tensor, Any]]:
    """Forward `ids` at the session's next positions, uncommitted (a task: yields the StepInput, gets the
    forward's result); returns (host logits, drafter features): the final hidden states, or the captured
    layers' outputs when kv.capture_layers. greedy: the logits serve only an argmax (StepInput.greedy).
    On failure (or if the task is closed at its yield) the step is aborted and the cache is as before."""
    start = kv.cache.next_position
    inp = StepInput(backend.tensor(list(ids)), range(start, start + len(ids)), kv.cache, logits, row_exact=row_exact,
                    capture=kv.capture_layers, greedy=greedy)
    try:
        out, hidden = yield inp
        return backend.to_host(out), (inp.captured if inp.capture else hidden)
    except BaseException:
        kv.cache.abort()
        raise


def _close(kv: SessionKV, n: int, host: torch.Tensor, hidden: Any) -> int:
    """Commit the first n tokens of the open step; last_logits become row n - 1 of `host`
    (a "last" step has one row). Returns positions dropped from attention."""
    dropped = kv.cache.commit(n)
    kv.remember_hidden(hidden, n)
    kv.last_logits = host[min(n, host.shape[0]) - 1]
    return dropped


def prefill_chunk_task(backend: Backend, kv: SessionKV, ids: Sequence[int]) -> StepTask[StepResult]:
    """Run a chunk of pending tokens; kv.last_logits then scores the next position."""
    host, hidden = yield from _open(backend, kv, ids, "last")
    return StepResult(len(ids), _close(kv, len(ids), host, hidden))


def decode_step_task(backend: Backend, kv: SessionKV, token: int, *, greedy: bool = False) -> StepTask[StepResult]:
    """Feed one sampled token; kv.last_logits then scores the next position. greedy: the caller
    takes only their argmax (then logits outside the backend's best candidates may be approximate)."""
    host, hidden = yield from _open(backend, kv, [token], "last", row_exact=True, greedy=greedy)
    return StepResult(1, _close(kv, 1, host, hidden))


def verify_block_task(backend: Backend, kv: SessionKV, token: int, drafts: Sequence[int], sampling: SamplingParams,
                      generator: torch.Generator | None, *, budget: int, eos_token_ids: Container[int] = frozenset(),
                      greedy: bool = False) -> StepTask[StepResult]:
    """Feed `token` and a drafted block in one forward; keep the drafts the verifier accepts
    (speculative.accept_drafts) and draw its next token. At most `budget` tokens are emitted,
    and emission stops after an eos. The emitted tokens but the last are committed. greedy: as
    decode_step's (only with greedy `sampling`)."""
    if greedy and not sampling.greedy:
        raise ValueError("verify_block: greedy logits serve greedy sampling only")
    host, hidden = yield from _open(backend, kv, [token, *drafts], "all", row_exact=True, greedy=greedy)
    try:
        accepted, nxt = accept_drafts(drafts, host, sampling, generator)
    except BaseException:
        kv.cache.abort()
        raise
    emitted = [*accepted, nxt]
    cut = min(budget, next((i + 1 for i, t in enumerate(emitted) if t in eos_token_ids), len(emitted)))
    return StepResult(cut, _close(kv, cut, host, hidden), tuple(emitted[:cut]), len(accepted))


def prefill_chunk(backend: Backend, kv: SessionKV, ids: Sequence[int]) -> StepResult:
    """prefill_chunk_task, run alone."""
    return solo(backend, prefill_chunk_task(backend, kv, ids))


def decode_step(backend: Backend, kv: SessionKV, token: int, *, greedy: bool = False) -> StepResult:
    """decode_step_task, run alone."""
    return solo(backend, decode_step_task(backend, kv, token, greedy=greedy))


def verify_block(backend: Backend, kv: SessionKV, token: int, drafts: Sequence[int], sampling: SamplingParams,
                 generator: torch.Generator | None, *, budget: int, eos_token_ids: Container[int] = frozenset(),
                 greedy: bool = False) -> StepResult:
    """verify_block_task, run alone."""
    return solo(backend, verify_block_task(backend, kv, token, drafts, sampling, generator, budget=budget,
                                           eos_token_ids=eos_token_ids, greedy=greedy))
