"""The int8 resident K/V store (kv/stores.py::Int8SlabStore, --kv-dtype int8): rows quantized per
position and head, attention over the codes without decoding, close to fp32 K/V, row-exact
(speculation stays exact on it), saved and restored bit for bit, refused where it does not apply."""
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
from inference_engine.kv.stores import Int8Rows, Int8SlabStore
from inference_engine.kv.strategy import KVStrategy

STRATEGIES = [KVStrategy("full", kv_dtype="int8"), KVStrategy("sink_window", 4, 24, kv_dtype="int8")]


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


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_attention_over_int8_rows_is_close_to_fp32(strategy):
    model = load_model(str(tiny_model_dir("llama")))
    fp32 = KVStrategy(strategy.name, strategy.sink, strategy.window)
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
    assert not torch.equal(got, want)  # the int8 path ran
    rel = float((got - want).norm() / want.norm())
    assert rel < 0.03, rel
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) > 0.9


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_int8_store_holds_a_quarter_of_fp32(strategy):
    model = load_model(str(tiny_model_dir("llama")))
    caches = [Engine(model, s, prefill_chunk=32).new_session_kv().cache for s in (strategy, KVStrategy(strategy.name, 4, 24))]
    int8, fp32 = caches
    assert int8.nbytes < fp32.nbytes * 0.32  # codes + bf16 scales (head_dim 16 here: scales weigh 1/8 of codes)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_speculation_over_int8_rows_equals_autoregressive(strategy):
    """Row-exact steps on an int8 store, including a full cache growing past its capacity
    mid-generation (the engine keeps verify blocks inside the capacity: exact_step_room)."""
    model = load_model(str(tiny_model_dir("llama")))
    history = ids(250, 2)  # the full cache grows from 256 slots during generation
    want = tokens(Engine(model, strategy, prefill_chunk=32), history, 40)
    for k in (2, 5):
        assert tokens(Engine(model, strategy, prefill_chunk=32, drafter=HashDrafter(256), spec_k=k), history, 40) == want


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_int8_state_round_trip_continues_identically(strategy):
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


@pytest.mark.parametrize("kwargs", [dict(name="dlm_restore"), dict(name="paged"), dict(name="full", compressor="kakeya_d4")])
def test_int8_is_refused_where_it_does_not_apply(kwargs):
    with pytest.raises(ValueError, match="kv dtype int8"):
        make_strategy(kv_dtype="int8", **kwargs)
    with pytest.raises(ValueError, match="unknown kv dtype"):
        KVStrategy(kv_dtype="int4")
