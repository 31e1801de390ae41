"""The step's dense work through the graph runner (backends/torch/graphs.py) computes what the
eager pieces compute. On the CPU the runner calls its segment functions over the same static
buffers a CUDA capture replays (padding rows, copies in and out), so everything but the capture
itself is checked here; scripts/gpu_check.py checks the captured graphs on a GPU."""
import pytest
import torch

from factories import tiny_model_dir
from inference_engine.backends.torch.graphs import StepGraphs
from inference_engine.backends.torch.model import TorchCausalLM
from inference_engine.engine import steps
from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.generate import Engine
from inference_engine.engine.requests import GenerateParams
from inference_engine.kv.strategy import KVStrategy


def _model(graphs: bool):
    m = TorchCausalLM.load(tiny_model_dir("llama"))
    if graphs:
        m.graphs = StepGraphs(m, capture=False, buckets=(1, 2, 4, 8, 16))
    return m


def _prompt(n, seed=0):
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _tokens(engine, history, n=16):
    return [e.token_id for e in engine.generate(engine.new_session_kv(), history, GenerateParams(max_tokens=n))
            if isinstance(e, TokenGenerated)]


STRATEGIES = [KVStrategy("full"), KVStrategy("sink_window", 4, 12),
              KVStrategy("paged", 4, 12, page_size=4, recall_pages=2)]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_generate_through_the_runner_equals_eager(strategy):
    eager, graphed = _model(False), _model(True)
    history = _prompt(40)
    # prefill chunks of 6 rows run through the 8-row bucket (2 padding rows), decode steps through the 1-row one
    want = _tokens(Engine(eager, strategy, prefill_chunk=6), history)
    got = _tokens(Engine(graphed, strategy, prefill_chunk=6), history)
    assert got == want
    assert set(graphed.graphs._runners) >= {1, 8}


def test_a_batched_forward_with_capture_equals_eager():
    """Three sessions' steps of 1, 3 and 5 rows in one forward (a 16-row bucket): logits, hidden
    states and captured layers match the eager forward's; the hidden states returned outlive the
    runner's next step (drafters keep them)."""
    eager, graphed = _model(False), _model(True)
    strategy = KVStrategy("sink_window", 4, 12)
    results = {}
    for name, m in (("eager", eager), ("graphs", graphed)):
        caches = []
        for i, n in enumerate((9, 14, 20)):
            kv = Engine(m, strategy, prefill_chunk=32).new_session_kv()
            steps.prefill_chunk(m, kv, _prompt(n, seed=i))
            caches.append(kv.cache)
        inputs = [steps.StepInput(m.tensor(_prompt(t, seed=10 + j)), range(c.next_position, c.next_position + t), c,
                                  capture=(0, 1)) for j, (c, t) in enumerate(zip(caches, (1, 3, 5)))]
        out = steps.forward_batch(m, inputs)
        for c in caches:
            c.commit(0)
        results[name] = ([o[0] for o in out], [o[1] for o in out], [inp.captured for inp in inputs])
        if name == "graphs":  # the next step through the same bucket must not change what was returned
            kept = [h.clone() for h in results[name][1]]
            steps.forward_batch(m, [steps.StepInput(m.tensor(_prompt(9, seed=99)), range(caches[0].next_position,
                                                                                          caches[0].next_position + 9), caches[0])])
            caches[0].commit(0)
            for h, k in zip(results[name][1], kept):
                assert torch.equal(h, k)
    for a, b in zip(*(results[k] for k in ("eager", "graphs"))):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


def test_compile_modes():
    m = TorchCausalLM.load(tiny_model_dir("llama"))
    assert m.use_step_graphs("auto") is False and m.step_runner(1) is None  # the CPU: eager pieces
    assert m.use_step_graphs("off") is False
    assert m.use_step_graphs("on") is True and m.graphs.fns.compiled and not m.graphs.capture  # inductor, no capture
    with pytest.raises(ValueError, match="off, auto or on"):
        m.use_step_graphs("fast")


@pytest.mark.slow  # three inductor compiles (~30 s on 2 cores)
def test_inductor_segments_generate_what_eager_pieces_do(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    eager = _model(False)
    compiled = _model(False)
    compiled.graphs = StepGraphs(compiled, capture=False, compiled=True, buckets=(1, 8))
    history = _prompt(40)
    strategy = KVStrategy("sink_window", 4, 12)
    assert _tokens(Engine(compiled, strategy, prefill_chunk=8), history) == _tokens(Engine(eager, strategy, prefill_chunk=8), history)


@pytest.mark.parametrize("strategy", [KVStrategy("full"), KVStrategy("sink_window", 4, 12)], ids=lambda s: s.name)
def test_batched_decode_attention_equals_per_session(strategy, monkeypatch):
    """Off the CPU, several sessions' decode rows attend in one call (slabs stacked, unequal widths
    padded and masked): the logits are those of each session attending alone."""
    results = {}
    for batched in (False, True):
        m = _model(True)
        monkeypatch.setattr(type(m), "batches_decode_attention", property(lambda self, b=batched: b))
        calls = []
        real = m.attend_decode_batch
        m.attend_decode_batch = lambda *a: calls.append(1) or real(*a)
        caches = []
        for i, n in enumerate((9, 14, 30)):  # full: three widths
            kv = Engine(m, strategy, prefill_chunk=32).new_session_kv()
            steps.prefill_chunk(m, kv, _prompt(n, seed=i))
            caches.append(kv.cache)
        outs = []
        for step in range(3):
            inputs = [steps.StepInput(m.tensor([5 + step + j]), range(c.next_position, c.next_position + 1), c, row_exact=True)
                      for j, c in enumerate(caches)]
            outs.append([o[0] for o in steps.forward_batch(m, inputs)])
            for c in caches:
                c.commit()
        results[batched] = outs
        assert len(calls) == (3 * m.spec.num_layers if batched else 0)
    for a, b in zip(results[False], results[True]):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
