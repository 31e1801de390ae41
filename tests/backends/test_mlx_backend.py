"""The MLX backend (backends/mlx): equal to the torch backend on the same weights, through the same
engine steps and caches; INV-1/INV-3, speculative rollback, cache state, int4 from Q4_1 blocks.

Tiny random-weight models. The engine/cache properties run on each backend on its own are in
test_backend_parity.py; these compare the backends with each other. Without MLX the MLX cases
skip (they fail under CI, where `make test` installs it)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from factories import BACKENDS, load_model, make_engine, require_backend, tiny_model_dir
from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.requests import GenerateParams, SamplingParams
from inference_engine.kv.factory import cache_from_state, make_cache
from inference_engine.kv.strategy import KVStrategy

MLX_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def ids(n: int, seed: int, vocab: int = 256) -> list:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(engine, history, n, kv=None, **sampling) -> list:
    kv = kv or engine.new_session_kv()
    params = GenerateParams(max_tokens=n, sampling=SamplingParams(**sampling) if sampling else SamplingParams())
    return [e.token_id for e in engine.generate(kv, history, params) if isinstance(e, TokenGenerated)]


def host_logits(model, tokens, strategy="full"):
    from inference_engine.engine.steps import forward

    cache = make_cache(KVStrategy(strategy, 4, 8), model.geometry(), max_step=256, max_context=model.spec.max_context)
    out, _ = forward(model, model.tensor(tokens), range(len(tokens)), cache)
    return model.to_host(out)


@pytest.mark.parametrize("arch", MLX_ARCHS)
def test_mlx_logits_equal_torch_logits(arch):
    require_backend("mlx")
    path = str(tiny_model_dir(arch))
    t, m = host_logits(load_model(path), ids(40, 0)), host_logits(load_model(path, "mlx"), ids(40, 0))
    assert m.dtype == torch.float32 and m.shape == t.shape
    torch.testing.assert_close(m, t, atol=2e-4, rtol=1e-4)
    assert torch.equal(m.argmax(-1), t.argmax(-1))


@pytest.mark.parametrize("arch", MLX_ARCHS)
def test_mlx_full_greedy_matches_transformers(arch):
    from transformers import AutoModelForCausalLM

    require_backend("mlx")
    path = tiny_model_dir(arch)
    prompt = ids(12, 1)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 12:]
    assert generate(make_engine(arch, backend="mlx"), prompt, 24) == want.tolist()


@pytest.mark.parametrize("strategy, window", [("full", 1020), ("sink_window", 12)])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_k": 20, "seed": 3}], ids=["greedy", "sampled"])
def test_mlx_generates_what_torch_generates(strategy, window, sampling):
    """Same weights, strategy, seed: token-identical streams (sampling runs on host logits on both)."""
    require_backend("mlx")
    history = ids(50, 4)
    got = {b: generate(make_engine("qwen3", strategy, 4, window, prefill_chunk=16, backend=b), history, 24, **sampling)
           for b in BACKENDS}
    assert got["mlx"] == got["torch"]


@pytest.mark.parametrize("pages", [2, 100])
def test_mlx_paged_generates_what_torch_generates(pages):
    """The paged strategy on MLX (recall on host torch tensors, archiving through MlxSlabStore.read) gives
    torch's tokens, greedy and sampled, with pages archived and recalled."""
    require_backend("mlx")
    from inference_engine.engine.generate import Engine

    strategy = KVStrategy("paged", 4, 12, page_size=8, recall_pages=pages)
    history, got = ids(90, 13), {}
    for b in BACKENDS:
        engine = Engine(load_model(str(tiny_model_dir("llama")), b), strategy, prefill_chunk=32)
        kv = engine.new_session_kv()
        got[b] = (generate(engine, history, 16, kv=kv), generate(engine, history, 8, temperature=0.9, seed=5), kv.cache.pages.rows)
    assert got["mlx"] == got["torch"] and got["mlx"][2] > 0


def test_mlx_sink_window_past_the_trained_context_equals_torch():
    """Past max_context the sink is scored from the virtual query position (SinkWindowCache) on MLX too."""
    require_backend("mlx")
    history = ids(70, 5)
    got = {b: generate(make_engine("llama", "sink_window", 4, 16, prefill_chunk=8, backend=b, max_position_embeddings=48),
                       history, 12) for b in BACKENDS}
    assert got["mlx"] == got["torch"]


@pytest.mark.parametrize("strategy, window", [("full", 1020), ("sink_window", 10)])
def test_mlx_cache_keeps_inv1_and_the_torch_caches_bytes(strategy, window):
    """INV-1 after every step; the MLX store holds the same rows and bytes as torch's (bounded for sink_window)."""
    require_backend("mlx")
    kvs = {b: (make_engine("llama", strategy, 4, window, prefill_chunk=8, backend=b), []) for b in BACKENDS}
    for engine, sizes in kvs.values():
        kv = engine.new_session_kv()
        for chunk in range(6):
            engine.prefill(kv, ids(8, 10 + chunk))
            kv.cache.check_inv1()
            sizes.append((kv.nbytes, kv.resident_positions, kv.cache.pos.tolist()))
    assert kvs["mlx"][1] == kvs["torch"][1]
    nbytes = [n for n, _, _ in kvs["mlx"][1]]
    if strategy == "sink_window":
        assert len(set(nbytes[2:])) == 1 and kvs["mlx"][1][-1][1] < 4 + window + 1  # bounded between steps
    else:
        assert kvs["mlx"][1][-1][1] == 48


@pytest.mark.parametrize("strategy, window", [("full", 1020), ("sink_window", 10)])
def test_mlx_cache_state_round_trip_and_cross_backend(strategy, window):
    """state() -> cache_from_state continues token-identically; a state saved by the torch backend
    loads into the MLX backend (the same CPU tensors) and continues as torch does."""
    require_backend("mlx")
    engines = {b: make_engine("llama", strategy, 4, window, prefill_chunk=8, backend=b) for b in BACKENDS}
    history = ids(30, 8)
    want = generate(engines["torch"], history, 10)
    for src in BACKENDS:
        kv = engines[src].new_session_kv()
        engines[src].prefill(kv, history)
        st = kv.state()
        mx_engine = engines["mlx"]
        cache = cache_from_state(st, mx_engine.model.geometry(), max_step=8, max_context=mx_engine.max_context)
        assert type(cache.store).__name__ == "MlxSlabStore"
        from inference_engine.engine.session_kv import SessionKV

        restored = SessionKV(cache)
        restored.last_logits = kv.last_logits
        assert generate(mx_engine, history, 10, kv=restored) == want, f"state saved by {src}"


def test_mlx_int4_from_q4_1_blocks_computes_what_torch_int4_computes():
    """MLX int4 from Q4_1 blocks holds torch int4's weights (bf16 scale and zero = m + 8 d) and returns
    torch's kernel output bit for bit (bf16 activations and output), whatever the number of rows;
    fused rows stay independent."""
    require_backend("mlx")
    import mlx.core as mx

    from inference_engine.backends.mlx.linear import Int4Linear
    from inference_engine.backends.torch.linear import Int4Linear as TorchInt4

    g = np.random.default_rng(0)
    q = g.integers(0, 16, (48, 96)).astype(np.uint8)
    d = (g.random((48, 3)) * 0.05).astype(np.float16).astype(np.float32)
    m = ((g.random((48, 3)) - 0.5) * 0.4).astype(np.float16).astype(np.float32)
    lin = Int4Linear.from_blocks(q, d, m)
    ref = TorchInt4.from_blocks(*(torch.from_numpy(a) for a in (q, d, m)))
    want = ref.dequantized().numpy()
    assert np.array_equal(np.array(lin.dequantized()), want)
    exact = (q.reshape(48, 3, 32) * d[..., None] + m[..., None]).reshape(48, 96)
    assert 0 < np.abs(want - exact).max() < 0.01  # bf16 scale/zero: not the fp16 block values
    for rows in (1, 5, 17):
        x = g.standard_normal((rows, 96)).astype(np.float32)
        assert np.array_equal(np.array(lin(mx.array(x))), ref(torch.from_numpy(x)).numpy()), f"{rows} rows"
    fused = Int4Linear.stacked([lin, Int4Linear.from_blocks(q[:16], d[:16], m[:16])])
    assert np.array_equal(np.array(fused.dequantized()), np.concatenate([want, want[:16]]))
    x = mx.array(g.standard_normal((5, 96)).astype(np.float32))
    assert np.array_equal(np.array(fused(x))[:, :48], np.array(lin(x)))


def test_mlx_int4_equals_torch_int4_on_a_tiny_model():
    """Without a GGUF both backends quantize with the same Q4_1 quantizer: every linear's weights and
    outputs are equal, and greedy generation is token-identical."""
    require_backend("mlx")
    import mlx.core as mx

    from inference_engine.backends.mlx.model import MlxCausalLM
    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.generate import Engine

    path = tiny_model_dir("llama")
    mm, tm = MlxCausalLM.load(path, weights="int4"), TorchCausalLM.load(path, weights="int4")
    assert mm.int4_source.startswith("Q4_1 min/max") and mm.weight_bytes < MlxCausalLM.load(path).weight_bytes
    g = np.random.default_rng(1)
    for L, R in zip(mm.layers, tm.layers):
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            a, b = getattr(L, name), getattr(R, name)
            assert np.array_equal(np.array(a.dequantized()), b.dequantized().numpy()), name
            x = g.standard_normal((3, b.shape[1])).astype(np.float32)
            assert np.array_equal(np.array(a(mx.array(x))), b(torch.from_numpy(x)).numpy()), name
    history = ids(20, 9)
    got = {b: generate(Engine(m, KVStrategy("sink_window", 4, 8), prefill_chunk=8), history, 16) for b, m in (("mlx", mm), ("torch", tm))}
    assert got["mlx"] == got["torch"]


@pytest.mark.parametrize("fmt", ["fp16"])
def test_mlx_weight_formats_compute_with_their_weights(fmt):
    """fp16 equals an fp32 model holding the weights it computes with, and runs the engine's steps
    (int4: test_mlx_int4_equals_torch_int4_on_a_tiny_model)."""
    require_backend("mlx")
    import mlx.core as mx

    from inference_engine.backends.mlx.linear import DenseLinear
    from inference_engine.backends.mlx.model import MlxCausalLM
    from inference_engine.engine.generate import Engine

    path = tiny_model_dir("llama")
    model, ref = MlxCausalLM.load(path, weights=fmt), MlxCausalLM.load(path, weights="fp32")
    assert model.weights_format == fmt and model.weight_bytes < ref.weight_bytes
    for L, R in zip(model.layers, ref.layers):
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            setattr(R, name, DenseLinear(getattr(L, name).dequantized()))
    if fmt == "fp16":
        ref.head = DenseLinear(model.head.w.astype(mx.float32))
    history = ids(20, 9)
    got, want = host_logits(model, history), host_logits(ref, history)
    tol = 5e-2  # fp16 activations
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert len(generate(Engine(model, KVStrategy("sink_window", 4, 8), prefill_chunk=8), history, 8)) == 8


@pytest.mark.model
def test_mlx_int4_on_smollm2_is_torch_int4():
    """The pulled model's int4 on MLX is built from source.gguf's Q4_1 blocks, as torch's is, and its
    linears hold torch int4's weights and return its kernel's outputs bit for bit."""
    require_backend("mlx")
    from factories import require_smollm2
    from inference_engine.backends.mlx.model import MlxCausalLM
    from inference_engine.backends.torch.model import TorchCausalLM

    path = require_smollm2()
    if not (path / "source.gguf").exists():
        pytest.skip("this pull keeps no source.gguf (re-pull the model)")
    m4, t4 = MlxCausalLM.load(path, weights="int4"), TorchCausalLM.load(path, weights="int4")
    assert m4.int4_source == "gguf Q4_1 blocks"
    import mlx.core as mx

    g = np.random.default_rng(2)
    for L4, T4 in zip(m4.layers[:4], t4.layers[:4]):
        for a, b in ((L4.wqkv, T4.wqkv), (L4.w_gate_up, T4.w_gate_up), (L4.w_down, T4.w_down)):
            assert np.array_equal(np.array(a.dequantized()), b.dequantized().numpy())
            x = g.standard_normal((2, b.shape[1])).astype(np.float32)
            assert np.array_equal(np.array(a(mx.array(x))), b(torch.from_numpy(x)).numpy())


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
@pytest.mark.parametrize("strategy, window", [("full", 1020), ("sink_window", 10)])
def test_mlx_verify_rows_are_bit_equal_to_decode_steps(fmt, strategy, window):
    """A verify block's logit rows equal sequential one-token decode steps bit for bit on MLX (row-exact
    attention + row-independent MLX linears, int4 included), so speculation cannot change a token."""
    require_backend("mlx")
    from inference_engine.backends.mlx.model import MlxCausalLM
    from inference_engine.engine.generate import Engine
    from inference_engine.engine.steps import forward

    model = MlxCausalLM.load(tiny_model_dir("llama"), weights=fmt)
    engine = Engine(model, KVStrategy(strategy, 4, window), prefill_chunk=8)
    history, block = ids(21, 11), ids(5, 12)
    kv_a, kv_b = engine.new_session_kv(), engine.new_session_kv()
    engine.prefill(kv_a, history)
    engine.prefill(kv_b, history)
    p = kv_a.next_position
    out, _ = forward(model, model.tensor(block), range(p, p + 5), kv_a.cache, row_exact=True)
    rows = model.to_host(out)
    kv_a.cache.commit()
    for j, t in enumerate(block):
        one, _ = forward(model, model.tensor([t]), range(p + j, p + j + 1), kv_b.cache, row_exact=True)
        assert torch.equal(model.to_host(one)[0], rows[j]), f"row {j}"
        kv_b.cache.commit()
