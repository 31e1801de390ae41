"""paged, row-exact steps: a few configurations from a seeded differential sweep (verify blocks vs one-token steps,
rejected drafts, and the native recall vs the Python path), chosen to cross several thresholds inside one block.

Python path (int4 weights: row-independent linears, no native step): blocks of mixed sizes 2..8 give the one-token
steps' logits bit for bit, and blocks whose later rows are rejected (commit(n_keep)) leave a cache that goes on as one
that only saw the kept tokens. Native (llama): every row's C++ recall (csrc/paged_rows.h) attends as the Python path
does on the same queries and tables (as test_native_step.test_native_recall_chooses_and_attends_as_the_python_path),
and its one-token steps, blocks and rejected blocks agree bit for bit.

Histories are random tokens. Not covered (they diverge today): low-entropy histories past the trained context or
far_from with the shortlist on (a repeated token's pages tie exactly in far_keys, and the bound's float products break
the tie by the call's shape: docs/paged.md). Exact page-score ties below the context (topk's tie order depended on the
axis' length) were fixed on 2026-12-02: every choice now breaks ties to the lower page, as the native recall does."""
from __future__ import annotations

import functools
import random

import pytest
import torch

from factories import tiny_model_dir
from inference_engine.engine.steps import forward
from inference_engine.kv.factory import make_cache
from inference_engine.kv.strategy import KVStrategy

from kv.test_paged import ids

# (arch, trained context, strategy): each crosses the trained context (64) or far_from, and shortlist_from, inside blocks
PYTHON = {
    # llama past the context: shortlist_from crossed near it, pages spilled to disk
    "llama-ctx-shortlist-spilled": ("llama", 64, KVStrategy("paged", 4, 8, page_size=4, recall_pages=3, shortlist_pages=2,
                                                            shortlist_from=3, page_ram_mb=1e-6)),
    # a local layer (gemma3: window 16) sees fewer pages than it recalls; fp16 K/V; no sink
    "gemma3-ctx-local-recall-8-fp16": ("gemma3", 64, KVStrategy("paged", 0, 4, page_size=2, recall_pages=8, shortlist_pages=1,
                                                                shortlist_from=4, kv_dtype="fp16")),
    # far_from below a long context, spread layout, pages of 3
    "llama-far-spread": ("llama", None, KVStrategy("paged", 0, 12, page_size=3, recall_pages=2, shortlist_pages=3,
                                                   shortlist_from=6, far_from=40, far_layout="spread")),
    # choice_every 3 past the context with far_from 40 before it, fp16, shortlist from 2 pages
    "llama-choice-every-3-far": ("llama", 64, KVStrategy("paged", 1, 4, page_size=4, recall_pages=2, shortlist_pages=1,
                                                         shortlist_from=2, choice_every=3, far_from=40, kv_dtype="fp16")),
    # exact choice (no shortlist), recall_pages beyond every row's pages on the local layer, spilled
    "gemma3-exact-recall-30-spilled": ("gemma3", None, KVStrategy("paged", 4, 4, page_size=4, recall_pages=30,
                                                                  shortlist_pages=0, page_ram_mb=1e-6)),
}
NATIVE = {
    "exact-sink-0-pages-of-3": (64, KVStrategy("paged", 0, 8, page_size=3, recall_pages=3, shortlist_pages=0)),
    "shortlisted-far-spread-spilled": (64, KVStrategy("paged", 1, 4, page_size=4, recall_pages=2, shortlist_pages=1,
                                                      shortlist_from=3, far_from=40, far_layout="spread", page_ram_mb=1e-6)),
    "shortlisted-choice-every-3-fp16": (64, KVStrategy("paged", 4, 4, page_size=2, recall_pages=3, shortlist_pages=2,
                                                       shortlist_from=4, choice_every=3, kv_dtype="fp16")),
}


@functools.lru_cache(maxsize=None)
def _model(arch, context, native=False):
    from inference_engine.backends.torch.model import TorchCausalLM

    m = TorchCausalLM.load(str(tiny_model_dir(arch, **({"max_position_embeddings": context} if context else {}))),
                           weights="int4")
    if native:
        assert m.use_native_step() is True
    else:
        assert m.native_step is None
    return m


def _cache(m, strategy):
    return make_cache(strategy, m.geometry(), max_step=16, max_context=m.spec.max_context)


def _run(m, cache, tokens, sizes, keeps=None):
    """tokens in row-exact blocks of `sizes` (cycled), each committing `keeps` rows (cycled; None: all): (logits of the
    kept rows, the kept tokens)."""
    out, kept, i, b = [], [], 0, 0
    while i < len(tokens):
        part = tokens[i:i + sizes[b % len(sizes)]]
        at = cache.next_position
        logits, _ = forward(m, m.tensor(part), range(at, at + len(part)), cache, row_exact=True)
        keep = len(part) if keeps is None else min(len(part), keeps[b % len(keeps)])
        cache.commit(keep)
        out.append(m.to_host(logits)[:keep])
        kept += part[:keep]
        i += len(part)
        b += 1
    return torch.cat(out), kept


def _schedule(seed):
    rng = random.Random(seed)
    sizes = [rng.randint(2, 8) for _ in range(30)]
    return sizes, [rng.randint(1, s) for s in sizes]


def _first_diff(a, b):
    d = (a != b).any(-1).nonzero().flatten()
    return None if d.numel() == 0 else int(d[0])


@pytest.mark.parametrize("name", list(PYTHON))
def test_verify_blocks_and_rejected_drafts_equal_one_token_steps(name):
    arch, context, strategy = PYTHON[name]
    m = _model(arch, context)
    history = ids(100, seed=len(name))
    sizes, keeps = _schedule(len(name))
    steps, _ = _run(m, _cache(m, strategy), history, [1])
    blocks, _ = _run(m, _cache(m, strategy), history, sizes)
    assert _first_diff(steps, blocks) is None, "a verify block's row differs from its one-token step"
    got, kept = _run(m, _cache(m, strategy), history, sizes, keeps)
    ref, _ = _run(m, _cache(m, strategy), kept, [1])
    assert _first_diff(ref, got) is None, "after rejected drafts the cache differs from one that saw the kept tokens"


@pytest.mark.parametrize("name", list(NATIVE))
def test_native_recall_equals_the_python_path_in_steps_blocks_and_rejected_drafts(name, monkeypatch):
    from factories import require_native
    from inference_engine.kv.paged import PagedCache

    require_native()
    context, strategy = NATIVE[name]
    m = _model("llama", context, native=True)
    history = ids(100, seed=len(name))
    sizes, keeps = _schedule(len(name))
    # the native step's own invariant: whole-step one-token steps, blocks and rejected blocks agree bit for bit
    steps, _ = _run(m, _cache(m, strategy), history, [1])
    blocks, _ = _run(m, _cache(m, strategy), history, sizes)
    assert _first_diff(steps, blocks) is None
    got, kept = _run(m, _cache(m, strategy), history, sizes, keeps)
    ref, _ = _run(m, _cache(m, strategy), kept, [1])
    assert _first_diff(ref, got) is None
    # each layer's native recall against the Python path on the same queries and tables (a different page moves the
    # output by far more than float rounding), one-token steps taken layer by layer ("segments") to pass through it
    native_attend = PagedCache._native_attend
    scale = m.spec.attn_scale if m.spec.attn_scale is not None else m.spec.head_dim ** -0.5
    seen = {"rows": 0, "far": 0, "crossing": 0}

    def checked(self, layer, q, k_all, v_all, layout, plan):
        o = native_attend(self, layer, q, k_all, v_all, layout, plan)
        assert o is not None
        native_choice = None if plan["choice_out"] is None else plan["choice_out"][layer].clone()
        idx, _ = self._choose_pages(layer, q, k_all, plan, None)
        if native_choice is not None:
            assert torch.equal(native_choice, plan["choice_out"][layer])
        want = self._attend_rows(layer, q, k_all, v_all, layout, plan, None, idx, scale, 0.0, 0.0, m.rotate_keys)
        torch.testing.assert_close(o, want, rtol=0, atol=2e-5)
        seen["rows"] += q.shape[1]
        seen["far"] += int(layout.last_position >= self.far_from)
        seen["crossing"] += int(plan["far"] == "some")
        return o

    monkeypatch.setattr(PagedCache, "_native_attend", checked)
    monkeypatch.setattr(m.native_step, "paged_recall", "segments")
    for block_sizes, block_keeps in (([1], None), (sizes, None), (sizes, keeps)):
        _run(m, _cache(m, strategy), history, block_sizes, block_keeps)
    assert seen["rows"] > 0 and seen["far"] > 0 and seen["crossing"] > 0
