"""state() -> from_state(): a session restored from its saved state continues token for token
like one that never left memory, for every strategy and compressor (through safetensors + JSON,
the files persistence writes)."""
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafters import HashDrafter
from factories import load_model, tiny_model_dir
from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.generate import Engine
from inference_engine.engine.requests import GenerateParams, SamplingParams
from inference_engine.engine.session_kv import SessionKV
from inference_engine.kv.registry import make_strategy
from inference_engine.kv.slot_cache import CacheState
from inference_engine.kv.strategy import KVStrategy
from kv_cache_proposer.same_model import VerifierRestoreSource

SINK, WINDOW = 4, 24


def ids(n, seed=0):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def through_files(state: CacheState, tmp_path) -> CacheState:
    save_file({k: v.contiguous() for k, v in state.tensors.items()}, str(tmp_path / "kv.safetensors"))
    (tmp_path / "kv.json").write_text(json.dumps(state.meta))
    return CacheState(load_file(str(tmp_path / "kv.safetensors")), json.loads((tmp_path / "kv.json").read_text()))


def turn(engine, kv, history, n, sampling=SamplingParams()):
    out = [e.token_id for e in engine.generate(kv, history, GenerateParams(max_tokens=n, sampling=sampling))
           if isinstance(e, TokenGenerated)]
    history.extend(out)
    return out


STRATEGIES = {
    "full": KVStrategy("full"),
    "sink_window": KVStrategy("sink_window", SINK, WINDOW),
    "dlm_restore": make_strategy("dlm_restore", SINK, WINDOW),  # a research strategy, found through the registry
    "dlm_restore_refresh3": make_strategy("dlm_restore", SINK, WINDOW, restore_refresh=3),
    "dlm_restore_pin4": make_strategy("dlm_restore", SINK, WINDOW, restore_from="drafter", restore_pin=4),
    "paged": KVStrategy("paged", SINK, WINDOW, page_size=8, recall_pages=2),
    "paged_int8_pages": KVStrategy("paged", SINK, WINDOW, page_size=8, recall_pages=2, page_compressor="int8"),
}


def engine_for(name, compressor, drafter=None):
    m = load_model(str(tiny_model_dir("llama")))
    st = STRATEGIES[name]
    st = dataclasses.replace(st, compressor=compressor)
    source = VerifierRestoreSource(m) if getattr(st, "restore_from", None) == "drafter" else None
    return Engine(m, st, prefill_chunk=16, strategy_resources=source, drafter=drafter, spec_k=3 if drafter else 0)


@pytest.mark.parametrize("compressor", ["identity", "kakeya_d4"])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_restored_session_continues_token_identical(name, compressor, tmp_path):
    if compressor != "identity":
        pytest.importorskip("kakeyalattice")
    engine = engine_for(name, compressor)
    history = ids(60)
    kept_kv, kept_hist = engine.new_session_kv(), list(history)
    turn(engine, kept_kv, kept_hist, 6)
    saved = through_files(kept_kv.state(), tmp_path)
    g = engine.model.geometry()
    restored_kv = SessionKV.from_state(saved, g, max_step=engine.prefill_chunk, max_context=engine.max_context,
                                       resources=engine.strategy_resources)
    restored_hist = list(kept_hist)
    assert restored_kv.nbytes == kept_kv.nbytes and restored_kv.next_position == kept_kv.next_position
    assert restored_kv.resident_positions == kept_kv.resident_positions
    torch.testing.assert_close(restored_kv.last_logits, kept_kv.last_logits, rtol=0, atol=0)
    for more in (ids(9, seed=1), ids(20, seed=2)):  # two more turns, greedy then sampled
        kept_hist += more
        restored_hist += more
        assert turn(engine, restored_kv, restored_hist, 7) == turn(engine, kept_kv, kept_hist, 7)
        s = SamplingParams(temperature=0.8, seed=11)
        assert turn(engine, restored_kv, restored_hist, 5, s) == turn(engine, kept_kv, kept_hist, 5, s)
    assert restored_kv.dropped_total == kept_kv.dropped_total


def test_restored_session_keeps_drafter_features():
    """Speculative sessions restore the verifier hidden states the drafter conditions on."""
    m = load_model(str(tiny_model_dir("llama")))
    class HiddenHashDrafter(HashDrafter):
        uses_verifier_hidden = True

    engine = Engine(m, KVStrategy("full"), prefill_chunk=16, drafter=HiddenHashDrafter(m.spec.vocab_size), spec_k=3)
    kv, hist = engine.new_session_kv(), ids(40)
    turn(engine, kv, hist, 5)
    back = SessionKV.from_state(kv.state(), m.geometry(), max_step=16, max_context=engine.max_context)
    assert kv.recent_hidden is not None and kv.recent_hidden.shape[0] == HashDrafter.context_window
    torch.testing.assert_close(back.recent_hidden, kv.recent_hidden, rtol=0, atol=0)
    assert turn(engine, back, list(hist), 8) == turn(engine, kv, list(hist), 8)


def test_state_refuses_another_model_and_an_open_step():
    engine = engine_for("sink_window", "identity")
    kv = engine.new_session_kv()
    turn(engine, kv, ids(30), 2)
    st = kv.state()
    other = load_model(str(tiny_model_dir("llama", num_hidden_layers=3))).geometry()
    with pytest.raises(ValueError, match="cache state is for a model"):
        SessionKV.from_state(st, other, max_step=16, max_context=engine.max_context)
    bad = CacheState(st.tensors, st.meta | {"format": 99})
    with pytest.raises(ValueError, match="format"):
        SessionKV.from_state(bad, engine.model.geometry(), max_step=16, max_context=engine.max_context)
    kv.cache.prepare(range(kv.next_position, kv.next_position + 1))
    with pytest.raises(Exception, match="uncommitted"):
        kv.state()
    kv.cache.abort()


@pytest.mark.parametrize("kv_dtype,compressor", [("fp32", "identity"), ("fp32", "kakeya_d4"), ("int8", "identity")])
def test_from_state_allocates_the_store_once(kv_dtype, compressor):
    """cache_from_state builds its cache under rows_deferred: the store's slabs are the state's
    payload, not fresh zeroed slabs that load_state then drops (a load's double allocation)."""
    if compressor != "identity":
        pytest.importorskip("kakeyalattice")
    from inference_engine.kv.factory import cache_from_state
    from inference_engine.kv.stores import make_store, rows_deferred

    with rows_deferred():
        store = make_store("identity", 38, num_layers=2, num_kv_heads=2, head_dim=16, capacity=64,
                           dtype=torch.float32, device="cpu")
    assert store.capacity == 64 and store.nbytes == 0  # the capacity asked for, no rows yet
    assert make_store("identity", 38, num_layers=2, num_kv_heads=2, head_dim=16, capacity=64, dtype=torch.float32,
                      device="cpu").nbytes > 0  # outside: allocated as before

    e = engine_for("sink_window", compressor)
    e = Engine(e.model, dataclasses.replace(e.strategy, kv_dtype=kv_dtype), prefill_chunk=16)
    kv = e.new_session_kv()
    history = ids(40)
    turn(e, kv, history, 3)
    st = kv.state()
    restored = cache_from_state(st, e.model.geometry(), max_step=e.prefill_chunk, max_context=e.max_context)
    assert restored.nbytes == kv.cache.nbytes and restored.capacity == kv.cache.capacity
    payload = {k.removeprefix("store."): v for k, v in st.tensors.items() if k.startswith("store.") and k != "store.pos"}
    first = next(iter(payload.values()))[0]  # layer 0 of the first payload tensor: the store adopts it as it is
    slabs = restored.store.slabs[0] if compressor != "identity" else {"k": restored.store.k[0]}
    assert first.data_ptr() in {t.data_ptr() for t in slabs.values()}
    again = SessionKV.from_state(st, e.model.geometry(), max_step=e.prefill_chunk, max_context=e.max_context)
    assert turn(e, again, list(history), 6) == turn(e, kv, list(history), 6)
