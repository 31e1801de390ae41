"""Weight formats of the torch backend (backends/torch/linear.py): kernels compute with the weights
they report, int4 reproduces GGUF Q4_1 blocks, the refined head keeps fp32's choices, quantized
engines keep the engine's exactness properties (INV-3, speculative = AR)."""
import numpy as np
import pytest
import torch

from drafters import HashDrafter
from factories import require_smollm2, tiny_model_dir
from inference_engine.backends.torch.linear import GROUP, DenseLinear, Int4Linear, Int8Linear, RefinedHead
from inference_engine.backends.torch.model import TorchCausalLM
from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.generate import Engine
from inference_engine.engine.requests import GenerateParams
from inference_engine.kv.strategy import KVStrategy


def rnd(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("make", [Int8Linear.from_float, Int4Linear.from_float])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_quantized_linear_computes_with_its_dequantized_weight(make, rows):
    lin = make(rnd(96, 128))
    x = rnd(rows, 128, seed=1)
    want = x.to(torch.bfloat16).float() @ lin.dequantized().T
    torch.testing.assert_close(lin(x), want, rtol=2e-2, atol=5e-2)  # bf16 output rounding


def test_quantization_error_is_bounded_by_the_step():
    w = rnd(64, 256)
    i8, i4 = Int8Linear.from_float(w), Int4Linear.from_float(w)
    assert float((i8.dequantized() - w).abs().max()) <= float(w.abs().max()) / 127 * 0.51 + 1e-3
    g = w.view(64, -1, GROUP)
    step = ((g.amax(-1) - g.amin(-1)) / 15).max()
    assert float((i4.dequantized() - w).abs().max()) <= float(step) * 0.51 + 2e-2  # + bf16 scale/zero rounding


def test_int4_from_blocks_keeps_the_codes():
    q = torch.randint(0, 16, (32, 64), generator=torch.Generator().manual_seed(2), dtype=torch.int64)
    d, m = rnd(32, 2).abs() * 0.01 + 1e-3, rnd(32, 2, seed=3) * 0.05
    lin = Int4Linear.from_blocks(q, d, m)
    assert torch.equal(lin.codes().long(), q)
    deq = (q.float().view(32, 2, GROUP) * d[..., None] + m[..., None]).view(32, 64)
    torch.testing.assert_close(lin.dequantized(), deq, rtol=0, atol=float((d.abs().max() * 8 + m.abs().max()) * 2**-8))


def test_kernels_are_row_independent():
    """A row's output does not depend on which other rows share the call: chunking cannot change results."""
    for lin in (Int8Linear.from_float(rnd(64, 96)), Int4Linear.from_float(rnd(64, 96))):
        x = rnd(12, 96, seed=4)
        full = lin(x)
        assert all(torch.equal(full[i : i + 1], lin(x[i : i + 1])) for i in range(12))


def test_refined_head_scores_the_top_candidates_exactly():
    w = rnd(5000, 64) * 0.2
    head, dense = RefinedHead(w, refine=8), DenseLinear(w)
    x = rnd(6, 64, seed=5)
    got, want = head(x), dense(x)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    top = want.topk(4, -1).indices
    torch.testing.assert_close(got.gather(-1, top), want.gather(-1, top), rtol=1e-5, atol=1e-5)


def test_refined_head_greedy_path_keeps_the_argmax_and_scores_its_candidates_exactly():
    """Greedy steps score with the 4-bit copy of the head (linear.RefinedHead): the argmax and the
    refined candidates are the fp32 head's, rows are independent of their call (row-exact verify),
    and the scoring really is a different (coarser) one, so the test sees the path it names."""
    w = rnd(5008, 64) * 0.2
    head, dense = RefinedHead(w, refine=8, greedy_refine=32), DenseLinear(w)
    assert head.greedy_approx is not None
    x = rnd(40, 64, seed=7)
    got, want = head(x, greedy=True), dense(x)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    top = want.topk(8, -1).indices
    torch.testing.assert_close(got.gather(-1, top), want.gather(-1, top), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(got[i : i + 1], head(x[i : i + 1], greedy=True)) for i in range(0, 40, 7))
    tail = want.topk(64, -1).indices[:, -1:]  # ranked below the refined set: the 4-bit score, not the exact one
    assert not torch.allclose(got.gather(-1, tail), want.gather(-1, tail), atol=1e-3)
    assert RefinedHead(rnd(304, 48), refine=8).greedy_approx is None  # not whole int4 groups: int8 for both
    assert RefinedHead(rnd(300, 64), refine=8).greedy_approx is None  # rows the kernel cannot pack: int8 for both


def test_greedy_generation_with_the_cheaper_head_equals_the_sampled_path_at_temperature_zero():
    """The engine's greedy sessions use the 4-bit head (StepInput.greedy); their tokens equal a
    step-by-step argmax over the int8 head's logits on the same quantized model."""
    from inference_engine.engine import steps

    m = TorchCausalLM.load(str(tiny_model_dir("llama")), weights="int4")
    assert m.head.greedy_approx is not None  # the 4-bit head path is the one under test
    history = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    engine = Engine(m, KVStrategy("full"), prefill_chunk=64)
    got = [e.token_id for e in engine.generate(engine.new_session_kv(), history, GenerateParams(max_tokens=12))
           if isinstance(e, TokenGenerated)]
    kv = engine.new_session_kv()
    steps.prefill_chunk(m, kv, history)
    want = [int(kv.last_logits.argmax())]
    for _ in range(11):
        steps.decode_step(m, kv, want[-1])
        want.append(int(kv.last_logits.argmax()))
    assert got == want


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_engine_is_chunking_independent_and_speculation_exact(weights):
    path = str(tiny_model_dir("llama"))
    m = TorchCausalLM.load(path, weights=weights)
    history = torch.randint(3, 200, (70,), generator=torch.Generator().manual_seed(6)).tolist()

    def run(engine, hist, n=16):
        return [e.token_id for e in engine.generate(engine.new_session_kv(), hist, GenerateParams(max_tokens=n))
                if isinstance(e, TokenGenerated)]

    ref = run(Engine(m, KVStrategy("full"), prefill_chunk=64), history)
    assert run(Engine(m, KVStrategy("full"), prefill_chunk=7), history) == ref  # INV-3 over chunkings
    assert run(Engine(m, KVStrategy("full"), prefill_chunk=64, drafter=HashDrafter(m.spec.vocab_size), spec_k=3), history) == ref


@pytest.mark.model
def test_int4_is_built_from_the_gguf_blocks_of_the_pulled_model():
    """The pulled directory keeps the GGUF; its Q4_1 blocks equal the pulled fp32 weights exactly,
    and the int4 model computes with those codes."""
    from safetensors import safe_open

    from inference_engine.model_store.gguf_blocks import q4_1_blocks

    path = require_smollm2()
    blocks = q4_1_blocks(path / "source.gguf", num_heads=9, num_kv_heads=3)
    f = safe_open(str(path / "model.safetensors"), "pt")
    assert len(blocks) == 30 * 7
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.17.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight"):
        q, d, m = blocks[name]
        n, k = q.shape
        deq = (q.float().view(n, k // GROUP, GROUP) * d[..., None] + m[..., None]).view(n, k)
        assert torch.equal(deq, f.get_tensor(name))
    model = TorchCausalLM.load(path, weights="int4")
    q0 = torch.cat([blocks[f"model.layers.0.self_attn.{p}_proj.weight"][0] for p in "qkv"])
    assert np.array_equal(model.layers[0].wqkv.codes().numpy(), q0.numpy())


def test_serve_refuses_speculation_over_restored_columns_with_quantized_weights():
    """Verify steps are row-exact except over dlm_restore's restored columns: that combination is
    refused on quantized weights, not served inexact; every other strategy speculates."""
    from inference_engine.server.app import ConfigError, ServeConfig, build_engine

    m = TorchCausalLM.load(str(tiny_model_dir("llama")), weights="int4")
    with pytest.raises(ConfigError, match="dlm_restore is exact only with --weights fp32"):
        build_engine(ServeConfig(drafter="ngram", kv_strategy="dlm_restore"), m)
    assert build_engine(ServeConfig(drafter="ngram", spec_k=0, kv_strategy="dlm_restore"), m).drafter is None
    for strategy in ("full", "sink_window"):
        assert build_engine(ServeConfig(drafter="ngram", kv_strategy=strategy), m).spec_k == 3


@pytest.mark.parametrize("make", [Int8Linear.from_float, Int4Linear.from_float])
def test_dequantized_linear_computes_what_the_cpu_kernel_does(make):
    """Off the CPU (CUDA) a quantized format runs as its dequantized bf16 matrix through dense GEMM."""
    from inference_engine.backends.torch.linear import DequantizedLinear

    lin = make(rnd(96, 128))
    dense = DequantizedLinear(lin, "cpu")
    assert dense.w.dtype == torch.bfloat16
    x = rnd(5, 128, seed=1)
    torch.testing.assert_close(dense(x), lin(x), rtol=2e-2, atol=1e-1)
    torch.testing.assert_close(dense.dequantized(), lin.dequantized(), rtol=1e-2, atol=1e-2)
