"""The engine's steps: free functions over a Backend and a session's cache.

`forward` is the one layer loop of the project; `prefill_chunk`, `decode_step` and
`verify_block` each run one committed step and can be called alone (benches, tests).
They take no locks; `Engine` serialises them across sessions.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inference_engine.engine.requests import SamplingParams
from inference_engine.engine.session_kv import SessionKV
from inference_engine.engine.speculative import accept_drafts


def forward(backend, ids, positions, cache, *, logits: str = "all", restored=None, row_exact: bool = False):
    """Run new tokens `ids` (T,) at `positions` (a range, or (T,)) through the model, writing
    their K/V into `cache`; the step is left uncommitted (the caller commits all or a prefix).

    logits: "all" -> (T, V), "last" -> (1, V), "none" -> None. Also returns the final normed
    hidden states (T, hidden), which drafters condition on. restored: a RestoreSource for a
    dlm_restore cache; None = the cache's own (or the model itself for restore_from verifier).
    row_exact: every query row attends as a one-token step would (decode and verify steps), so
    a verified block reproduces sequential decoding bit for bit; prefill chunks attend batched.
    """
    with backend.inference():
        return _forward(backend, ids, positions, cache, logits, restored, row_exact)


def _forward(backend, ids, positions, cache, logits, restored, row_exact):
    layout = cache.prepare(positions, ids)
    layout.row_exact = row_exact
    plan = layout.restore
    step = plan.open_step(_restore_source(backend, cache, restored)) if plan is not None and plan.positions.numel() else None
    try:
        x = backend.embed_ids(ids)
        rope = backend.rope(layout.positions)
        sink_rope = backend.rope(layout.positions * 0 + layout.sink_shift.virtual_query_position) if layout.sink_shift_active else None
        restored_rope = backend.rope(plan.positions) if step is not None else None
        bias = getattr(step, "logit_bias", None)
        paged = getattr(cache, "attend_with_pages", None)  # paged: queries also attend to the pages they recall
        for i in range(backend.spec.num_layers):
            q, k, v = backend.project(i, x)
            q, q_normed = backend.position_q(i, q, rope)
            k_all, v_all = cache.update_and_fetch(i, backend.position_k(i, k, rope), v)
            extra = (*step.kv_for_layer(i), restored_rope, bias) if step is not None else None
            o = paged(i, q, k_all, v_all, layout, backend.spec.attn_scale) if paged is not None else None
            if o is None:  # not paged, or nothing out of the window yet
                o = backend.attend_layout(i, q, q_normed, k_all, v_all, layout, extra, sink_rope)
            x = backend.finish(i, x, o)
            del k_all, v_all, extra, o
    finally:
        if step is not None:
            step.close()
    hidden = backend.final_norm(x)
    if logits == "none":
        return None, hidden
    return backend.logits(hidden[-1:] if logits == "last" else hidden), hidden


def _restore_source(backend, cache, restored):
    source = restored if restored is not None else getattr(cache, "restore_source", None)
    if source is not None:
        return source
    name = getattr(cache, "restore_from", None)
    if name == "verifier":
        return backend.verifier_restore_source()
    raise ValueError(f"this cache restores evicted K/V from {name!r}, which this model cannot supply; pass restored=<RestoreSource>")


@dataclass(frozen=True)
class StepResult:
    committed: int  # tokens kept in the cache
    dropped: int  # positions that left attention for good
    emitted: tuple = ()  # verify_block: accepted drafts + the verifier's next token (not yet fed)
    accepted: int = 0  # verify_block: drafts accepted


def _open(backend, kv: SessionKV, ids: Sequence[int], logits: str, row_exact: bool = False):
    """Forward `ids` at the session's next positions, uncommitted; returns (host logits, hidden).
    On failure the step is aborted and the cache is as before."""
    start = kv.cache.next_position
    try:
        out, hidden = forward(backend, backend.tensor(list(ids)), range(start, start + len(ids)), kv.cache, logits=logits,
                              row_exact=row_exact)
        return backend.to_host(out), hidden
    except BaseException:
        kv.cache.abort()
        raise


def _close(kv: SessionKV, n: int, host, hidden) -> int:
    """Commit the first n tokens of the open step; last_logits become row n - 1 of `host`
    (a "last" step has one row). Returns positions dropped from attention."""
    dropped = kv.cache.commit(n)
    kv.remember_hidden(hidden, n)
    kv.last_logits = host[min(n, host.shape[0]) - 1]
    return dropped


def prefill_chunk(backend, kv: SessionKV, ids: Sequence[int]) -> StepResult:
    """Run a chunk of pending tokens; kv.last_logits then scores the next position."""
    host, hidden = _open(backend, kv, ids, "last")
    return StepResult(len(ids), _close(kv, len(ids), host, hidden))


def decode_step(backend, kv: SessionKV, token: int) -> StepResult:
    """Feed one sampled token; kv.last_logits then scores the next position."""
    host, hidden = _open(backend, kv, [token], "last", row_exact=True)
    return StepResult(1, _close(kv, 1, host, hidden))


def verify_block(backend, kv: SessionKV, token: int, drafts: Sequence[int], sampling: SamplingParams, generator,
                 *, budget: int, eos_token_ids=frozenset()) -> StepResult:
    """Feed `token` and a drafted block in one forward; keep the drafts the verifier accepts
    (speculative.accept_drafts) and draw its next token. At most `budget` tokens are emitted,
    and emission stops after an eos. The emitted tokens but the last are committed."""
    host, hidden = _open(backend, kv, [token, *drafts], "all", row_exact=True)
    try:
        accepted, nxt = accept_drafts(drafts, host, sampling, generator)
    except BaseException:
        kv.cache.abort()
        raise
    emitted = [*accepted, nxt]
    cut = min(budget, next((i + 1 for i, t in enumerate(emitted) if t in eos_token_ids), len(emitted)))
    return StepResult(cut, _close(kv, cut, host, hidden), tuple(emitted[:cut]), len(accepted))
