"""The native CPU row step (backends/torch/native.py, csrc/row_step.cpp): decode rows and verify blocks in one
C++ call compute what the Python pieces compute (to float rounding), keep the engine's bit-equalities among
themselves (a verify block's rows = one-token steps; a session batched = the session alone), and decline what
they do not cover, which then runs in Python."""

import dataclasses

import numpy as np
import pytest
import torch

from factories import feed, require_native, tiny_model_dir
from inference_engine.backends.torch import native
from inference_engine.backends.torch.model import TorchCausalLM
from inference_engine.engine import steps
from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.generate import Engine
from inference_engine.engine.requests import GenerateParams, SamplingParams
from inference_engine.kv.factory import make_cache
from inference_engine.kv.strategy import KVStrategy


def _module():
    return require_native()


@pytest.fixture(params=[0, 1], ids=["attention-vec16", "attention-avx2"])
def attention(request):
    """Each attention chunk code this CPU can run (csrc/row_step.cpp: the 16-lane vector code, and the AVX2 one that
    runs where the build has AVX2 and no AVX-512), so both are checked on any x86 machine."""
    mod = _module()
    if request.param == 1 and mod.q4_isa() == 0:
        pytest.skip("no AVX2 here")
    was = mod.row_attention(request.param)
    yield request.param
    mod.row_attention(was)


def _model(weights="int4", q4=True):
    _module()
    m = TorchCausalLM.load(tiny_model_dir("llama"), weights=weights)
    assert m.use_native_step(q4=q4) is True
    return m


def _prompt(n, seed=0):
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# fp32 slabs, and fp16 ones (--kv-dtype fp16: the AVX2 attention converts each key and value in its registers, the
# 16-lane code a chunk of them to floats first)
STRATEGIES = [KVStrategy("full"), KVStrategy("sink_window", 4, 12), KVStrategy("full", kv_dtype="fp16"),
              KVStrategy("sink_window", 4, 12, kv_dtype="fp16")]


def _sid(s):
    return s.name if s.kv_dtype == "fp32" else f"{s.name}-{s.kv_dtype}"


def _decode_both(m, nat, kvs, tokens):
    """Decode the same tokens on kvs[0] with the native step and on kvs[1] with the Python pieces; their logits agree
    to the kernels' rounding and pick the same token. The native step is left on."""
    for tok in tokens:
        m.native_step = nat
        steps.decode_step(m, kvs[0], tok)
        m.native_step = None
        steps.decode_step(m, kvs[1], tok)
        a, b = kvs[0].last_logits, kvs[1].last_logits
        # the kernels round activations to bf16: a hidden state 1e-7 apart can flip one element's rounding, which
        # moves logits by one bf16 step of that input times its weights (seen: 0.016 once in 30 steps; else 0)
        assert torch.allclose(a, b, atol=5e-2, rtol=0), (a - b).abs().max()
        assert int(a.argmax()) == int(b.argmax())
    m.native_step = nat


@pytest.mark.parametrize("strategy", STRATEGIES, ids=_sid)
@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_native_decode_matches_the_python_pieces(strategy, weights, attention):
    """With torch's own kernels inside (q4 off) the native step computes what the Python pieces do, to float rounding."""
    m = _model(weights, q4=False)
    nat = m.native_step
    engine = Engine(m, strategy, prefill_chunk=16)
    kvs = [engine.new_session_kv() for _ in range(2)]
    for kv in kvs:
        engine.prefill(kv, _prompt(40))
    before = nat.steps
    _decode_both(m, nat, kvs, _prompt(30, seed=1))  # past sink_window's ring: its slots wrap
    assert nat.steps - before == 30  # every step of the first session ran natively
    # the K/V each wrote agree too (fp16 slabs: a value the two paths compute 1e-7 apart can round to neighbouring
    # fp16 values, and later layers read that step: up to 2^-8 of the slab's largest value allowed, ~2^-9.5 seen)
    for layer in range(m.spec.num_layers):
        assert kvs[0].cache.store.k[layer].dtype == (torch.float16 if strategy.kv_dtype == "fp16" else torch.float32)
        for a, b in ((kvs[0].cache.store.k[layer], kvs[1].cache.store.k[layer]),
                     (kvs[0].cache.store.v[layer], kvs[1].cache.store.v[layer])):
            atol = 1e-4 if strategy.kv_dtype == "fp32" else 2 ** -8 * float(b.float().abs().max())
            assert torch.allclose(a.float(), b.float(), atol=atol, rtol=0), float((a.float() - b.float()).abs().max())


@pytest.mark.parametrize("strategy", STRATEGIES, ids=_sid)
def test_a_native_verify_block_equals_native_one_token_steps(strategy, attention):
    m = _model()
    engine = Engine(m, strategy, prefill_chunk=16)
    a, b, c = (engine.new_session_kv() for _ in range(3))
    for kv in (a, b, c):
        engine.prefill(kv, _prompt(30))
    token, drafts = 17, []
    for _ in range(4):  # the verifier's own greedy continuation: every draft is accepted, every row compared
        steps.decode_step(m, c, drafts[-1] if drafts else token)
        drafts.append(int(c.last_logits.argmax()))
    before = m.native_step.steps
    res = steps.verify_block(m, a, token, drafts, SamplingParams(), None, budget=10)
    assert m.native_step.steps == before + 1 and res.accepted == 4
    rows = []
    for tok in [token, *drafts]:
        steps.decode_step(m, b, tok)
        rows.append(b.last_logits)
    assert torch.equal(a.last_logits, rows[-1])
    assert a.cache.next_position == b.cache.next_position
    for layer in range(m.spec.num_layers):
        assert torch.equal(a.cache.store.k[layer], b.cache.store.k[layer])
        assert torch.equal(a.cache.store.v[layer], b.cache.store.v[layer])


@pytest.mark.parametrize("strategy", [KVStrategy("full"), KVStrategy("sink_window", 4, 300)], ids=lambda s: s.name)
def test_trimmed_columns_and_rows_apart_give_the_same_bits(strategy, attention):
    """A whole step's rows end at their last visible column (trim_columns: a ring not yet full, a prefill chunk's causal
    mask) and a step of several rows shares its per-row loops and short attention out to the threads (rows_apart);
    each setting must give the bits of scanning every column on one thread: prefill chunks, a verify block, and one
    forward of three sessions' decode rows at different lengths (the ring of 304 columns holds 20-90 tokens)."""
    m = _model()
    mod = m.native_step.module
    engine = Engine(m, strategy, prefill_chunk=32)
    assert mod.trim_columns() == 1 and mod.rows_apart() == 1
    runs = []
    try:
        for trim, apart in ((0, 0), (1, 0), (0, 1), (1, 1)):
            mod.trim_columns(trim)
            mod.rows_apart(apart)
            kvs = [engine.new_session_kv() for _ in range(3)]
            for i, kv in enumerate(kvs):
                engine.prefill(kv, _prompt(20 + 35 * i, seed=i))
            steps.verify_block(m, kvs[0], 17, [18, 19, 20, 21], SamplingParams(), None, budget=10)
            inputs = []
            for kv in kvs:
                start = kv.cache.next_position
                inputs.append(steps.StepInput(m.tensor([int(kv.last_logits.argmax())]), range(start, start + 1),
                                              kv.cache, "last", row_exact=True))
            out = steps.forward_batch(m, inputs)
            for kv in kvs:
                kv.cache.commit(1)
            runs.append(([o[0] for o in out], [kv.cache.store for kv in kvs]))
    finally:
        mod.trim_columns(1)
        mod.rows_apart(1)
    ref_logits, ref_stores = runs[0]
    for logits, stores in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
        for a, b in zip(stores, ref_stores):
            for layer in range(m.spec.num_layers):
                assert torch.equal(a.k[layer], b.k[layer]) and torch.equal(a.v[layer], b.v[layer])


def test_a_step_by_data_or_row_by_row_gives_the_same_bits(attention):
    """A step's attention tasks run by the data they read (a chunk's K/V read once for every row of the block) by
    default; row by row (the order before) must give the same bits: prefill chunks whose rows span several column
    chunks, and a verify block."""
    m = _model()
    mod = m.native_step.module
    engine = Engine(m, KVStrategy("full"), prefill_chunk=64)
    prompt = _prompt(700, seed=3)  # rows past 512 columns: three chunks of 256
    kvs, logits = [], []
    was = mod.order_by_data()
    assert was == 1
    try:
        for order in (1, 0):
            mod.order_by_data(order)
            kv = engine.new_session_kv()
            engine.prefill(kv, prompt)
            steps.verify_block(m, kv, 17, [18, 19, 20, 21], SamplingParams(), None, budget=10)
            kvs.append(kv)
            logits.append(kv.last_logits)
    finally:
        mod.order_by_data(was)
    assert torch.equal(logits[0], logits[1])
    for layer in range(m.spec.num_layers):
        assert torch.equal(kvs[0].cache.store.k[layer], kvs[1].cache.store.k[layer])
        assert torch.equal(kvs[0].cache.store.v[layer], kvs[1].cache.store.v[layer])


def test_the_two_attention_codes_agree_to_float_rounding():
    mod = _module()
    if mod.q4_isa() == 0:
        pytest.skip("no AVX2 here")
    m = _model()
    engine = Engine(m, KVStrategy("full"), prefill_chunk=64)
    was = mod.row_attention()
    logits = []
    try:
        for kernel in (0, 1):
            mod.row_attention(kernel)
            assert mod.row_attention() == kernel
            kv = engine.new_session_kv()
            engine.prefill(kv, _prompt(300, seed=9))  # past one chunk of 256 columns, a tail that is not whole vectors
            steps.decode_step(m, kv, 5)
            logits.append(kv.last_logits)
    finally:
        mod.row_attention(was)
    assert torch.allclose(logits[0], logits[1], atol=1e-3 * float(logits[0].abs().max()), rtol=0)
    with pytest.raises(RuntimeError, match="row_attention"):
        mod.row_attention(2)


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16"])
def test_a_session_batched_natively_gets_what_it_gets_alone(attention, kv_dtype):
    m = _model()
    engine = Engine(m, KVStrategy("full", kv_dtype=kv_dtype), prefill_chunk=16)
    alone, batched, other = (engine.new_session_kv() for _ in range(3))
    engine.prefill(alone, _prompt(20))
    engine.prefill(batched, _prompt(20))
    engine.prefill(other, _prompt(33, seed=5))
    for tok in _prompt(10, seed=2):
        steps.decode_step(m, alone, tok, greedy=True)
        tasks = [steps.decode_step_task(m, batched, tok, greedy=True), steps.decode_step_task(m, other, tok + 1, greedy=True)]
        inputs = [t.send(None) for t in tasks]
        outs = steps.forward_batch(m, inputs)
        for t, o in zip(tasks, outs):
            with pytest.raises(StopIteration):
                t.send(o)
        assert torch.equal(alone.last_logits, batched.last_logits)


def test_the_engine_generates_the_same_tokens_with_and_without_it():
    m = _model(q4=False)
    engine = Engine(m, KVStrategy("full"), prefill_chunk=16)

    def run():
        evs = engine.generate(engine.new_session_kv(), _prompt(25), GenerateParams(max_tokens=20))
        return [e.token_id for e in evs if isinstance(e, TokenGenerated)]

    nat = m.native_step
    with_native = run()
    assert nat.steps >= 19
    m.native_step = None
    assert run() == with_native


def test_what_it_does_not_cover_declines():
    _module()
    fp32 = TorchCausalLM.load(tiny_model_dir("llama"))
    assert "fp32" in native.supports(fp32) and fp32.use_native_step() is False and fp32.native_step is None
    qwen3 = TorchCausalLM.load(tiny_model_dir("qwen3"), weights="int4")  # q/k norms
    assert native.supports(qwen3) is not None
    # a store that is not a plain fp32 or fp16 slab (int8 K/V) runs in Python: the step still works, natively 0 times
    m = _model()
    for kv_dtype, natively in (("int8", 0), ("fp16", 1)):
        engine = Engine(m, KVStrategy("full", kv_dtype=kv_dtype), prefill_chunk=16)
        kv = engine.new_session_kv()
        engine.prefill(kv, _prompt(40))
        before = m.native_step.steps
        steps.decode_step(m, kv, 5)
        assert m.native_step.steps == before + natively, kv_dtype
    # a paged session whose page store is coded (int8) recalls in kv/paged.py, its dense work in segments; with exact
    # fp32 pages (the default) its decode step is one whole-step call, recall included (csrc/paged_rows.h)
    for compressor, whole in (("int8", False), ("identity", True)):
        engine = Engine(m, KVStrategy("paged", 4, 12, page_size=4, recall_pages=2, page_compressor=compressor),
                        prefill_chunk=16)
        kv = engine.new_session_kv()
        engine.prefill(kv, _prompt(40))
        before, paged, segments = m.native_step.steps, m.native_step.paged_steps, m.native_step.segment_steps
        steps.decode_step(m, kv, 5)
        assert (m.native_step.steps - before, m.native_step.paged_steps - paged) == ((1, 1) if whole else (0, 0))
        assert m.native_step.segment_steps - segments == (0 if whole else 1)


def test_compile_auto_turns_it_on_on_the_cpu_and_off_keeps_python():
    _module()
    m = TorchCausalLM.load(tiny_model_dir("llama"), weights="int4")
    m.use_step_graphs("auto")
    assert m.native_step is not None and m.describe_step()["row_step"].startswith("native (C++)")
    m.use_step_graphs("off")
    assert m.native_step is None


def _q4_case(n=64, k=96, seed=0):
    from inference_engine.backends.torch.linear import Int4Linear

    g = torch.Generator().manual_seed(seed)
    lin = Int4Linear.from_float(torch.randn(n, k, generator=g) * 0.05)
    return lin, native.q4_pack(_module(), lin)


def test_the_q4_kernel_computes_the_int4_weights_within_int8_activation_rounding():
    mod = _module()
    if mod.q4_isa() == 0:
        pytest.skip("no AVX2 here: the native step keeps torch's int4 kernel")
    lin, packed = _q4_case()
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(1))
    want = x @ lin.dequantized().T
    got = mod.q4_matmul(x, packed)
    assert got.shape == want.shape
    # two planes of activations (~16 bits, the layers): within 0.2 % of the largest output; one (int8, the head's
    # approximate scoring): within 2 %
    assert (got - want).abs().max() <= 0.002 * want.abs().max()
    one = mod.q4_matmul(x, packed, 0, 1)
    assert (got - want).abs().max() * 2 < (one - want).abs().max() <= 0.02 * want.abs().max()
    # rows are independent: each row alone, and inside calls of other sizes, gives the same bits
    for i in range(7):
        assert torch.equal(mod.q4_matmul(x[i:i + 1].contiguous(), packed), got[i:i + 1])
    assert torch.equal(mod.q4_matmul(x[2:5].contiguous(), packed), got[2:5])
    # the AVX2 path gives the AVX-512 path's bits (where both run)
    if mod.q4_isa() == 2:
        assert torch.equal(mod.q4_matmul(x, packed, 1), got)
        assert torch.equal(mod.q4_matmul(x, packed, 1, 1), one)
    with pytest.raises(RuntimeError, match="inputs"):
        mod.q4_matmul(torch.randn(2, 64), packed)


def test_outlier_channels_are_taken_out_of_the_quantized_activations_and_added_exactly():
    """One plane with outlier channels (q4_matmul.h): the listed input channels are zeroed before the activations are
    quantized and added after their group as x[:, c] * w[:, c], w = fma(q, d, m) from the block's own codes; far
    closer to the int4 weights than one plane alone when those channels hold the large activations; rows stay
    independent; both ISAs agree; a bad list is a clear error."""
    mod = _module()
    if mod.q4_isa() == 0:
        pytest.skip("no AVX2 here: the native step keeps torch's int4 kernel")
    lin, packed = _q4_case()
    # the weights as the kernel decodes them: q * d + m with d, m as fp16, rounded once (an fma) to fp32
    n, k = lin.shape
    d = lin.scale.float()
    d16, m16 = d.half().double(), (lin.zero.float() - 8 * d).half().double()
    w = (lin.codes().double().view(n, k // 32, 32) * d16[..., None] + m16[..., None]).view(n, k).float()
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(2))
    channels = torch.tensor([3, 31, 40, 41, 90])  # inputs in groups 0, 0, 1, 1, 2, in every nibble position kind
    x[:, channels] *= 40.0  # massive activations in a few channels, as in real models
    got = mod.q4_matmul(x, packed, 0, 1, channels)
    # the documented computation in torch: one plane of x with the channels zeroed, plus the channels exactly
    rest = x.clone()
    rest[:, channels] = 0
    qx, scale, _ = _quantize_reference(rest, 1)
    deq = (qx[:, 0].float().view(7, -1, 32) * scale[..., None]).view(7, 96)
    want = deq @ w.T + x[:, channels] @ w[:, channels].T
    assert torch.allclose(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))
    exact = x @ w.T
    one = mod.q4_matmul(x, packed, 0, 1)
    err_out, err_one = float((got - exact).abs().max()), float((one - exact).abs().max())
    assert err_out * 10 < err_one, (err_out, err_one)
    for i in range(7):
        assert torch.equal(mod.q4_matmul(x[i:i + 1].contiguous(), packed, 0, 1, channels), got[i:i + 1])
    if mod.q4_isa() == 2:
        assert torch.equal(mod.q4_matmul(x, packed, 1, 1, channels), got)
    for bad in ([5, 3], [3, 3], [96], [-1]):
        with pytest.raises(RuntimeError, match="ascending input indices"):
            mod.q4_matmul(x, packed, 0, 1, torch.tensor(bad))


def test_a_one_row_tile_in_registers_gives_the_bits_of_the_general_tile():
    """q4_matmul.h tile_avx2<P, 1> (a decode row's sums in registers) against the general tile (q4_row_registers 0):
    the same float operations in the same order, so the same bits, with two planes, one, and outlier channels."""
    mod = _module()
    if mod.q4_isa() == 0:
        pytest.skip("no AVX2 here: the native step keeps torch's int4 kernel")
    lin, packed = _q4_case()
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(3))
    channels = torch.tensor([5, 33, 70])
    cases = [(0, 2, None), (0, 1, None), (0, 1, channels)] + ([(1, 2, None), (1, 1, channels)] if mod.q4_isa() == 2 else [])
    was = mod.q4_row_registers()
    try:
        for isa, planes, ch in cases:
            mod.q4_row_registers(1)
            fast = mod.q4_matmul(x, packed, isa, planes, ch)
            mod.q4_row_registers(0)
            assert torch.equal(mod.q4_matmul(x, packed, isa, planes, ch), fast)
    finally:
        mod.q4_row_registers(was)


def test_outlier_channels_are_each_linears_largest_activations_and_the_step_stays_row_exact():
    """native.outlier_channels runs the Python pieces over seeded random ids (the same channels every time) and leaves
    the model as it was; the native step with them keeps verify blocks equal to one-token steps."""
    _module()
    m = TorchCausalLM.load(tiny_model_dir("llama"), weights="int4")
    before = [tuple(getattr(L, k) for k in native.LINEAR_KINDS) for L in m.layers]
    chosen = native.outlier_channels(m, 8, tokens=64)
    assert [tuple(getattr(L, k) for k in native.LINEAR_KINDS) for L in m.layers] == before
    assert set(chosen) == {(i, k) for i in range(len(m.layers)) for k in native.LINEAR_KINDS}
    for ch in chosen.values():
        assert ch.dtype == torch.int64 and ch.numel() == 8 and torch.equal(ch, ch.sort().values)
    assert native.outlier_channels(m, 8, tokens=64).keys() == chosen.keys()
    assert all(torch.equal(a, b) for a, b in zip(native.outlier_channels(m, 8, tokens=64).values(), chosen.values()))
    if m.use_native_step(planes=1, outliers=8) is not True or m.native_step.outliers != 8:
        pytest.skip("no AVX2 here: the native step keeps torch's int4 kernel")
    engine = Engine(m, KVStrategy("full"), prefill_chunk=16)
    a, b, c = engine.new_session_kv(), engine.new_session_kv(), engine.new_session_kv()
    for kv in (a, b, c):
        engine.prefill(kv, _prompt(30))
    steps.decode_step(m, b, 17)
    drafts = [int(b.last_logits.argmax())]
    one_step = b.last_logits.clone()
    steps.decode_step(m, b, drafts[0])
    res = steps.verify_block(m, a, 17, drafts, SamplingParams(), None, budget=4)
    assert res.accepted == 1 and torch.equal(a.last_logits, b.last_logits)
    assert m.use_native_step(planes=1, outliers=0) is True  # one plane without them: other logits (the channels reach the kernel)
    steps.decode_step(m, c, 17)
    assert not torch.equal(c.last_logits, one_step)


def test_the_native_greedy_head_is_the_refined_heads_greedy_path_in_one_call():
    """csrc/row_step.cpp refined_head (what RefinedHead's greedy path calls with the native step on): the int4 kernel's
    one-plane scores, each row's top `refine` of them recomputed exactly in fp32; so the argmax is the fp32 head's,
    the refined logits are fp32 dot products, every other logit is the kernel's score bit for bit, and rows are
    row-exact (alone, or in calls of other sizes)."""
    from inference_engine.backends.torch.linear import RefinedHead

    mod = _module()
    if mod.q4_isa() == 0:
        pytest.skip("no AVX2 here: the greedy head keeps its Python path")
    g = torch.Generator().manual_seed(3)
    head = RefinedHead(torch.randn(4000, 64, generator=g) * 0.2, refine=8, greedy_refine=32)
    packed = native.q4_pack(mod, head.greedy_approx)
    x = torch.randn(9, 64, generator=g)
    got = mod.refined_head(x, packed, head.w, 32)
    scores, exact = mod.q4_matmul(x, packed, 0, 1), x @ head.w.T
    changed = got != scores
    assert (changed.sum(-1) <= 32).all() and changed.any(-1).all()
    top = scores.topk(32, -1).indices
    torch.testing.assert_close(got.gather(-1, top), exact.gather(-1, top), rtol=1e-5, atol=1e-5)  # the 32 refined
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    assert torch.equal(got[~changed], scores[~changed])  # the rest: the kernel's scores
    for i in range(9):
        assert torch.equal(mod.refined_head(x[i:i + 1].contiguous(), packed, head.w, 32), got[i:i + 1])
    assert torch.equal(mod.refined_head(x[3:7].contiguous(), packed, head.w, 32), got[3:7])
    # the Python path's scores, its choice (torch.topk) and its einsum give the same argmax and candidates
    head.greedy_kernel = None
    python = head(x, greedy=True) if head.greedy_approx is not None else None
    assert python is not None and torch.equal(python.argmax(-1), got.argmax(-1))
    with pytest.raises(RuntimeError, match="must hold the head's 10 columns"):
        mod.refined_head(x, packed, head.w[:10], 32)
    with pytest.raises(RuntimeError, match="fp32 rows"):
        mod.refined_head(x, packed, head.w.double(), 32)


def test_the_native_sampled_head_scores_the_head_and_its_residual_more_exactly_than_the_int8_path():
    """RefinedHead's sampled path with the native step (RefinedHead.kernel: refined_head over the head's 4-bit copy, two
    activation planes, and the 4-bit residual of what that copy leaves, one, summed): its logits (used whole by sampling,
    not only the argmax) are nearer the fp32 head's than the int8 kernel's with bf16 activations that it replaces;
    its top `refine` are exact; rows are row-exact; and without the native step the Python path runs."""
    from inference_engine.backends.torch.linear import RefinedHead

    mod = _module()
    if mod.q4_isa() == 0:
        pytest.skip("no AVX2 here: the head keeps its Python path")
    g = torch.Generator().manual_seed(4)
    w = torch.randn(4000, 64, generator=g) * 0.2
    head = RefinedHead(w, refine=8, greedy_refine=32)
    x = torch.randn(9, 64, generator=g) * 2
    python = head(x)
    both = torch.cat([native.q4_pack(mod, head.greedy_approx), native.q4_pack_residual(mod, head.w, head.greedy_approx)])
    got = mod.refined_head(x, both, head.w, 8, 2)
    exact = x @ head.w.T
    top = got.topk(8, -1).indices
    torch.testing.assert_close(got.gather(-1, top), exact.gather(-1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    err, err_int8 = (got - exact).abs(), (python - exact).abs()
    # random weights: ~25 % nearer (SmolLM2's head, outliers and all: ~2x, scripts/research/sampled_head.py)
    assert err.max() < 0.9 * err_int8.max() and err.mean() < 0.9 * err_int8.mean()
    # the two parts are what makes it ~8-bit: the copy alone is far coarser
    alone = mod.q4_matmul(x, both[: 4000 // 16].contiguous(), 0, 2)
    assert (alone - exact).abs().mean() > 4 * err.mean()
    for i in range(0, 9, 4):
        assert torch.equal(mod.refined_head(x[i:i + 1].contiguous(), both, head.w, 8, 2), got[i:i + 1])
    with pytest.raises(RuntimeError, match="columns"):
        mod.refined_head(x, both[:100].contiguous(), head.w, 8, 2)
    # a model's native step sets both paths' kernels, and turning it off drops both (the Python paths run again)
    m = _model()
    assert m.head.kernel is not None and m.head.greedy_kernel is not None
    m.use_native_step(False)
    assert m.head.kernel is None and m.head.greedy_kernel is None


def _quantize_reference(x: torch.Tensor, planes: int):
    """The activation quantization q4_matmul.h documents, in torch: per row and group of 32, t = x * (127 / amax),
    qx1 = round half to even, clamped to +-127; qx2 = the same of (t - qx1) * 256; scale and scale * sum(256 qx1 + qx2)."""
    g = x.reshape(x.size(0), -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    t = g * inv
    q1 = torch.round(t).clamp(-127, 127)
    whole, qs = q1.to(torch.int64), [q1]
    if planes == 2:
        q2 = torch.round((t - q1) * 256.0).clamp(-127, 127)
        qs.append(q2)
        whole = whole * 256 + q2.to(torch.int64)
    scale = amax[..., 0] / 127.0 / (256.0 if planes == 2 else 1.0)
    qx = torch.stack([q.reshape(x.shape) for q in qs], 1).to(torch.int8)
    return qx, scale, scale * whole.sum(-1).to(torch.float32)


@pytest.mark.parametrize("planes", [1, 2])
def test_the_kernels_activation_quantization_is_the_documented_one_bit_for_bit(planes):
    mod = _module()
    if mod.q4_isa() == 0:
        pytest.skip("no AVX2 here: the native step keeps torch's int4 kernel")
    gen = torch.Generator().manual_seed(planes)
    x = torch.randn(5, 1536, generator=gen) * torch.logspace(-3, 2, 1536)[torch.randperm(1536, generator=gen)]
    x[1, 32:64] = 0.0  # a group of zeros: scale 0, codes 0
    # ties (amax 127, so t = x): round half to even in the first plane (+-0.5, 1.5, -2.5) and the second (k / 512)
    x[2, 64:96] = torch.tensor([127.0, 0.5, -0.5, 1.5, -2.5, 1 / 512, 3 / 512, -5 / 512] * 4)
    x[3, 0] = 1e30  # one huge value: the rest of its group rounds to 0 or +-1
    want = _quantize_reference(x, planes)
    got = mod.q4_quantize(x, planes)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_native_decode_with_the_q4_kernel_stays_close_to_the_python_pieces():
    m = _model()
    assert m.native_step.q4
    nat = m.native_step
    engine = Engine(m, KVStrategy("full"), prefill_chunk=16)
    kvs = [engine.new_session_kv() for _ in range(2)]
    for kv in kvs:
        engine.prefill(kv, _prompt(40))
    agree = 0
    for tok in _prompt(30, seed=1):  # teacher-forced: both fed the same tokens
        m.native_step = nat
        steps.decode_step(m, kvs[0], tok)
        m.native_step = None
        steps.decode_step(m, kvs[1], tok)
        a, b = kvs[0].last_logits, kvs[1].last_logits
        # other activation rounding than torch's bf16 (SmolLM2's agreement with fp32: scripts/research/native_step.py)
        assert (a - b).abs().max() <= 0.1 * b.abs().max(), (a - b).abs().max()
        agree += int(a.argmax()) == int(b.argmax())
    assert agree >= 25, agree


def test_long_rows_split_into_chunks_stay_exact_across_blocks_and_threads(attention):
    """Past 256 columns a row's attention runs in fixed chunks of columns, shared among threads and merged in order:
    a verify block still equals one-token steps, and the thread count does not change a bit."""
    m = _model()
    engine = Engine(m, KVStrategy("full"), prefill_chunk=128)
    a, b, c = (engine.new_session_kv() for _ in range(3))
    for kv in (a, b, c):
        engine.prefill(kv, _prompt(600, seed=3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        steps.decode_step(m, c, 11)
        torch.set_num_threads(2)
        steps.decode_step(m, b, 11)
        assert torch.equal(b.last_logits, c.last_logits)
        drafts = [int(b.last_logits.argmax())]
        steps.decode_step(m, b, drafts[0])
        res = steps.verify_block(m, a, 11, drafts, SamplingParams(), None, budget=4)
        assert res.accepted == 1 and torch.equal(a.last_logits, b.last_logits)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("prefill_native", [True, False], ids=["chunk-native", "chunk-python"])
def test_a_decode_row_sharing_its_forward_with_a_prefill_chunk_still_runs_natively(prefill_native):
    """The engine loop puts a prefill chunk and other sessions' decode rows in one forward: the decode rows still take
    the native step (so a session's tokens do not depend on what else is in flight), the chunk with them (one call)
    or, with the step's prefill off, through the Python pieces."""
    m = _model()
    m.native_step.prefill = prefill_native
    assert m.row_step_takes_prefill is prefill_native
    engine = Engine(m, KVStrategy("full"), prefill_chunk=16)
    alone, batched, other = (engine.new_session_kv() for _ in range(3))
    engine.prefill(alone, _prompt(20))
    engine.prefill(batched, _prompt(20))
    for i, tok in enumerate(_prompt(6, seed=4)):
        steps.decode_step(m, alone, tok, greedy=True)
        before = m.native_step.steps
        tasks = [steps.decode_step_task(m, batched, tok, greedy=True),
                 steps.prefill_chunk_task(m, other, _prompt(12, seed=10 + i))]
        outs = steps.forward_batch(m, [t.send(None) for t in tasks])
        for t, o in zip(tasks, outs):
            with pytest.raises(StopIteration):
                t.send(o)
        assert m.native_step.steps == before + 1
        assert torch.equal(alone.last_logits, batched.last_logits)
    assert other.cache.next_position == 72


@pytest.mark.parametrize("strategy", STRATEGIES, ids=_sid)
def test_a_prompt_prefilled_natively_writes_what_decoding_it_token_by_token_writes(strategy, attention):
    """Prefill chunks take the native step (model.row_step_takes_prefill): their rows attend as one-token steps, so
    however a prompt is chunked (within one cache geometry: sink_window's ring is sized by the engine's prefill
    chunk), its K/V and the logits after it are bit for bit those of feeding it one token at a time - past
    sink_window's ring too."""
    m = _model()
    assert m.row_step_takes_prefill
    prompt = _prompt(45, seed=7)
    engine = Engine(m, strategy, prefill_chunk=16)

    def fed(piece):
        kv = engine.new_session_kv()
        before = m.native_step.steps
        for i in range(0, len(prompt), piece):
            if piece == 1:
                steps.decode_step(m, kv, prompt[i])
            else:
                steps.prefill_chunk(m, kv, prompt[i:i + piece])
        assert m.native_step.steps - before == -(-len(prompt) // piece)  # every chunk ran natively
        return kv

    one = fed(1)
    for piece in (16, 7):
        kv = fed(piece)
        assert torch.equal(kv.last_logits, one.last_logits), piece
        assert np.array_equal(kv.cache.store.pos, one.cache.store.pos)
        for layer in range(m.spec.num_layers):
            assert torch.equal(kv.cache.store.k[layer], one.cache.store.k[layer])
            assert torch.equal(kv.cache.store.v[layer], one.cache.store.v[layer])


def test_a_prefill_chunk_longer_than_a_row_block_stays_exact():
    """The step attends in blocks of 64 rows (csrc/row_step.cpp kRowBlock): a 150-token chunk spans three, and its rows
    still equal one-token steps bit for bit."""
    m = _model()
    prompt = _prompt(150, seed=3)
    engine = Engine(m, KVStrategy("full"), prefill_chunk=150)
    whole, one = engine.new_session_kv(), engine.new_session_kv()
    steps.prefill_chunk(m, whole, prompt)
    for tok in prompt:
        steps.decode_step(m, one, tok)
    assert torch.equal(whole.last_logits, one.last_logits)
    for layer in range(m.spec.num_layers):
        assert torch.equal(whole.cache.store.k[layer], one.cache.store.k[layer])
        assert torch.equal(whole.cache.store.v[layer], one.cache.store.v[layer])


def test_the_kernels_prefetch_distance_never_changes_a_bit():
    """A matrix large enough that every distance prefetches (a thread's range is far longer than 2 KB): the bits are
    those of no prefetch at all."""
    mod = _module()
    g = torch.Generator().manual_seed(0)
    n, k = 1024, 1024  # 64 column blocks x 32 groups x 320 bytes: 20 KB a block
    packed = mod.q4_pack(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
                         torch.rand(n, k // 32, generator=g) * 0.01, torch.randn(n, k // 32, generator=g) * 0.01)
    x = torch.randn(5, k, generator=g)
    default = mod.q4_prefetch()
    assert default == 2048
    try:
        outs = []
        for ahead in (0, 64, default, 8192):
            mod.q4_prefetch(ahead)
            assert mod.q4_prefetch() == ahead
            outs.append(mod.q4_matmul(x, packed))
        assert all(torch.equal(o, outs[0]) for o in outs)
    finally:
        mod.q4_prefetch(default)


def test_a_one_row_call_in_one_pass_and_the_next_blocks_prefetch_keep_every_bit():
    """The AVX2 kernel's one-row call in one pass over each block (both halves group by group: q4_one_pass_row 1, the
    default) against two passes (0), and the second pass's prefetch of the next block (q4_prefetch_next 1, the default)
    against none: the same bits, with two planes, one, and outlier channels, for one row and five."""
    mod = _module()
    if mod.q4_isa() == 0:
        pytest.skip("no AVX2 here: the native step keeps torch's int4 kernel")
    g = torch.Generator().manual_seed(1)
    n, k = 512, 1024  # 32 column blocks: a thread's range has a next block to prefetch
    packed = mod.q4_pack(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
                         torch.rand(n, k // 32, generator=g) * 0.01, torch.randn(n, k // 32, generator=g) * 0.01)
    channels = torch.tensor([5, 33, 70, 700])
    was = mod.q4_one_pass_row(-1), mod.q4_prefetch_next(-1)
    try:
        for rows in (1, 5):
            x = torch.randn(rows, k, generator=g)
            for planes, ch in ((2, None), (1, None), (1, channels)):
                outs = []
                for one_pass, nxt in ((1, 1), (0, 1), (0, 0), (1, 0)):
                    mod.q4_one_pass_row(one_pass)
                    mod.q4_prefetch_next(nxt)
                    outs.append(mod.q4_matmul(x, packed, 1, planes, ch))
                assert all(torch.equal(o, outs[0]) for o in outs), (rows, planes, ch)
    finally:
        mod.q4_one_pass_row(was[0])
        mod.q4_prefetch_next(was[1])


def test_the_avx512_kernels_row_tiles_keep_every_bit_and_every_row_its_own():
    """The AVX-512 kernel's rows in tiles of a fixed count (q4_vnni_tiles 1, the default: sums in registers, the rows'
    dot chains interleaved, a chain split by chunk parity under 4 rows) against the runtime loop of one chain per row
    (0): the same bits for every count of rows 1..17 (every tile size, and tiles after a full one), with two planes,
    one, and outlier channels; and each row equals its own one-row call."""
    mod = _module()
    if mod.q4_isa() != 2:
        pytest.skip("no AVX-512 VNNI here: the tiles are the AVX-512 path's")
    g = torch.Generator().manual_seed(2)
    n, k = 64, 256
    packed = mod.q4_pack(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
                         torch.rand(n, k // 32, generator=g) * 0.01, torch.randn(n, k // 32, generator=g) * 0.01)
    x = torch.randn(17, k, generator=g) * torch.rand(1, k, generator=g) * 4
    channels = torch.tensor([5, 33, 70, 200])
    was = mod.q4_vnni_tiles(-1)
    try:
        for rows in range(1, 18):
            for planes, ch in ((2, None), (1, None), (1, channels), (2, channels)):
                mod.q4_vnni_tiles(1)
                tiles = mod.q4_matmul(x[:rows], packed, 2, planes, ch)
                alone = [mod.q4_matmul(x[r:r + 1], packed, 2, planes, ch) for r in range(rows)]
                mod.q4_vnni_tiles(0)
                assert torch.equal(mod.q4_matmul(x[:rows], packed, 2, planes, ch), tiles), (rows, planes, ch)
                assert all(torch.equal(a, tiles[r:r + 1]) for r, a in enumerate(alone)), (rows, planes, ch)
    finally:
        mod.q4_vnni_tiles(was)


@pytest.mark.parametrize("query", ["int8", "fp32"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("groups", [1, 2, 3, 4, 5])
def test_every_key_scores_the_same_bits_in_a_batch_as_alone(bits, groups, query):
    """The compact keys' scoring sums eight keys' dots at once (csrc key_dots8 / score_keys_q8) and, with the fp32
    query, the rest one or two at a time: each key's score must not depend on which of those it fell in, nor on its
    place in the call. With the int8 query (the default) the kernel gives the float path's bits."""
    from inference_engine.kv.paged_store import RowQuant, query_int8

    mod = _module()
    if query == "fp32":
        mod.score_q8(0)
        try:
            _scores_alone_and_batched(mod, RowQuant, bits, groups, query)
        finally:
            mod.score_q8(1)
        return
    assert query_int8() and mod.score_q8() == 1
    _scores_alone_and_batched(mod, RowQuant, bits, groups, query)


def _scores_alone_and_batched(mod, RowQuant, bits, groups, query):
    g = torch.Generator().manual_seed(bits * 10 + groups)
    rq = RowQuant(bits, 64)
    n = 8 * 5 + 3  # whole blocks of eight, then a pair and one
    pay = rq.encode(torch.randn(2 * n, 64, generator=g))
    codes, scale = pay["codes"].reshape(2, n, -1), pay["scale"].reshape(2, n, 1)
    q = torch.randn(2, groups, 3, 64, generator=g)  # (B, G, M, D)
    batch = mod.group_max_scores(q, codes, scale)
    assert batch.shape == (2, 3, n)
    for c in range(n):
        alone = mod.group_max_scores(q, codes[:, c:c + 1].contiguous(), scale[:, c:c + 1].contiguous())
        assert torch.equal(alone[..., 0], batch[..., c]), c
    for start in (1, 5, 11):  # shifted, so other keys make the blocks of eight
        shifted = mod.group_max_scores(q, codes[:, start:].contiguous(), scale[:, start:].contiguous())
        assert torch.equal(shifted, batch[..., start:])
    assert mod.score_eight() == 1
    try:  # research scripts time the one- or two-at-a-time sums: the same bits
        mod.score_eight(0)
        assert torch.equal(mod.group_max_scores(q, codes, scale), batch)
    finally:
        mod.score_eight(1)
    if query == "int8":
        assert torch.equal(batch, rq.group_max_scores(q, codes, scale, path="float"))
        assert mod.score_keys_avx512() == 1
        try:  # the AVX2 code where an AVX-512 VNNI build takes two keys a vector: the same bits
            mod.score_keys_avx512(0)
            assert torch.equal(mod.group_max_scores(q, codes, scale), batch)
        finally:
            mod.score_keys_avx512(1)
        return
    want = (q @ rq.decode(pay).reshape(2, 1, n, 64).transpose(-1, -2)).amax(1)  # the decoded keys' scores
    torch.testing.assert_close(batch, want, rtol=1e-4, atol=1e-3)


def test_per_matrix_activation_planes():
    """planes per matrix kind (wqkv, wo, w_gate_up, w_down): each choice runs through the native step and reaches the
    kernel (a mixed choice's logits differ from all-two's), and a bad spec is a clear error."""
    _module()
    m = TorchCausalLM.load(tiny_model_dir("llama"), weights="int4")
    engine = Engine(m, KVStrategy("full"), prefill_chunk=16)
    logits = {}
    for planes in (2, 1, (1, 1, 1, 2)):
        assert m.use_native_step(planes=planes) is True
        kv = engine.new_session_kv()
        engine.prefill(kv, _prompt(30))
        steps.decode_step(m, kv, 17)
        logits[planes] = kv.last_logits
    assert not torch.equal(logits[1], logits[2]) and not torch.equal(logits[(1, 1, 1, 2)], logits[2])
    with pytest.raises(ValueError, match="planes must be"):
        m.use_native_step(planes=(1, 2))


def test_one_activation_plane_without_outliers_still_runs_exact_verify_blocks():
    _module()
    m = TorchCausalLM.load(tiny_model_dir("llama"), weights="int4")
    assert m.use_native_step(planes=1, outliers=0) is True
    engine = Engine(m, KVStrategy("full"), prefill_chunk=16)
    a, b = engine.new_session_kv(), engine.new_session_kv()
    for kv in (a, b):
        engine.prefill(kv, _prompt(30))
    steps.decode_step(m, b, 17)
    drafts = [int(b.last_logits.argmax())]
    steps.decode_step(m, b, drafts[0])
    res = steps.verify_block(m, a, 17, drafts, SamplingParams(), None, budget=4)
    assert res.accepted == 1 and torch.equal(a.last_logits, b.last_logits)


def test_compile_auto_keeps_it_only_where_it_measures_faster():
    from inference_engine.engine.tuning import native_step_pays

    m = _model()
    nat = m.native_step
    before = nat.steps
    pays, med = native_step_pays(m, threads=1, timed_steps=3)
    assert isinstance(pays, bool) and set(med) == {"native", "python"} and all(v > 0 for v in med.values())
    assert m.native_step is nat and nat.steps - before == 6  # its prefill and 5 decode steps; the model is left as it was
    m.use_native_step(False)
    assert native_step_pays(m) == (False, {})


def test_compile_auto_keeps_a_decisive_measurement_for_the_next_start(tmp_path, monkeypatch, caplog):
    """native.keep_verdict / kept_verdict: a measurement with the native step at most VERDICT_MARGIN of the Python
    pieces is kept next to the model for this build, thread count and activations, and the next build_engine takes
    it without measuring; a close one is never kept (every start measures)."""
    import logging
    import shutil

    from inference_engine.engine import tuning
    from inference_engine.server.app import build_engine
    from inference_engine.server.config import ServeConfig

    require_native()
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), d, ignore=shutil.ignore_patterns(".kakeya-*"))
    m = TorchCausalLM.load(d, weights="int4")
    assert m.use_native_step()
    assert not native.keep_verdict(m, 1, {"native": 0.6, "python": 1.0}) and native.kept_verdict(m, 1) is None
    assert native.keep_verdict(m, 1, {"native": 0.2, "python": 1.0})
    assert native.kept_verdict(m, 1) == {"native": 0.2, "python": 1.0} and native.kept_verdict(m, 2) is None
    m.native_step.outliers += 1  # other activations: measured again
    assert native.kept_verdict(m, 1) is None
    m.native_step.outliers -= 1
    monkeypatch.setattr(tuning, "native_step_pays", lambda *a, **k: pytest.fail("measured although a verdict was kept"))
    with caplog.at_level(logging.INFO, logger="kakeya"):
        build_engine(ServeConfig(model=str(d), threads=1, compile="auto"), m)
    assert m.native_step is not None and "measured at an earlier start" in caplog.text


# -- the steps the whole-step call declines: paged recall (kv/paged.py chooses keys per query and layer) runs the same
# C++ code in segments (native.NativeSegments), attention left to the kv layer

PAGED = KVStrategy("paged", 4, 12, page_size=4, recall_pages=2)


def _cache(m, strategy, max_step):
    return make_cache(strategy, m.geometry(), max_step=max_step, max_context=m.spec.max_context)


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_a_paged_session_runs_its_dense_work_in_native_segments(weights):
    """With torch's kernels inside (q4 off) the native step computes what the Python pieces do, to the kernels'
    rounding. A prefill chunk that recalls pages runs in segments (its keys chosen per query in kv/paged.py); a decode
    step, whether it recalls (its recall then in C++) or not (as sink_window's steps), is one whole-step call."""
    m = _model(weights, q4=False)
    nat = m.native_step
    engine = Engine(m, PAGED, prefill_chunk=16)
    kvs = [engine.new_session_kv() for _ in range(2)]
    steps0, segs0 = nat.steps, nat.segment_steps
    m.native_step = nat
    engine.prefill(kvs[0], _prompt(40))
    m.native_step = None
    engine.prefill(kvs[1], _prompt(40))
    # 40 tokens in chunks of 16: the first recalls nothing (no key out of any query's window: one whole-step call),
    # the other two recall pages (segments)
    assert (nat.steps - steps0, nat.segment_steps - segs0) == (1, 2)
    _decode_both(m, nat, kvs, _prompt(20, seed=1))
    # the 20 decode steps recall pages: each one whole-step call, its recall in C++ (csrc/paged_rows.h)
    assert nat.steps - steps0 == 21 and nat.paged_steps >= 20 and nat.segment_steps - segs0 == 2
    assert kvs[0].cache.pages.rows == kvs[1].cache.pages.rows > 0  # pages were archived, and recalled from
    for layer in range(m.spec.num_layers):  # the same bf16 rounding flips as the logits (_decode_both): one element
        # of a key can move by a bf16 step of an input times its weights (seen: 0.0145 once, int8)
        assert torch.allclose(kvs[0].cache.store.k[layer], kvs[1].cache.store.k[layer], atol=5e-2)


# shortlist_pages 3 past 4 candidate pages, one page of RAM (the rest of the page store and, once the shortlist
# applies, of the compact keys spilled to disk): every branch of the native recall (csrc/paged_rows.h)
SHORTLISTED = KVStrategy("paged", 4, 12, page_size=4, recall_pages=2, shortlist_pages=3, shortlist_from=4,
                         page_ram_mb=1e-6)
# the same with fp16 K/V (--kv-dtype fp16): the slab and the page store hold fp16 rows, read by the native recall as the
# AVX2 attention reads fp16 slabs
SHORTLISTED_FP16 = dataclasses.replace(SHORTLISTED, kv_dtype="fp16")
# past far_from the chosen pages at their gaps scaled down ("spread"), not packed next to the window
SPREAD = KVStrategy("paged", 4, 12, page_size=4, recall_pages=2, far_from=40, far_layout="spread")
# past the trained context a query chooses its pages at every third position only (--page-choice-every 3)
CHOICE3 = dataclasses.replace(SHORTLISTED, choice_every=3)


@pytest.mark.parametrize("strategy", [KVStrategy("paged", 4, 12, page_size=8, recall_pages=2), SHORTLISTED,
                                      SHORTLISTED_FP16, SPREAD, dataclasses.replace(SHORTLISTED, far_layout="spread"),
                                      CHOICE3, KVStrategy("paged", 4, 12, page_size=8, recall_pages=2, choice_every=4)],
                         ids=["exact", "shortlisted-spilled", "shortlisted-spilled-fp16", "spread", "shortlisted-spread",
                              "shortlisted-choice-every-3", "exact-choice-every-4"])
def test_native_segments_keep_paged_verify_blocks_equal_to_one_token_steps_past_the_context(strategy):
    """Row-exactness holds through the segments (row-independent kernels, the native recall's rows each on their
    own): verify blocks of 5 give one-token steps' logits bit for bit, below the trained context (64 here) and past it
    (InfLLM's layout), with the pages chosen among every candidate or through the bounds' shortlist and read from
    RAM or the spill file; so do a prefill chunk's rows."""
    _module()
    m = TorchCausalLM.load(tiny_model_dir("llama", max_position_embeddings=64), weights="int4")
    assert m.use_native_step() is True
    history = _prompt(160, seed=3)
    runs = {}
    for name, chunk, row_exact in (("chunks", 16, False), ("verify", 5, True), ("steps", 1, True)):
        cache = _cache(m, strategy, 16)
        before = m.native_step.segment_steps + m.native_step.paged_steps
        out = []
        for i in range(0, 160, chunk):
            part = history[i:i + chunk]
            logits, _ = steps.forward(m, m.tensor(part), range(i, i + len(part)), cache, row_exact=row_exact)
            cache.commit()
            out.append(logits)
        runs[name] = torch.cat(out)
        recalling = -(-(160 - 16) // chunk)  # steps from position 16 on (sink 4 + window 12) recall pages
        # in segments (a prefill chunk, a verify block: some of its rows' candidates still resident) or, for a
        # one-token step, one whole-step call
        assert m.native_step.segment_steps + m.native_step.paged_steps - before == recalling
    assert torch.equal(runs["verify"], runs["steps"])
    # a prefill chunk's rows recall natively too, each as the one-token step at its position (row-independent dense
    # kernels, each row's own choice and attention): bit for bit, so a prompt's K/V is what decoding it writes (INV-3)
    assert torch.equal(runs["chunks"], runs["steps"])


@pytest.mark.parametrize("strategy", [SHORTLISTED, SHORTLISTED_FP16], ids=["shortlisted-spilled", "shortlisted-spilled-fp16"])
def test_a_prefill_chunk_ranks_its_own_pages_by_bounds_made_once_with_the_same_bits(strategy):
    """The whole pages past the bounds table (those a prefill chunk completes, ranked by each of its later rows) get
    their bounds made once a layer (csrc/paged_rows.h MadeBounds) instead of by every row that ranks them: the same
    bits as each row making its own (made_bounds 0) and as one-token steps."""
    mod = _module()
    m = TorchCausalLM.load(tiny_model_dir("llama", max_position_embeddings=64), weights="int4")
    assert m.use_native_step() is True
    history = _prompt(160, seed=4)
    runs = {}
    was = mod.made_bounds(-1)
    try:
        for name, chunk, made in (("made", 16, 1), ("per-row", 16, 0), ("steps", 1, 1)):
            mod.made_bounds(made)
            cache = _cache(m, strategy, 16)
            out = []
            for i in range(0, 160, chunk):
                part = history[i:i + chunk]
                logits, _ = steps.forward(m, m.tensor(part), range(i, i + len(part)), cache, row_exact=chunk == 1)
                cache.commit()
                out.append(logits)
            assert cache.shortlisting and cache.far_active  # the shortlist ranks pages, past the context too
            runs[name] = torch.cat(out)
    finally:
        mod.made_bounds(was)
    assert torch.equal(runs["made"], runs["per-row"])
    assert torch.equal(runs["made"], runs["steps"])


@pytest.mark.parametrize("strategy", [KVStrategy("paged", 4, 12, page_size=4, recall_pages=2), SHORTLISTED,
                                      KVStrategy("paged", 4, 12, page_size=4, recall_pages=2, kv_dtype="fp16"),
                                      SHORTLISTED_FP16, SPREAD, dataclasses.replace(SHORTLISTED_FP16, far_layout="spread"),
                                      CHOICE3],
                         ids=["exact", "shortlisted-spilled", "exact-fp16", "shortlisted-spilled-fp16", "spread",
                              "shortlisted-spilled-fp16-spread", "shortlisted-choice-every-3"])
def test_native_recall_chooses_and_attends_as_the_python_path(strategy, monkeypatch):
    """Each layer's native recall of row-exact rows (page choice, reads from either tier, attention) against the kv
    layer's Python path on the same queries and tables: decode steps and verify blocks (whose later rows' candidates
    are still resident), below the trained context (64) and past it. The same pages are chosen (a different page moves
    the output by far more than float rounding)."""
    from inference_engine.kv.paged import PagedCache

    _module()
    m = TorchCausalLM.load(tiny_model_dir("llama", max_position_embeddings=64), weights="int4")
    assert m.use_native_step() is True
    native_attend = PagedCache._native_attend
    seen = {"rows": 0, "far": 0, "fresh": 0, "spilled": 0, "shortlist": 0, "choice": 0, "crossing": 0}
    scale = m.spec.attn_scale if m.spec.attn_scale is not None else m.spec.head_dim ** -0.5

    def checked(self, layer, q, k_all, v_all, layout, plan):
        o = native_attend(self, layer, q, k_all, v_all, layout, plan)
        assert o is not None
        native_choice = None if plan["choice_out"] is None else plan["choice_out"][layer].clone()
        idx, _ = self._choose_pages(layer, q, k_all, plan, None)
        if native_choice is not None:  # choice_every: the pages each row took, as the commit keeps them, alike
            assert torch.equal(native_choice, plan["choice_out"][layer])
            seen["choice"] += 1
        ref = self._attend_rows(layer, q, k_all, v_all, layout, plan, None, idx, scale, 0.0, 0.0, m.rotate_keys)
        # every row, also in steps across the context or across shortlist_from: both paths choose per row, as the
        # one-token step at its position does
        torch.testing.assert_close(o, ref, rtol=0, atol=2e-5)
        seen["rows"] += q.shape[1]
        seen["crossing"] += int(plan["far"] == "some")
        seen["far"] += int(layout.last_position >= self.max_context)
        seen["fresh"] += int(plan["cols"] is not None)
        seen["spilled"] += int(self.pages.cold_pages > 0)
        seen["shortlist"] += int(bool(self.shortlist) and plan["n_pages"] > self.shortlist_from)
        return o

    monkeypatch.setattr(PagedCache, "_native_attend", checked)
    history = _prompt(140, seed=6)
    cache = _cache(m, strategy, 16)
    at = 0
    for chunk in [16, 2] + [1, 5] * 18:  # the block at 61 crosses the context
        part = history[at:at + chunk]
        steps.forward(m, m.tensor(part), range(at, at + len(part)), cache, row_exact=chunk < 16)
        cache.commit()
        at += len(part)
    assert seen["rows"] > 0 and seen["far"] > 0 and seen["fresh"] > 0 and seen["crossing"] > 0
    if strategy.shortlist_from == SHORTLISTED.shortlist_from:
        assert seen["spilled"] > 0 and seen["shortlist"] > 0
    assert (seen["choice"] > 0) == (strategy.choice_every > 1)
    # fp16 K/V: the slab and the page store (both tiers) hold fp16 rows
    want = torch.float16 if strategy.kv_dtype == "fp16" else torch.float32
    assert cache.store.k[0].dtype == cache.pages.codec.dtype == want


def test_paged_recalling_every_page_in_segments_gives_what_full_gives_in_one_call():
    m = _model()
    history = _prompt(90, seed=4)
    outs = {}
    for name, strategy in (("full", KVStrategy("full")), ("paged", KVStrategy("paged", 4, 12, page_size=8,
                                                                               recall_pages=100))):
        engine = Engine(m, strategy, prefill_chunk=16)
        kv = engine.new_session_kv()
        events = engine.generate(kv, history, GenerateParams(max_tokens=16))
        outs[name] = [e.token_id for e in events if isinstance(e, TokenGenerated)]
        outs[name + "-logits"] = kv.last_logits
    assert outs["paged"] == outs["full"]
    # the two attend in different code (paged: torch's flash kernel, two parts merged by log-sum-exp; full: the C++
    # loops), and the int4 kernel's ~16-bit activation rounding passes those ulps on: close, not equal
    torch.testing.assert_close(outs["paged-logits"], outs["full-logits"], rtol=0, atol=0.25)


# -- captured layers (a v2 drafter's features) in the whole-step call

def test_captured_layers_come_out_of_the_native_step_without_changing_it():
    """StepInput.capture no longer sends a step to Python: the C++ call keeps the residual stream after each
    captured layer. The step's hidden states and K/V are bit for bit those of the same step without capture, and
    the features are what the Python pieces capture (torch's kernels inside, to their rounding)."""
    m = _model("int4", q4=False)
    nat = m.native_step
    prompt = _prompt(24, seed=5)
    capture = (1, 0)  # in the caller's order, not sorted
    results = {}
    for name in ("native-capture", "native", "python-capture"):
        m.native_step = None if name.startswith("python") else nat
        cache = _cache(m, KVStrategy("full"), 32)
        before = nat.steps
        inp = steps.StepInput(m.tensor(prompt), range(0, 24), cache, "all", True,
                              capture=() if name == "native" else capture)
        (logits, hidden), = steps.forward_batch(m, [inp])
        assert nat.steps - before == (0 if name.startswith("python") else 1)
        results[name] = (logits, hidden, inp.captured, cache.store.k[1].clone())
    m.native_step = nat
    (la, ha, ca, ka), (lb, hb, cb, kb), (lp, hp, cp, _) = (results[n] for n in ("native-capture", "native",
                                                                                 "python-capture"))
    assert torch.equal(ha, hb) and torch.equal(la, lb) and torch.equal(ka, kb) and cb is None
    h = m.spec.hidden_size
    assert ca.shape == (24, 2 * h) == cp.shape
    torch.testing.assert_close(ca, cp, rtol=0, atol=5e-2)
    assert not torch.equal(ca[:, :h], ca[:, h:])  # layer 1, then layer 0


def test_a_batch_of_sessions_capturing_different_layers_gets_each_its_own():
    m = _model()
    caches = [_cache(m, KVStrategy("full"), 8) for _ in range(3)]
    wants = [(1,), (), (0, 1)]
    inps = [steps.StepInput(m.tensor(_prompt(4, seed=i)), range(0, 4), c, "last", True, capture=w)
            for i, (c, w) in enumerate(zip(caches, wants))]
    before = m.native_step.steps
    steps.forward_batch(m, inps)
    assert m.native_step.steps == before + 1
    alone = []
    for i, w in enumerate(wants):
        c = _cache(m, KVStrategy("full"), 8)
        inp = steps.StepInput(m.tensor(_prompt(4, seed=i)), range(0, 4), c, "last", True, capture=w)
        steps.forward_batch(m, [inp])
        alone.append(inp.captured)
    assert inps[1].captured is None and alone[1] is None
    for i in (0, 2):
        assert torch.equal(inps[i].captured, alone[i])
    h = m.spec.hidden_size
    assert inps[0].captured.shape == (4, h) and inps[2].captured.shape == (4, 2 * h)


def test_the_recalled_rows_attention_is_torchs_two_part_attention_to_float_rounding(attention):
    """RowStep.attend_recalled (kv/paged.py's row-exact rows that recall pages, on the native step) against
    attention.attend_row_two_part (torch's flash kernel twice, merged by log-sum-exp) on random rows: one softmax
    over the recalled rows (some masked per KV head) and the slab's visible columns."""
    from inference_engine.backends.torch.attention import attend_row_two_part

    m = _model()
    s = m.spec
    hkv, g, d = s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim
    gen = torch.Generator().manual_seed(7)
    e, cap, n = 300, 640, 600  # recalled rows over two chunks, slab columns over three
    qj = torch.randn(1, hkv, g, d, generator=gen)
    kr, vr = torch.randn(hkv, e, d, generator=gen), torch.randn(hkv, e, d, generator=gen)
    ks, vs = torch.randn(hkv, cap, d, generator=gen), torch.randn(hkv, cap, d, generator=gen)
    mask_r = torch.rand(hkv, e, generator=gen) > 0.3
    mask_w = torch.rand(n, generator=gen) > 0.5
    mask_w[n - 1] = True  # a row always sees its own key
    got = m.native_step.step.attend_recalled(qj.reshape(-1, d), kr, vr, mask_r, ks, vs, mask_w, n)
    ninf = torch.tensor(float("-inf"))
    bias_r = torch.where(mask_r, 0.0, ninf).view(1, hkv, 1, e)
    bias_w = torch.where(mask_w, 0.0, ninf)
    want = attend_row_two_part(qj, kr, vr, bias_r, ks[:, :n], vs[:, :n], bias_w, s.attn_scale or d ** -0.5)
    torch.testing.assert_close(got, want.reshape(-1, d), rtol=1e-4, atol=1e-5)


def test_a_build_killed_midway_does_not_hang_the_next_start(tmp_path):
    """torch's extension build waits while a `lock` file sits in the build directory; a daemon killed mid-build left
    one, and every later start waited on it forever (a test run hung on it). The build now runs under an flock (the
    kernel drops it with its holder), and whoever holds it removes such a leftover before torch looks at it; a second
    builder of the same key waits for the first instead."""
    import fcntl
    import inspect

    from torch.utils import cpp_extension

    from inference_engine.backends.torch import native

    assert "'lock'" in inspect.getsource(cpp_extension._jit_compile)  # the file torch waits on (FileBaton)
    (tmp_path / "lock").touch()  # what a killed build leaves
    with native._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        with open(tmp_path / "build.flock", "a") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another builder waits while this one builds
    with open(tmp_path / "build.flock", "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released after


def test_the_torch_copies_dropped_while_the_native_step_runs_are_read_back_the_same(tmp_path):
    """defer_fallback drops the quantized linears' torch copies (the native step has its own int4 arenas): native
    steps never read them back; the first Python-pieces step reads them from the packed file, kept open, so even a
    file removed meanwhile gives the same bits as before they were dropped."""
    import shutil

    from inference_engine.backends.torch.linear import Int4Linear
    from inference_engine.backends.torch.model import _Deferred

    _module()
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), d, ignore=shutil.ignore_patterns(".kakeya-*"))
    m = TorchCausalLM.load(d, weights="int4")
    assert m.use_native_step() is True
    nat, ids = m.native_step, _prompt(24)

    def pieces():
        m.native_step = None
        try:
            cache = make_cache(KVStrategy("full"), m.geometry(), max_step=64, max_context=m.spec.max_context)
            return feed(m, cache, ids, 8)
        finally:
            m.native_step = nat

    def native_decode():
        engine = Engine(m, KVStrategy("full"), prefill_chunk=8)
        kv = engine.new_session_kv()
        engine.prefill(kv, ids)
        out = []
        for tok in _prompt(6, seed=3):
            steps.decode_step(m, kv, tok)
            out.append(kv.last_logits.clone())
        return torch.stack(out)

    before_pieces, before_native = pieces(), native_decode()
    assert m.defer_fallback() is True
    assert all(isinstance(getattr(L, a), _Deferred) for L in m.layers for a in ("wqkv", "wo", "w_gate_up", "w_down"))
    assert m.weight_bytes > 0  # sizes stay known without reading anything back
    steps_before = nat.steps
    assert torch.equal(native_decode(), before_native) and nat.steps > steps_before
    assert m._deferred is not None  # native steps read nothing back
    (d / ".kakeya-packed-int4.safetensors").unlink()  # the open handle still reads it
    assert torch.equal(pieces(), before_pieces)
    assert m._deferred is None and all(isinstance(L.wqkv, Int4Linear) for L in m.layers)
    assert m.defer_fallback() is False  # no packed file to read back from now
