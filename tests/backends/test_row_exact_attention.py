"""Row-exact steps (backends/torch/attention.py::_attend_rows, kv/layout.py::row_keys): a verify
block's rows are bit-equal to sequential one-token decode steps, for every resident strategy and
store, across the sink re-anchoring boundary, on the quantized formats whose kernels are row
independent. That is what makes speculation exact on int8/int4 (bf16 activations turn last-bit
differences into different tokens).

The real model: on tiny random-weight models the batched and row-by-row calls happen to round
alike (the control test below fails there), so only the real shapes can catch a regression."""
import functools

import pytest
import torch

from drafters import HashDrafter
from factories import require_smollm2
from inference_engine.backends.torch.model import TorchCausalLM
from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.generate import Engine
from inference_engine.engine.requests import GenerateParams
from inference_engine.engine.steps import forward
from inference_engine.kv.factory import make_cache
from inference_engine.kv.strategy import KVStrategy

STRATEGIES = {
    "full": KVStrategy("full"),
    "sink_window": KVStrategy("sink_window", 4, 24),
    "sink_window_d4": KVStrategy("sink_window", 4, 24, compressor="kakeya_d4"),
    "full_kv_int8": KVStrategy("full", kv_dtype="int8"),
    "sink_window_kv_int8": KVStrategy("sink_window", 4, 24, kv_dtype="int8"),
    "paged": KVStrategy("paged", 4, 24, page_size=8, recall_pages=2),
}


@functools.lru_cache(maxsize=None)
def smollm2(weights):
    return TorchCausalLM.load(require_smollm2(), weights=weights)


def ids(n, seed, vocab=20000):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_steps(model, kv, chunks, row_exact):
    out = []
    for c in chunks:
        start = kv.cache.next_position
        logits, _ = forward(model, model.tensor(c), range(start, start + len(c)), kv.cache, row_exact=row_exact)
        kv.cache.commit()
        out.append(logits)
    return torch.cat(out)


def session(model, strategy, max_context):
    kv = Engine(model, strategy, prefill_chunk=32).new_session_kv()
    kv.cache = make_cache(strategy, model.geometry(), max_step=32, max_context=max_context)
    return kv


def block_vs_sequential(model, strategy, prompt, block, max_context=4096):
    """Logits of `block` fed one token per step, and as one verify-shaped step, after the same prefill."""
    kvs = [session(model, strategy, max_context) for _ in range(2)]
    for kv in kvs:
        run_steps(model, kv, [prompt[i:i + 32] for i in range(0, len(prompt), 32)], row_exact=False)
    seq = run_steps(model, kvs[0], [[t] for t in block], row_exact=True)
    ver = run_steps(model, kvs[1], [block], row_exact=True)
    return seq, ver


@pytest.mark.model
@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_verify_rows_equal_decode_steps_bit_for_bit(weights, name):
    model = smollm2(weights)
    for seed, n in ((0, 70), (1, 45), (2, 9)):  # the ring has wrapped, is about to, has not started
        seq, ver = block_vs_sequential(model, STRATEGIES[name], ids(n, seed), ids(6, seed + 10))
        assert torch.equal(seq, ver), f"{weights} {name} prompt {n}: max diff {float((seq - ver).abs().max())}"


@pytest.mark.model
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_verify_rows_equal_decode_steps_across_the_sink_reanchoring(weights):
    """Queries past max_context score the sink from a virtual position; a block straddling that
    boundary still equals its decode steps row by row."""
    model = smollm2(weights)
    strategy = KVStrategy("sink_window", 4, 24)
    for start in (60, 62, 64, 70):  # block of 6 from `start`, boundary at 64
        seq, ver = block_vs_sequential(model, strategy, ids(start, start), ids(6, 99), max_context=64)
        assert torch.equal(seq, ver), f"block from {start}: max diff {float((seq - ver).abs().max())}"


@pytest.mark.model
def test_batched_block_is_not_row_exact_on_int4():
    """The control: without row-exact attention the same comparison fails (so the tests above can)."""
    model = smollm2("int4")
    kvs = [Engine(model, STRATEGIES["full"], prefill_chunk=32).new_session_kv() for _ in range(2)]
    prompt, block = ids(70, 0), ids(6, 10)
    for kv in kvs:
        run_steps(model, kv, [prompt[:32], prompt[32:64], prompt[64:]], row_exact=False)
    seq = run_steps(model, kvs[0], [[t] for t in block], row_exact=True)
    ver = run_steps(model, kvs[1], [block], row_exact=False)
    assert not torch.equal(seq, ver)


@pytest.mark.model
@pytest.mark.parametrize("name", ["full", "sink_window"])
def test_speculation_on_int4_smollm2_is_exact(name):
    """The default weight format on the real model: greedy speculative output == greedy AR output."""
    model = smollm2("int4")
    strategy = KVStrategy("full") if name == "full" else KVStrategy("sink_window", 4, 60)
    history = ids(90, 5)

    def run(engine):
        return [e.token_id for e in engine.generate(engine.new_session_kv(), history, GenerateParams(max_tokens=40))
                if isinstance(e, TokenGenerated)]

    want = run(Engine(model, strategy, prefill_chunk=64))
    for k in (2, 5):
        assert run(Engine(model, strategy, prefill_chunk=64, drafter=HashDrafter(model.spec.vocab_size), spec_k=k)) == want
