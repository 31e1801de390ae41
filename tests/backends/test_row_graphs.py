"""Decode rows and verify blocks as one whole-step graph over a K/V arena (backends/torch/row_graphs.py,
arena.py) compute what the piecewise step computes. On the CPU the graph body runs eagerly over the same
static buffers a CUDA capture replays (padding rows, the arena's scratch slot, per-row masks), so all but
the capture itself is checked here; scripts/gpu_check.py checks the captured graphs on a GPU."""
import gc

import pytest
import torch

from drafters import SelfDrafter
from factories import tiny_model_dir
from inference_engine.backends.torch.arena import ArenaStore
from inference_engine.backends.torch.model import TorchCausalLM
from inference_engine.engine import steps
from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.generate import Engine
from inference_engine.engine.requests import GenerateParams
from inference_engine.kv.factory import cache_from_state
from inference_engine.kv.strategy import KVStrategy


def _model(sessions: int = 0):
    m = TorchCausalLM.load(tiny_model_dir("llama"))
    if sessions:
        assert m.use_row_graphs(sessions, capture=False) == sessions
    return m


def _prompt(n, seed=0):
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine, history, n=24):
    evs = list(engine.generate(engine.new_session_kv(), history, GenerateParams(max_tokens=n)))
    return [e.token_id for e in evs if isinstance(e, TokenGenerated)], evs[-1]


STRATEGIES = [KVStrategy("full"), KVStrategy("sink_window", 4, 12)]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_decode_through_the_row_graph_equals_the_piecewise_step(strategy):
    plain, rows = _model(), _model(sessions=4)
    history = _prompt(40)
    want, _ = _run(Engine(plain, strategy, prefill_chunk=16), history)
    got, _ = _run(Engine(rows, strategy, prefill_chunk=16), history)
    assert got == want
    g = rows.row_graphs
    assert g.steps >= 23 and (1, 128) in g._graphs  # every decode step after the first went through the graph
    assert g.failed is None and g.arena.fallbacks == 0


def test_verify_blocks_through_the_row_graph_reproduce_decoding():
    """Speculation (k = 4, drafts by the verifier itself, every third one corrupted): verify blocks of up to 5
    rows of one session run through the row graph, every row writing its K/V before any row attends, each
    row seeing only the columns a one-token step at its position sees; the output is plain decoding's."""
    plain, rows = _model(), _model(sessions=2)
    history = _prompt(30, seed=3)
    want, _ = _run(Engine(plain, KVStrategy("full"), prefill_chunk=16), history, n=32)
    drafter = SelfDrafter(plain, corrupt_every=3)
    got, done = _run(Engine(rows, KVStrategy("full"), prefill_chunk=16, drafter=drafter, spec_k=4), history, n=32)
    assert got == want
    assert done.accepted_tokens > 0 and done.accepted_tokens < done.drafted_tokens  # accepted and rejected rows
    assert any(rb > 1 for rb, _ in rows.row_graphs._graphs)  # blocks of several rows went through it


def test_a_batched_row_step_equals_each_session_alone():
    """Three sessions' rows in one forward (1, 1 and 3 rows: a 8-row bucket, 3 padding rows): each session's
    logits equal its forward alone, and the caches hold the same rows (up to fp32 rounding: the GEMMs differ)."""
    rows = _model(sessions=4)
    strategy = KVStrategy("full")
    eng = Engine(rows, strategy, prefill_chunk=32)
    caches = []
    for i, n in enumerate((9, 14, 20)):
        kv = eng.new_session_kv()
        steps.prefill_chunk(rows, kv, _prompt(n, seed=i))
        caches.append(kv.cache)
    assert all(isinstance(c.store, ArenaStore) for c in caches)
    ids = [_prompt(t, seed=10 + j) for j, t in enumerate((1, 1, 3))]

    def inputs():
        return [steps.StepInput(rows.tensor(x), range(c.next_position, c.next_position + len(x)), c, row_exact=True)
                for x, c in zip(ids, caches)]

    together = steps.forward_batch(rows, inputs())
    k_together = [c.store.k[0][:, :c.next_position + len(x)].clone() for c, x in zip(caches, ids)]
    for c in caches:
        c.commit(0)
    alone = [steps.forward_batch(rows, [inp])[0] for inp in inputs()]
    for c in caches:
        c.commit(0)
    for (lt, ht), (la, ha) in zip(together, alone):
        torch.testing.assert_close(lt, la, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ht, ha, rtol=1e-5, atol=1e-5)
    for c, x, k in zip(caches, ids, k_together):  # fp32 GEMMs of 8 and of 1-3 rows: equal up to rounding
        torch.testing.assert_close(c.store.k[0][:, :c.next_position + len(x)], k, rtol=1e-5, atol=1e-5)
    assert (8, 128) in rows.row_graphs._graphs


def test_arena_slots_come_back_and_a_full_arena_falls_back():
    """A cache holds an arena slot while it lives; with every slot taken a new cache gets its own slabs
    (its steps run piecewise, with the same tokens); a cache's state round-trips into another arena slot."""
    m = _model(sessions=2)
    arena = m.row_graphs.arena
    eng = Engine(m, KVStrategy("full"), prefill_chunk=16)
    a, b = eng.new_session_kv(), eng.new_session_kv()
    assert arena.free_slots == 0 and isinstance(a.cache.store, ArenaStore)
    history = _prompt(30, seed=7)
    want, _ = _run(Engine(_model(), KVStrategy("full"), prefill_chunk=16), history, n=8)
    fallbacks, made = arena.fallbacks, m.row_graphs.steps
    got, _ = _run(eng, history, n=8)
    assert got == want and arena.fallbacks == fallbacks + 1 and m.row_graphs.steps == made
    del a, b
    gc.collect()
    assert arena.free_slots == 2
    kv = eng.new_session_kv()
    steps.prefill_chunk(m, kv, history)
    back = cache_from_state(kv.cache.state(), m.geometry(), max_step=16, max_context=m.spec.max_context)
    assert isinstance(back.store, ArenaStore) and back.store.slot != kv.cache.store.slot
    for layer in (0, m.spec.num_layers - 1):
        assert torch.equal(back.store.k[layer], kv.cache.store.k[layer])
        assert torch.equal(back.store.v[layer], kv.cache.store.v[layer])


@pytest.mark.slow  # inductor compiles of the three segment functions (~30-60 s on 2 cores)
def test_row_graphs_over_inductor_segments_generate_what_eager_pieces_do(tmp_path, monkeypatch):
    """--compile on (CUDA): the row step's dense work through inductor's compiled segments; here on the CPU's
    inductor, uncaptured: the tokens are the piecewise step's."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    plain = _model()
    rows = TorchCausalLM.load(tiny_model_dir("llama"))
    rows.use_row_graphs(2, capture=False, compiled=True)
    history = _prompt(40)
    strategy = KVStrategy("sink_window", 4, 12)
    want, _ = _run(Engine(plain, strategy, prefill_chunk=16), history, n=12)
    got, _ = _run(Engine(rows, strategy, prefill_chunk=16), history, n=12)
    assert got == want and rows.row_graphs.fns.compiled and rows.row_graphs.steps >= 11


def test_attend_rows_is_sdpa_with_gqa_over_each_rows_slot():
    """--compile on's attention in plain ops (attention.attend_rows) computes what the eager step's
    scaled_dot_product_attention(enable_gqa=True) does: each row over its own slot, its masked columns unseen."""
    import torch.nn.functional as F

    from inference_engine.backends.torch.attention import attend_rows

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, slots, cols, keys, rows = 6, 2, 8, 4, 40, 32, 3
    ak, av = torch.randn(slots, kv_heads, cols, d, generator=g), torch.randn(slots, kv_heads, cols, d, generator=g)
    q = torch.randn(heads, rows, d, generator=g)
    slot = torch.tensor([2, 0, 2])
    bias = torch.zeros(rows, 1, 1, keys)
    bias[0, ..., 20:] = float("-inf")  # row 0 sees its slot's first 20 columns
    bias[2, ..., :5] = float("-inf")  # row 2 (same slot) not the first 5
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[:, :, None], ak[slot, :, :keys], av[slot, :, :keys],
                                          attn_mask=bias, scale=0.3, enable_gqa=True)[:, :, 0].transpose(0, 1)
    got = attend_rows(q, ak, av, slot, bias, keys, 0.3)
    assert got.shape == (heads, rows, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # columns a row cannot see do not reach it
    ak2 = ak.clone()
    ak2[2, :, 25:keys] = 1e3
    torch.testing.assert_close(attend_rows(q, ak2, av, slot, bias, keys, 0.3)[:, 0], got[:, 0])


def test_auto_falls_back_to_eager_pieces_when_inductor_fails(monkeypatch):
    """--compile auto on CUDA compiles the row step through inductor; a compile that fails there leaves the
    row graphs on with eager pieces (the same tokens), where --compile on turns them off."""
    from inference_engine.backends.torch import row_graphs

    made = row_graphs._RowGraph.__init__

    def fails_if_compiled(self, model, arena, rows, keys, pool, fns):
        if fns.compiled:
            raise RuntimeError("inductor: no triton")
        made(self, model, arena, rows, keys, pool, fns)

    monkeypatch.setattr(row_graphs._RowGraph, "__init__", fails_if_compiled)
    plain = _model()
    history = _prompt(40)
    want, _ = _run(Engine(plain, KVStrategy("full"), prefill_chunk=16), history, n=12)
    for fallback in (True, False):
        rows = TorchCausalLM.load(tiny_model_dir("llama"))
        rows.use_row_graphs(2, capture=False, compiled=True, fallback=fallback)
        got, _ = _run(Engine(rows, KVStrategy("full"), prefill_chunk=16), history, n=12)
        g = rows.row_graphs
        assert got == want
        if fallback:
            assert g.failed is None and not g.fns.compiled and g.steps >= 11 and (1, 128) in g._graphs
        else:
            assert g.failed and "no triton" in g.failed and not g._graphs
