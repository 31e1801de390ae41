"""Engine loop: chunking independence, stop reasons, context limit, cancellation."""
import torch

from factories import make_engine
from inference_engine.engine.events import HistoryTruncated, TokenGenerated
from inference_engine.engine.generate import GenerateParams
from inference_engine.engine.sampling import SamplingParams


def run(engine, kv, pending, n, **kw):
    evs = list(engine.generate(kv, pending, GenerateParams(max_tokens=n, **kw)))
    return [e.token_id for e in evs if isinstance(e, TokenGenerated)], evs[-1], evs


def prompt(n, seed=0):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_multi_turn_equals_one_shot_history():
    # Turn by turn (generated tokens join the history) vs. the same history in one prefill.
    for strategy in ("full", "sink_window"):
        engine = make_engine("llama", strategy, 4, 24, prefill_chunk=8)
        kv = engine.new_session_kv()
        history = []
        for turn in range(3):
            history += prompt(13, seed=turn)
            toks, _, _ = run(engine, kv, history, 6)
            history += toks
        # Fresh session with the whole history except the last turn's output.
        kv2 = engine.new_session_kv()
        toks2, _, _ = run(engine, kv2, history[:-6], 6)
        assert toks2 == history[-6:], strategy


def test_eos_stops_and_is_reported():
    engine = make_engine("llama", "full")
    first, _, _ = run(engine, engine.new_session_kv(), prompt(10), 1)
    toks, done, _ = run(engine, engine.new_session_kv(), prompt(10), 20, eos_token_ids=frozenset(first))
    assert toks == first and done.stop_reason == "eos" and done.generated_tokens == 1


def test_max_tokens_and_done_counts():
    engine = make_engine("llama", "full")
    toks, done, _ = run(engine, engine.new_session_kv(), prompt(10), 7)
    assert len(toks) == 7 and done.stop_reason == "max_tokens" and done.prefill_tokens == 10
    assert 0 < done.time_to_first_token_seconds <= done.total_seconds


def test_full_stops_at_trained_context():
    engine = make_engine("llama", "full", max_position_embeddings=32)
    toks, done, _ = run(engine, engine.new_session_kv(), prompt(28), 10)
    assert len(toks) == 4 and done.stop_reason == "context_full"


def test_sink_window_reports_truncation():
    engine = make_engine("llama", "sink_window", 4, 16)
    kv = engine.new_session_kv()
    _, _, evs = run(engine, kv, prompt(50), 3)
    trunc = [e for e in evs if isinstance(e, HistoryTruncated)]
    assert trunc and trunc[0].dropped_tokens > 0
    assert kv.dropped_total == sum(e.dropped_tokens for e in trunc)
    assert kv.resident_positions == 4 + 16 - 1


def test_cancel_stops_generation():
    engine = make_engine("llama", "full")
    calls = {"n": 0}

    def stop():
        calls["n"] += 1
        return calls["n"] > 4

    kv = engine.new_session_kv()
    evs = list(engine.generate(kv, prompt(10), GenerateParams(max_tokens=50), stop))
    assert evs[-1].stop_reason == "cancelled" and 0 < evs[-1].generated_tokens < 50


def test_seeded_sampling_is_deterministic():
    engine = make_engine("qwen3", "sink_window", 4, 16)
    params = dict(sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=123))
    a, _, _ = run(engine, engine.new_session_kv(), prompt(40), 12, **params)
    b, _, _ = run(engine, engine.new_session_kv(), prompt(40), 12, **params)
    c, _, _ = run(engine, engine.new_session_kv(), prompt(40), 12, sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=124))
    assert a == b and a != c
