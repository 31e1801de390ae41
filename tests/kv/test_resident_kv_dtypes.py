"""The resident K/V dtypes besides fp32 (--kv-dtype): int8 (kv/stores.py::Int8SlabStore: rows quantized per position
and head, attention over the codes without decoding) and fp16 (HalfSlabStore: rows rounded to fp16, attention in the
model's dtype on the stored values). Each is close to fp32 K/V, row-exact (speculation stays exact on it), saved and
restored bit for bit, and refused where it does not apply. `paged` takes fp16: its page store then holds the fp16
rows exactly."""
import dataclasses

import pytest
import torch

from drafters import HashDrafter
from factories import load_model, tiny_model_dir
from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.generate import Engine
from inference_engine.engine.requests import GenerateParams
from inference_engine.engine.session_kv import SessionKV
from inference_engine.engine.steps import forward
from inference_engine.kv.registry import make_strategy
from inference_engine.kv.stores import HalfSlabStore, Int8Rows, Int8SlabStore
from inference_engine.kv.strategy import KVStrategy

STRATEGIES = [KVStrategy(name, 4, 24, kv_dtype=dt) for dt in ("int8", "fp16") for name in ("full", "sink_window")]
# paged with fp16 K/V: the resident slab and the page store hold fp16 rows (pages of 8, 2 recalled: the histories
# below archive and recall pages)
STRATEGIES.append(KVStrategy("paged", 4, 24, kv_dtype="fp16", page_size=8, recall_pages=2))


def sid(s):
    return f"{s.name}-{s.kv_dtype}"


def ids(n, seed, vocab=200):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tokens(engine, history, n=24):
    return [e.token_id for e in engine.generate(engine.new_session_kv(), history, GenerateParams(max_tokens=n))
            if isinstance(e, TokenGenerated)]


def test_quantization_is_per_position_and_bounded():
    x = torch.randn(3, 10, 64) * torch.logspace(-3, 2, 10)[None, :, None]  # rows of very different sizes
    codes, scale = Int8SlabStore.quantize(x)
    assert codes.dtype == torch.int8 and scale.shape == (3, 10)
    back = Int8Rows(codes, scale, False).dequantize()
    err = (back - x).abs().amax(-1) / x.abs().amax(-1)
    assert float(err.max()) < 1 / 127  # half a step of the row's own scale, plus bf16 scale rounding


@pytest.mark.parametrize("strategy", STRATEGIES, ids=sid)
def test_attention_over_the_rows_is_close_to_fp32(strategy):
    model = load_model(str(tiny_model_dir("llama")))
    fp32 = dataclasses.replace(strategy, kv_dtype="fp32")
    history = ids(60, 1)
    got, want = [], []
    for strat, out in ((strategy, got), (fp32, want)):
        kv = Engine(model, strat, prefill_chunk=16).new_session_kv()
        for i in range(0, len(history), 16):
            chunk = history[i:i + 16]
            logits, _ = forward(model, model.tensor(chunk), range(i, i + len(chunk)), kv.cache)
            kv.cache.commit()
            out.append(logits)
    got, want = torch.cat(got), torch.cat(want)
    assert not torch.equal(got, want)  # the int8 / fp16 path ran
    rel = float((got - want).norm() / want.norm())
    assert rel < (0.03 if strategy.kv_dtype == "int8" else 2e-3), rel
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) > (0.9 if strategy.kv_dtype == "int8" else 0.98)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=sid)
def test_the_store_holds_a_quarter_or_half_of_fp32(strategy):
    model = load_model(str(tiny_model_dir("llama")))
    caches = [Engine(model, s, prefill_chunk=32).new_session_kv().cache
              for s in (strategy, dataclasses.replace(strategy, kv_dtype="fp32"))]
    small, fp32 = caches
    if strategy.kv_dtype == "int8":
        assert small.nbytes < fp32.nbytes * 0.32  # codes + bf16 scales (head_dim 16 here: scales weigh 1/8 of codes)
    elif strategy.name != "paged":
        assert isinstance(small.store, HalfSlabStore) and small.nbytes * 2 == fp32.nbytes
    else:  # the resident slab and the page store (after 60 tokens: pages archived) in half the bytes
        history = ids(60, 1)
        for cache in caches:
            for i in range(0, len(history), 30):
                forward(model, model.tensor(history[i:i + 30]), range(i, i + 30), cache)
                cache.commit()
        assert isinstance(small.store, HalfSlabStore) and small.pages.rows == fp32.pages.rows > 0
        assert small.resident_nbytes * 2 == fp32.resident_nbytes and small.pages.nbytes * 2 == fp32.pages.nbytes
        assert small.pages.data["rows"].dtype == torch.float16  # the compact keys (selection) are as they were
        assert small.keys.nbytes == fp32.keys.nbytes and small.selection_nbytes == fp32.selection_nbytes


def test_fp16_rows_are_the_written_rows_rounded_and_read_back_in_the_models_dtype():
    store = HalfSlabStore(2, 3, 16, 8, torch.float32, "cpu")
    k, v = torch.randn(3, 4, 16) * 10, torch.randn(3, 4, 16)
    slots = torch.tensor([5, 0, 2, 7])
    store.write(1, slots, k, v)
    assert store.k[1].dtype == torch.float16 and torch.equal(store.k[1][:, slots], k.half())
    rk, rv = store.read(1, slots)
    assert rk.dtype == torch.float32 and torch.equal(rk, k.half().float()) and torch.equal(rv, v.half().float())
    fk, _ = store.fetch(1, 8, None)
    assert fk.dtype == torch.float32 and fk.shape == (3, 8, 16)
    with pytest.raises(ValueError, match="for the CPU"):
        HalfSlabStore(2, 3, 16, 8, torch.float32, "meta")


@pytest.mark.parametrize("strategy", STRATEGIES, ids=sid)
def test_speculation_over_the_rows_equals_autoregressive(strategy):
    """Row-exact steps on an int8 / fp16 store, including a full cache growing past its capacity
    mid-generation (the engine keeps verify blocks inside the capacity: exact_step_room)."""
    model = load_model(str(tiny_model_dir("llama")))
    history = ids(250, 2)  # the full cache grows from 256 slots during generation
    want = tokens(Engine(model, strategy, prefill_chunk=32), history, 40)
    for k in (2, 5):
        assert tokens(Engine(model, strategy, prefill_chunk=32, drafter=HashDrafter(256), spec_k=k), history, 40) == want


@pytest.mark.parametrize("strategy", STRATEGIES, ids=sid)
def test_the_state_round_trip_continues_identically(strategy):
    model = load_model(str(tiny_model_dir("llama")))
    engine = Engine(model, strategy, prefill_chunk=16)
    history = ids(50, 3)
    kv = engine.new_session_kv()
    list(engine.generate(kv, history, GenerateParams(max_tokens=1)))
    state = kv.state()
    restored = SessionKV.from_state(state, model.geometry(), max_step=16, max_context=model.spec.max_context)
    more = history + [7, 8, 9]
    a = [e.token_id for e in engine.generate(kv, more, GenerateParams(max_tokens=12)) if isinstance(e, TokenGenerated)]
    b = [e.token_id for e in engine.generate(restored, more, GenerateParams(max_tokens=12)) if isinstance(e, TokenGenerated)]
    assert a == b


@pytest.mark.parametrize("kv_dtype", ["int8", "fp16"])
@pytest.mark.parametrize("kwargs", [dict(name="dlm_restore"), dict(name="full", compressor="kakeya_d4"),
                                    dict(name="paged", page_compressor="int8")])
def test_it_is_refused_where_it_does_not_apply(kwargs, kv_dtype):
    with pytest.raises(ValueError, match=f"kv dtype {kv_dtype}"):
        make_strategy(kv_dtype=kv_dtype, **kwargs)
    if kwargs["name"] == "paged":  # paged takes fp16 (its pages exact fp16 rows), not int8
        with pytest.raises(ValueError, match="kv dtype int8 on paged"):
            make_strategy(name="paged", kv_dtype="int8")
        assert make_strategy(name="paged", kv_dtype="fp16").kv_dtype == "fp16"
    with pytest.raises(ValueError, match="unknown kv dtype"):
        KVStrategy(kv_dtype="int4")
