"""The daemon's warm-up (engine/tuning.py warm_up): a scratch generation through Engine.generate
before READY. It must leave nothing behind: a session afterwards generates what it would have."""
import pytest

from factories import load_model, tiny_model_dir
from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.generate import Engine
from inference_engine.engine.requests import GenerateParams, SamplingParams
from inference_engine.engine.tuning import warm_up
from inference_engine.kv.strategy import KVStrategy


def tokens(engine, history, sampling):
    kv = engine.new_session_kv()
    return [e.token_id for e in engine.generate(kv, history, GenerateParams(max_tokens=6, sampling=sampling))
            if isinstance(e, TokenGenerated)]


@pytest.mark.parametrize("strategy", [KVStrategy("full"), KVStrategy("sink_window", 4, 12),
                                      KVStrategy("paged", 4, 12, page_size=8, recall_pages=2)])
def test_warm_up_leaves_generation_unchanged(strategy):
    m = load_model(str(tiny_model_dir("llama")))
    history = list(range(5, 45))
    samplings = (SamplingParams(), SamplingParams(temperature=0.8, seed=3))
    cold = [tokens(Engine(m, strategy, prefill_chunk=8), history, s) for s in samplings]
    e = Engine(m, strategy, prefill_chunk=8)
    assert warm_up(e, tokens=24) > 0  # 24 tokens: past the window of sink_window / paged, so recall runs too
    assert [tokens(e, history, s) for s in samplings] == cold


def test_start_up_objects_are_frozen_out_of_later_collections():
    """server/app.freeze_startup_objects, which `kakeya serve` calls before READY: what start-up made (here the tiny model
    and this process's modules) leaves the objects a collection walks; what is made afterwards is collected."""
    import gc

    from inference_engine.server.app import freeze_startup_objects

    m = load_model(str(tiny_model_dir("llama")))
    try:
        assert freeze_startup_objects() >= 0
        frozen = gc.get_freeze_count()
        assert frozen > 1000
        assert not any(o is m for o in gc.get_objects())  # the model is out of the tracked generations
        later = [[]]
        assert any(o is later for o in gc.get_objects())  # new objects are tracked as before
    finally:
        gc.unfreeze()
