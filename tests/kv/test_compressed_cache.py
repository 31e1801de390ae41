"""Resident caches whose store is a KakeyaLattice compressor (kv/stores.py CompressedStore).

The store holds packed codes (nbytes = the packed bytes); a step's own K/V are read back as
stored, so what a token attends to does not depend on how its history was chunked; rollback
leaves the kept codes untouched; greedy output stays close to the uncompressed cache.
"""
import pytest
import torch

from factories import load_model, require_smollm2, tiny_model_dir
from inference_engine.kv.compressors import KakeyaLatticeUnavailable, bf16_reference_bytes, make_codec
from inference_engine.kv.factory import make_cache
from inference_engine.kv.layout import CacheGeometry
from inference_engine.kv.registry import make_strategy
from inference_engine.kv.strategy import KVStrategy
from inference_engine.kv.stores import CompressedStore, SlabStore
from inference_engine.engine.steps import forward

pytest.importorskip("kakeyalattice")

LATTICES = ["kakeya_d4", "kakeya_e8"]
BOUNDED = [("full", {}), ("sink_window", dict(sink=4, window=24)), ("dlm_restore", dict(sink=4, window=24))]
GEOM = CacheGeometry(num_layers=2, num_kv_heads=3, head_dim=64, layer_windows=(None, None))


def strategy(name, compressor, q_range=38, **kw):
    return make_strategy(name, compressor=compressor, q_range=q_range, **kw)


def rows(t, seed, geom=GEOM):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(geom.num_kv_heads, t, geom.head_dim, generator=g) * 2,
             torch.randn(geom.num_kv_heads, t, geom.head_dim, generator=g)) for _ in range(geom.num_layers)]


def step(cache, kv_per_layer, n_keep=None):
    """One cache step without a model; returns {position: (k rows, v rows)} of what layer 0 read."""
    t = kv_per_layer[0][0].shape[1]
    pos = torch.arange(cache.next_position, cache.next_position + t)
    layout = cache.prepare(pos, torch.zeros(t, dtype=torch.long))
    read = None
    for layer, (k, v) in enumerate(kv_per_layer):
        k_all, v_all = cache.update_and_fetch(layer, k, v)
        if layer == 0:
            read = {int(p): (k_all[:, i], v_all[:, i]) for i, p in enumerate(layout.key_positions.tolist()) if p >= 0}
    cache.commit(n_keep)
    return read


def cut(kv_per_layer, a, b):
    return [(k[:, a:b], v[:, a:b]) for k, v in kv_per_layer]


def new_cache(name, compressor, max_step=48, geom=GEOM, **kw):
    return make_cache(strategy(name, compressor, **kw), geom, max_step=max_step, max_context=4096)


@pytest.mark.parametrize("compressor", LATTICES)
@pytest.mark.parametrize("name,kw", BOUNDED)
def test_nbytes_is_the_packed_store(compressor, name, kw):
    cache = new_cache(name, compressor, **kw)
    for i in range(5):
        step(cache, rows(20, seed=i))
    assert isinstance(cache.store, CompressedStore)
    per_vector = cache.store.codec.packer.code_bytes + 4  # packed point + fp16 norm and qmax
    assert cache.store.codec.bytes_per_row == per_vector
    assert cache.nbytes == GEOM.num_layers * 2 * GEOM.num_kv_heads * cache.capacity * per_vector
    assert cache.nbytes == sum(t.numel() * t.element_size() for slabs in cache.store.slabs for t in slabs.values())
    bf16 = GEOM.num_layers * bf16_reference_bytes(cache.capacity, GEOM.num_kv_heads, GEOM.head_dim)
    if compressor == "kakeya_d4":  # q 38, head_dim 64: 54 bytes a vector vs 128
        assert cache.nbytes * 2.3 <= bf16


def test_bounded_compressed_bytes_do_not_grow():
    cache = new_cache("sink_window", "kakeya_e8", sink=4, window=24)
    step(cache, rows(30, seed=0))
    early = cache.nbytes
    for i in range(12):
        step(cache, rows(25, seed=i + 1))
    assert cache.nbytes == early and cache.resident_positions == 4 + 24 - 1


@pytest.mark.parametrize("compressor", LATTICES)
@pytest.mark.parametrize("name,kw", BOUNDED[:2])
def test_reads_do_not_depend_on_chunking(compressor, name, kw):
    """INV-3 at the cache: the same K/V rows, fed in one step or one by one, read back bit for bit."""
    data = rows(60, seed=3)
    whole = new_cache(name, compressor, max_step=64, **kw)
    a = step(whole, data)  # the last position's view of everything the strategy keeps
    single = new_cache(name, compressor, max_step=64, **kw)
    for i in range(60):
        b = step(single, cut(data, i, i + 1))
    for p, (k, v) in b.items():
        assert torch.equal(k, a[p][0]) and torch.equal(v, a[p][1])


@pytest.mark.parametrize("compressor", LATTICES)
def test_a_step_reads_its_own_rows_as_stored(compressor):
    cache = new_cache("full", compressor)
    data = rows(10, seed=1)
    read = step(cache, data)
    codec = make_codec(compressor, head_dim=64)
    k, v = data[0]
    k_ref, v_ref = (codec.decode(codec.encode(x.reshape(-1, 64))).reshape(x.shape) for x in (k, v))
    for p in range(10):
        assert torch.equal(read[p][0], k_ref[:, p]) and torch.equal(read[p][1], v_ref[:, p])
    assert not torch.equal(k_ref, data[0][0])  # compression is real


@pytest.mark.parametrize("compressor", LATTICES)
@pytest.mark.parametrize("name,kw", BOUNDED)
def test_rollback_is_exact(compressor, name, kw):
    history, extra, tail = rows(40, seed=0), rows(6, seed=1), rows(5, seed=2)
    a = new_cache(name, compressor, **kw)
    step(a, history)
    step(a, extra, n_keep=2)  # a verify step that keeps 2 of 6
    b = new_cache(name, compressor, **kw)
    step(b, history)
    step(b, cut(extra, 0, 2))
    ra, rb = step(a, tail), step(b, tail)
    assert ra.keys() == rb.keys()
    for p in ra:
        assert torch.equal(ra[p][0], rb[p][0]) and torch.equal(ra[p][1], rb[p][1])
    assert (a.resident_positions, a.next_position, a.nbytes) == (b.resident_positions, b.next_position, b.nbytes)


def test_identity_keeps_the_uncompressed_slabs():
    cache = new_cache("sink_window", "identity", sink=4, window=24)
    assert isinstance(cache.store, SlabStore) and cache.compressor == "identity"
    assert cache.nbytes == 2 * 2 * 3 * cache.capacity * 64 * 4  # fp32 slabs, as before


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("compressor", LATTICES)
def test_model_logits_close_to_uncompressed(arch, compressor):
    m = load_model(str(tiny_model_dir(arch)))
    history = torch.randint(3, 256, (80,), generator=torch.Generator().manual_seed(0))
    out = {}
    for c in ("identity", compressor):
        cache = make_cache(strategy("full", c), m.geometry(), max_step=32, max_context=m.spec.max_context)
        logits, _ = forward(m, history, torch.arange(80), cache)
        cache.commit()
        out[c] = logits
    agree = (out["identity"].argmax(-1) == out[compressor].argmax(-1)).float().mean().item()
    rel = ((out["identity"] - out[compressor]).norm() / out["identity"].norm()).item()
    assert agree >= 0.8 and rel < 0.15, f"{arch} {compressor}: top-1 agreement {agree:.3f}, logits rel err {rel:.4f}"


def test_dlm_restore_with_a_compressed_resident_cache_runs_close_to_full():
    m = load_model(str(tiny_model_dir("qwen3")))
    history = torch.randint(3, 256, (90,), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, st in (("full", KVStrategy("full")), ("dlm", strategy("dlm_restore", "kakeya_e8", sink=4, window=12))):
        cache = make_cache(st, m.geometry(), max_step=32, max_context=m.spec.max_context)
        logits = []
        for i in range(0, 90, 30):
            lg, _ = forward(m, history[i : i + 30], torch.arange(i, i + 30), cache)
            cache.commit()
            logits.append(lg)
        out[name] = torch.cat(logits)
    agree = (out["full"].argmax(-1) == out["dlm"].argmax(-1)).float().mean().item()
    assert agree >= 0.9


def test_unusable_compressor_fails_with_a_clear_message(monkeypatch):
    with pytest.raises(ValueError, match="unknown kv compressor 'zstd'"):
        KVStrategy("full", compressor="zstd")
    with pytest.raises(ValueError, match="q_range"):
        KVStrategy("full", compressor="kakeya_d4", q_range=0)
    odd = CacheGeometry(num_layers=1, num_kv_heads=1, head_dim=48, layer_windows=(None,))
    with pytest.raises(ValueError, match="power of two"):
        make_cache(strategy("full", "kakeya_d4"), odd, max_step=8, max_context=64)
    import sys

    monkeypatch.setitem(sys.modules, "kakeyalattice", None)
    with pytest.raises(KakeyaLatticeUnavailable, match="pip install kakeyalattice"):
        make_cache(strategy("sink_window", "kakeya_e8", sink=4, window=8), GEOM, max_step=8, max_context=64)


@pytest.mark.model
@pytest.mark.parametrize("compressor", LATTICES)
def test_smollm2_greedy_close_to_uncompressed(compressor):
    """Teacher-forced: the uncompressed cache's greedy continuation, re-scored through the
    compressed cache; the compressed cache's argmax must agree at nearly every position."""
    path = require_smollm2()
    from transformers import AutoTokenizer

    from inference_engine.engine.events import TokenGenerated
    from inference_engine.engine.generate import Engine, GenerateParams

    m = load_model(str(path))
    tok = AutoTokenizer.from_pretrained(path)
    text = ("<|im_start|>user\nWrite a short story about a lighthouse keeper who finds a message in a bottle. "
            "Describe the weather, the keeper's daily routine, and what the message says.<|im_end|>\n<|im_start|>assistant\n")
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    n = 32
    engine = Engine(m, KVStrategy("full"), prefill_chunk=128)
    ref = [e.token_id for e in engine.generate(engine.new_session_kv(), prompt, GenerateParams(max_tokens=n))
           if isinstance(e, TokenGenerated)]
    ids = torch.tensor(prompt + ref)
    cache = make_cache(strategy("full", compressor), m.geometry(), max_step=256, max_context=m.spec.max_context)
    logits, _ = forward(m, ids, torch.arange(len(ids)), cache)
    cache.commit()
    pred = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    agree = sum(a == b for a, b in zip(pred, ref))
    first_miss = next((i for i, (a, b) in enumerate(zip(pred, ref)) if a != b), n)
    assert agree >= n - 3, f"{agree}/{n} teacher-forced greedy tokens match, first mismatch at {first_miss}"


@pytest.mark.parametrize("compressor", ["identity"] + LATTICES)
def test_a_long_step_borrows_room_and_gives_it_back_bit_for_bit(compressor):
    """A prefill chunk longer than the spare slots grows the store for that step only; the
    commit moves the resident rows to the front (packed bytes moved, not re-encoded)."""
    cache = new_cache("sink_window", compressor, max_step=48, sink=4, window=24)
    base = cache.nbytes
    assert cache.capacity == 4 + 24 + 16
    step(cache, rows(20, seed=0))
    before = step(cache, rows(1, seed=1))
    assert cache.nbytes == base
    grown = step(cache, rows(40, seed=2))  # 40 > 16 spare slots
    assert cache.nbytes == base and cache.capacity == 4 + 24 + 16 and cache.peak_nbytes > base
    for p, (k, v) in before.items():  # rows that stayed resident read back unchanged after the move
        if p in grown:
            assert torch.equal(k, grown[p][0]) and torch.equal(v, grown[p][1])
    assert cache.resident_positions == 4 + 24 - 1


def test_full_cache_grows_inside_a_forward_and_rolls_back_outside_it():
    m = load_model(str(tiny_model_dir("llama")))
    cache = make_cache(KVStrategy("full"), m.geometry(), max_step=64, max_context=m.spec.max_context)
    ids = torch.randint(3, 256, (262,), generator=torch.Generator().manual_seed(0))
    forward(m, ids[:250], torch.arange(250), cache)
    cache.commit()
    forward(m, ids[250:], torch.arange(250, 262), cache)  # grows past the initial 256 slots
    cache.commit(3)  # rollback writes cache tensors outside the model's inference mode
    assert cache.next_position == 253 and cache.resident_positions == 253
