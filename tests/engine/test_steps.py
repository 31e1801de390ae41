"""The engine's steps are usable alone: driving prefill_chunk / decode_step / verify_block by hand
(as a bench does) gives exactly Engine.generate's tokens, and a failed step leaves the cache as it was."""
import pytest
import torch

from drafters import HashDrafter
from factories import load_model, tiny_model_dir
from inference_engine.engine import steps
from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.generate import Engine
from inference_engine.engine.requests import GenerateParams, SamplingParams
from inference_engine.kv.strategy import KVStrategy


def prompt(n, seed=0):
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("strategy", [KVStrategy("full"), KVStrategy("sink_window", 4, 16)])
def test_hand_driven_steps_equal_generate(strategy):
    m = load_model(str(tiny_model_dir("llama")))
    engine = Engine(m, strategy, prefill_chunk=16)
    history = prompt(50)
    want = [e.token_id for e in engine.generate(engine.new_session_kv(), history, GenerateParams(max_tokens=12))
            if isinstance(e, TokenGenerated)]
    kv = engine.new_session_kv()
    for i in range(0, len(history), 16):
        steps.prefill_chunk(m, kv, history[i : i + 16])
    got = [int(torch.argmax(kv.last_logits))]
    while len(got) < 12:
        steps.decode_step(m, kv, got[-1])
        got.append(int(torch.argmax(kv.last_logits)))
    assert got == want


def test_verify_block_alone_accepts_the_greedy_continuation():
    m = load_model(str(tiny_model_dir("llama")))
    engine = Engine(m, KVStrategy("full"), prefill_chunk=16)
    history = prompt(30, seed=1)
    greedy = [e.token_id for e in engine.generate(engine.new_session_kv(), history, GenerateParams(max_tokens=6))
              if isinstance(e, TokenGenerated)]
    kv = engine.new_session_kv()
    steps.prefill_chunk(m, kv, history)
    step = steps.verify_block(m, kv, greedy[0], greedy[1:4], SamplingParams(), None, budget=10)
    assert step.accepted == 3 and list(step.emitted) == greedy[1:5] and step.committed == 4
    wrong = (greedy[5] + 1) % m.spec.vocab_size
    step = steps.verify_block(m, kv, greedy[4], [wrong], SamplingParams(), None, budget=10)
    assert step.accepted == 0 and step.emitted == (greedy[5],) and kv.next_position == len(history) + 5


def test_a_failing_step_leaves_the_cache_untouched():
    m = load_model(str(tiny_model_dir("llama")))
    engine = Engine(m, KVStrategy("sink_window", 4, 16), prefill_chunk=16, drafter=HashDrafter(256), spec_k=2)
    kv = engine.new_session_kv()
    for i in range(0, 40, 16):
        steps.prefill_chunk(m, kv, prompt(40)[i : i + 16])
    before = (kv.next_position, kv.resident_positions, kv.nbytes, kv.last_logits.clone())

    def boom(*a, **k):
        raise RuntimeError("acceptance failed")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(steps, "accept_drafts", boom)
        with pytest.raises(RuntimeError, match="acceptance failed"):
            steps.verify_block(m, kv, 5, [6, 7], SamplingParams(), None, budget=4)
    assert (kv.next_position, kv.resident_positions, kv.nbytes) == before[:3]
    assert torch.equal(kv.last_logits, before[3])
    steps.decode_step(m, kv, 5)  # and the session goes on
    assert kv.next_position == before[0] + 1
