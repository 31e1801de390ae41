"""SinkWindowCache's ring placement (kv/sink_window.py): a position's slot depends only on the
position, whatever steps wrote it, and a state whose rows are off the ring is put back on load."""
import numpy as np
import torch

from factories import load_model, tiny_model_dir
from inference_engine.engine.generate import Engine
from inference_engine.engine.steps import forward
from inference_engine.kv.factory import cache_from_state
from inference_engine.kv.strategy import KVStrategy

STRATEGY = KVStrategy("sink_window", 4, 24)


def feed(model, cache, chunks, row_exact=False):
    out = []
    for c in chunks:
        start = cache.next_position
        logits, _ = forward(model, model.tensor(c), range(start, start + len(c)), cache, row_exact=row_exact)
        cache.commit()
        out.append(logits)
    return torch.cat(out)


def on_ring(cache):
    live = cache.store.occupied()
    return np.array_equal(live, np.sort(cache._ring_slots(cache.store.pos[live])))


def test_slots_follow_positions_whatever_the_step_sizes():
    model = load_model(str(tiny_model_dir("llama")))
    ids = torch.randint(3, 200, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    a = Engine(model, STRATEGY, prefill_chunk=64).new_session_kv().cache
    b = Engine(model, STRATEGY, prefill_chunk=64).new_session_kv().cache
    feed(model, a, [ids[:64], ids[64:]])  # a grown slab, settled back onto the ring
    feed(model, b, [ids[i:i + 5] for i in range(0, 90, 5)])
    assert on_ring(a) and on_ring(b)
    assert np.array_equal(a.store.pos, b.store.pos)


def test_a_state_off_the_ring_is_relocated_on_load_and_continues_identically():
    model = load_model(str(tiny_model_dir("llama")))
    ids = torch.randint(3, 200, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    cache, never_left = (Engine(model, STRATEGY, prefill_chunk=64).new_session_kv().cache for _ in range(2))
    for c in (cache, never_left):
        feed(model, c, [ids[:40], ids[40:]])
    cache.store.relocate(cache.capacity, np.arange(cache.store.resident))  # rows compacted in slot order: off the ring
    assert not on_ring(cache)
    loaded = cache_from_state(cache.state(), model.geometry(), max_step=64, max_context=model.spec.max_context)
    assert on_ring(loaded)
    more = [[7], [8], [9, 10, 11], [12]]  # key columns in ring order again: bit-equal to the cache that stayed on it
    assert torch.equal(feed(model, loaded, more, row_exact=True), feed(model, never_left, more, row_exact=True))
