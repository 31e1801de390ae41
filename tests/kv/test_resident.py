"""Resident caches: attention sets, chunking independence, rollback, bounded bytes, positions."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from factories import feed, load_model, tiny_model_dir
from inference_engine.errors import CacheInvariantError
from inference_engine.kv.factory import make_cache
from inference_engine.kv.strategy import KVStrategy
from inference_engine.engine.steps import forward


def model(arch="llama", **kw):
    return load_model(str(tiny_model_dir(arch, **kw)))


def new_cache(m, strategy, max_step=64):
    return make_cache(strategy, m.geometry(), max_step=max_step, max_context=m.spec.max_context)


def ids(n, seed=0):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_mask_is_sink_union_window():
    m = model()
    cache = new_cache(m, KVStrategy("sink_window", 2, 4), max_step=8)
    feed(m, cache, ids(10), 5)
    layout = cache.prepare(torch.tensor([10]))
    allowed = sorted(int(p) for p in layout.key_positions[layout.masks[None][0]])
    cache.abort()
    assert allowed == [0, 1, 7, 8, 9, 10]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_sink_window_result_does_not_depend_on_chunking(arch):
    m = model(arch)
    strategy = KVStrategy("sink_window", 4, 12)
    history = ids(90)
    ref = feed(m, new_cache(m, strategy), history, 64)
    for chunk in (1, 7, 30):
        got = feed(m, new_cache(m, strategy), history, chunk)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_wide_window_equals_full():
    m = model("qwen3")
    history = ids(60)
    full = feed(m, new_cache(m, KVStrategy("full")), history, 16)
    sw = feed(m, new_cache(m, KVStrategy("sink_window", 4, 1000)), history, 16)
    torch.testing.assert_close(sw, full, rtol=1e-5, atol=1e-5)


def test_narrow_window_differs_from_full_after_eviction():
    m = model()
    history = ids(60)
    full = feed(m, new_cache(m, KVStrategy("full")), history, 16)
    sw = feed(m, new_cache(m, KVStrategy("sink_window", 2, 8)), history, 16)
    torch.testing.assert_close(sw[:10], full[:10], rtol=1e-5, atol=1e-5)  # nothing evicted yet
    assert not torch.allclose(sw[-1], full[-1], atol=1e-3)


@pytest.mark.parametrize("strategy", [KVStrategy("full"), KVStrategy("sink_window", 4, 12)])
def test_rollback_is_exact(strategy):
    m = model()
    history, extra = ids(40), ids(6, seed=1)
    a = new_cache(m, strategy)
    feed(m, a, history, 16)
    # a speculative-style step of 6 tokens of which only 2 are kept
    pos = torch.arange(a.next_position, a.next_position + 6)
    forward(m, torch.tensor(extra), pos, a)
    a.commit(2)
    b = new_cache(m, strategy)
    feed(m, b, history + extra[:2], 16)
    tail = ids(5, seed=2)
    torch.testing.assert_close(feed(m, a, tail, 5), feed(m, b, tail, 5), rtol=1e-5, atol=1e-5)
    assert a.resident_positions == b.resident_positions and a.next_position == b.next_position


def test_sink_window_bytes_do_not_grow():
    m = model()
    cache = new_cache(m, KVStrategy("sink_window", 4, 16))
    feed(m, cache, ids(30), 16)
    early = cache.nbytes
    feed(m, cache, ids(300, seed=3), 16)
    assert cache.nbytes == early and cache.resident_positions == 4 + 16 - 1


def test_full_cache_grows_with_history():
    m = model()
    cache = new_cache(m, KVStrategy("full"))
    feed(m, cache, ids(300), 64)
    assert cache.resident_positions == 300


def test_inv2_non_contiguous_positions_raise():
    m = model()
    cache = new_cache(m, KVStrategy("full"))
    feed(m, cache, ids(5), 5)
    with pytest.raises(CacheInvariantError) as e:
        cache.prepare(torch.tensor([7, 8]))
    assert e.value.kind == "inv2"


def test_inv1_layer_skipped_is_detected():
    m = model()
    cache = new_cache(m, KVStrategy("full"))
    cache.prepare(torch.tensor([0]))
    g = m.geometry()
    kv = torch.zeros(g.num_kv_heads, 1, g.head_dim)
    cache.update_and_fetch(0, kv, kv)  # layer 1 never written
    with pytest.raises(CacheInvariantError) as e:
        cache.commit()
    assert e.value.kind == "inv1"


def test_past_trained_context_sink_is_seen_right_before_the_window():
    """Documented position rule: a query at p >= max_context sees the sink as if it sat
    immediately before its window (StreamingLLM layout). With one layer, K/V depend only on
    the token, so the last logits must equal a plain forward over [sink tokens] + [window
    tokens] at positions 0 .. sink + window - 1."""
    sink, window, max_ctx = 4, 16, 64
    path = str(tiny_model_dir("llama", num_hidden_layers=1, max_position_embeddings=max_ctx))
    m = load_model(path)
    history = ids(150, seed=5)
    got = feed(m, new_cache(m, KVStrategy("sink_window", sink, window)), history, 32)[-1]
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    compact = history[:sink] + history[-window:]
    with torch.no_grad():
        ref = hf(torch.tensor([compact])).logits[0, -1]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # Inside the trained context the sink keeps its true distance (plain masked attention).
    inside = history[:60]
    got_in = feed(m, new_cache(m, KVStrategy("sink_window", sink, window)), inside, 32)[-1]
    compact_in = inside[:sink] + inside[-window:]
    with torch.no_grad():
        shifted = hf(torch.tensor([compact_in])).logits[0, -1]
    assert not torch.allclose(got_in, shifted, atol=1e-4)
