"""The engine and cache tests that make sense on every backend, run on each (torch, mlx).

Each scenario here is a property of the engine's steps and the project's caches, not of one
framework: INV-3 (one append vs one-token appends), multi-turn vs one-shot history, stop
reasons, sink_window eviction and bounded bytes, chunking independence, paged recall (== full
when every page is recalled; chunking- and append-independent), exact rollback of a
speculative step, speculative decoding == autoregressive (greedy, and deterministic per seed
when sampled), a failing step leaving the cache untouched, state() -> from_state through
files, and concurrent sessions (batched and not) equal to their solo runs. The `backend`
fixture runs each on torch and on MLX; MLX cases skip, naming the fix, where MLX cannot be
imported (and fail under CI, where `make test` installs it: factories.require_backend).
Cross-backend equality (MLX tokens == torch tokens) is tests/backends/test_mlx_backend.py.

Tiny random-weight models (tests/factories.py); fp32 unless a test says otherwise.
"""
from __future__ import annotations

import functools
import json
import threading

import numpy as np
import pytest
import torch

from factories import BACKENDS, SlowModel, feed, load_model, make_engine, require_backend, tiny_model_dir
from inference_engine.engine import steps
from inference_engine.engine.events import HistoryTruncated, TokenGenerated
from inference_engine.engine.generate import Engine
from inference_engine.engine.requests import GenerateParams, SamplingParams
from inference_engine.engine.session_kv import SessionKV
from inference_engine.engine.steps import forward
from inference_engine.kv.factory import make_cache
from inference_engine.kv.strategy import KVStrategy


@pytest.fixture(params=BACKENDS)
def backend(request):
    require_backend(request.param)
    return request.param


def ids(n: int, seed: int, vocab: int = 256) -> list:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def model(backend: str, arch: str = "llama", **config):
    return load_model(str(tiny_model_dir(arch, **config)), backend)


@functools.lru_cache(maxsize=None)
def int4_model(backend: str):
    """Tiny llama at int4 (the same Q4_1 codes on both backends); its linears are row-independent."""
    path = tiny_model_dir("llama")
    if backend == "mlx":
        from inference_engine.backends.mlx.model import MlxCausalLM

        return MlxCausalLM.load(path, weights="int4")
    from inference_engine.backends.torch.model import TorchCausalLM

    return TorchCausalLM.load(path, weights="int4")


def run(engine, kv, history, n, should_stop=lambda: False, **params):
    """(tokens, done event, all events) of one generate call."""
    evs = list(engine.generate(kv, history, GenerateParams(max_tokens=n, **params), should_stop))
    return [e.token_id for e in evs if isinstance(e, TokenGenerated)], evs[-1], evs


def generate(engine, history, n, kv=None, **sampling) -> list:
    sp = SamplingParams(**sampling) if sampling else SamplingParams()
    return run(engine, kv or engine.new_session_kv(), history, n, sampling=sp)[0]


def new_cache(m, strategy, max_step=64):
    return make_cache(strategy, m.geometry(), max_step=max_step, max_context=m.spec.max_context)


class ModelDrafter:
    """Drafts with the verifier itself (greedy, cache-free re-encode of the tail) through the
    backend's own arrays, so it runs on any backend; `corrupt_every` makes some drafts wrong."""

    uses_verifier_hidden = False
    context_window = 4096

    def __init__(self, model, corrupt_every: int = 0):
        self.model, self.corrupt_every, self.calls = model, corrupt_every, 0

    def draft(self, context_ids, k, *, context_hidden=None):
        from drafters import Draft

        m, self.calls = self.model, self.calls + 1
        tokens, out = context_ids.tolist(), []
        for _ in range(k):
            cache = new_cache(m, KVStrategy("full"), max_step=256)
            logits, _ = forward(m, m.tensor(tokens), range(len(tokens)), cache, logits="last")
            cache.commit()
            t = int(m.to_host(logits)[-1].argmax())
            if self.corrupt_every and (self.calls + len(out)) % self.corrupt_every == 0:
                t = (t + 1) % m.spec.vocab_size
            out.append(t)
            tokens.append(t)
        return Draft(torch.tensor(out))


# -- engine ---------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy, window", [("full", 1020), ("sink_window", 12)])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.95, "seed": 7}], ids=["greedy", "sampled"])
def test_inv3_one_append_equals_one_token_appends(backend, strategy, window, sampling):
    """Same history, seed and params -> same tokens, whether the history came in one append or one token at a time."""
    engine = make_engine("llama", strategy, 4, window, prefill_chunk=16, backend=backend)
    history = ids(40, 2)
    one = generate(engine, history, 16, **sampling)
    kv = engine.new_session_kv()
    for i in range(1, len(history)):  # one prefill step per appended token
        engine.prefill(kv, history[kv.next_position : i])
    assert generate(engine, history, 16, kv=kv, **sampling) == one


@pytest.mark.parametrize("strategy", ["full", "sink_window"])
def test_multi_turn_equals_one_shot_history(backend, strategy):
    """Turn by turn (generated tokens join the history) == a fresh session given the whole history."""
    engine = make_engine("llama", strategy, 4, 24, prefill_chunk=8, backend=backend)
    kv, history = engine.new_session_kv(), []
    for turn in range(3):
        history += ids(13, 20 + turn)
        history += generate(engine, history, 6, kv=kv)
    assert generate(engine, history[:-6], 6) == history[-6:]


def test_stop_reasons_and_counts(backend):
    """max_tokens, eos (the first generated token as eos), context_full at the trained context, cancel."""
    engine = make_engine("llama", "full", backend=backend)
    toks, done, _ = run(engine, engine.new_session_kv(), ids(10, 0), 7)
    assert len(toks) == 7 and done.stop_reason == "max_tokens" and done.prefill_tokens == 10 and done.generated_tokens == 7
    toks, done, _ = run(engine, engine.new_session_kv(), ids(10, 0), 20, eos_token_ids=frozenset(toks[:1]))
    assert len(toks) == 1 and done.stop_reason == "eos"
    short = make_engine("llama", "full", backend=backend, max_position_embeddings=32)
    toks, done, _ = run(short, short.new_session_kv(), ids(28, 1), 10)
    assert len(toks) == 4 and done.stop_reason == "context_full"
    calls = iter(range(1000))
    toks, done, _ = run(engine, engine.new_session_kv(), ids(10, 0), 50, should_stop=lambda: next(calls) > 4)
    assert done.stop_reason == "cancelled" and 0 < len(toks) < 50


def test_seeded_sampling_is_deterministic_and_seed_dependent(backend):
    engine = make_engine("qwen3", "sink_window", 4, 16, backend=backend)
    s = lambda seed: generate(engine, ids(40, 3), 12, temperature=0.9, top_p=0.95, seed=seed)  # noqa: E731
    assert s(123) == s(123) and s(123) != s(124)


@pytest.mark.parametrize("strategy", [KVStrategy("full"), KVStrategy("sink_window", 4, 16)], ids=lambda s: s.name)
def test_hand_driven_steps_equal_generate(backend, strategy):
    m = model(backend)
    engine = Engine(m, strategy, prefill_chunk=16)
    history = ids(50, 4)
    want = generate(engine, history, 12)
    kv = engine.new_session_kv()
    for i in range(0, len(history), 16):
        steps.prefill_chunk(m, kv, history[i : i + 16])
    got = [int(kv.last_logits.argmax())]
    while len(got) < 12:
        steps.decode_step(m, kv, got[-1])
        got.append(int(kv.last_logits.argmax()))
    assert got == want


# -- sink_window eviction ---------------------------------------------------------------------
def test_sink_window_evicts_reports_and_stays_bounded(backend):
    """Past sink + window the oldest non-sink positions leave: HistoryTruncated reports them, the
    resident set is sink + window - 1 between steps, and the cache's bytes stop growing."""
    engine = make_engine("llama", "sink_window", 4, 16, prefill_chunk=16, backend=backend)
    kv = engine.new_session_kv()
    _, _, evs = run(engine, kv, ids(50, 5), 3)
    trunc = [e for e in evs if isinstance(e, HistoryTruncated)]
    assert trunc and trunc[0].dropped_tokens > 0 and kv.dropped_total == sum(e.dropped_tokens for e in trunc)
    assert kv.resident_positions == 4 + 16 - 1
    early = kv.nbytes
    engine.prefill(kv, ids(200, 6))
    kv.cache.check_inv1()
    assert kv.nbytes == early and kv.resident_positions == 4 + 16 - 1


def test_sink_window_result_does_not_depend_on_chunking(backend):
    m = model(backend)
    strategy = KVStrategy("sink_window", 4, 12)
    history = ids(90, 7)
    ref = feed(m, new_cache(m, strategy), history, 64)
    for chunk in (1, 7, 30):
        torch.testing.assert_close(feed(m, new_cache(m, strategy), history, chunk), ref, rtol=1e-4, atol=1e-4)


def test_window_wider_than_history_equals_full_and_a_narrow_one_differs_after_eviction(backend):
    m = model(backend)
    history = ids(60, 8)
    full = feed(m, new_cache(m, KVStrategy("full")), history, 16)
    wide = feed(m, new_cache(m, KVStrategy("sink_window", 4, 1000)), history, 16)
    narrow = feed(m, new_cache(m, KVStrategy("sink_window", 2, 8)), history, 16)
    torch.testing.assert_close(wide, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(narrow[:10], full[:10], rtol=1e-5, atol=1e-5)  # nothing evicted yet
    assert not torch.allclose(narrow[-1], full[-1], atol=1e-3)


# -- paged: sink + window resident, evicted positions archived in pages, top pages recalled ----------
def paged(pages: int = 2, window: int = 12) -> KVStrategy:
    return KVStrategy("paged", 4, window, page_size=8, recall_pages=pages)


def test_paged_recalling_every_page_equals_full(backend):
    m = model(backend)
    history = ids(120, 40)
    full = feed(m, new_cache(m, KVStrategy("full")), history, 16)
    for chunk in (16, 1):
        cache = new_cache(m, paged(pages=100))
        torch.testing.assert_close(feed(m, cache, history, chunk), full, rtol=1e-4, atol=1e-4)
        assert cache.pages.rows == 120 - 12 + 1 - 4 and cache.dropped_total == 0


def test_paged_recalls_and_does_not_depend_on_chunking(backend):
    """Two recalled pages: neither full nor sink_window, and the same whatever the chunking (INV-3),
    row-exact (decode/verify) steps included."""
    m = model(backend)
    history = ids(140, 41)
    ref = feed(m, new_cache(m, paged()), history, 64)
    full = feed(m, new_cache(m, KVStrategy("full")), history, 64)[-1]
    sw = feed(m, new_cache(m, KVStrategy("sink_window", 4, 12)), history, 64)[-1]
    assert not torch.allclose(ref[-1], full, atol=1e-4) and not torch.allclose(ref[-1], sw, atol=1e-4)
    for chunk, row_exact in ((1, False), (7, False), (5, True)):
        torch.testing.assert_close(feed(m, new_cache(m, paged()), history, chunk, row_exact), ref, rtol=1e-4, atol=1e-4)


def test_paged_engine_one_append_equals_token_by_token_appends(backend):
    engine = Engine(model(backend), paged(), prefill_chunk=32)
    history = ids(90, 42)
    one = generate(engine, history, 12)
    kv = engine.new_session_kv()
    for t in history[:-1]:
        engine.prefill(kv, [t])
    assert generate(engine, history, 12, kv=kv) == one


# -- speculative steps: exact rollback ----------------------------------------------------------
@pytest.mark.parametrize("strategy", [KVStrategy("full"), KVStrategy("sink_window", 4, 12), paged()], ids=lambda s: s.name)
def test_cache_rollback_is_exact(backend, strategy):
    """A 6-token step of which 2 are kept leaves the cache as if only those 2 had been fed."""
    m = model(backend)
    history, extra, tail = ids(40, 9), ids(6, 10), ids(5, 11)
    a, b = new_cache(m, strategy), new_cache(m, strategy)
    feed(m, a, history, 16)
    forward(m, m.tensor(extra), range(a.next_position, a.next_position + 6), a, row_exact=True)
    a.commit(2)
    feed(m, b, history + extra[:2], 16)
    assert (a.resident_positions, a.next_position, a.nbytes) == (b.resident_positions, b.next_position, b.nbytes)
    torch.testing.assert_close(feed(m, a, tail, 5), feed(m, b, tail, 5), rtol=1e-5, atol=1e-5)


def test_verify_block_rolls_back_exactly(backend):
    """A verify step whose drafts are partly wrong keeps the accepted prefix and leaves the cache as
    if only those tokens had been decoded: continuing equals plain decoding, token for token."""
    engine = make_engine("llama", "sink_window", 4, 12, prefill_chunk=16, backend=backend)
    m, history = engine.model, ids(30, 12)
    plain = generate(engine, history, 12)
    kv = engine.new_session_kv()
    engine.prefill(kv, history)
    first = int(kv.last_logits.argmax())
    drafts = [plain[1], plain[2], (plain[3] + 1) % 256, plain[4]]  # two right, then a wrong one
    r = steps.verify_block(m, kv, first, drafts, SamplingParams(), None, budget=10)
    assert r.accepted == 2 and list(r.emitted) == plain[1:4] and kv.next_position == len(history) + 3
    kv.cache.check_inv1()
    out = [first, *r.emitted]
    while len(out) < 12:
        steps.decode_step(m, kv, out[-1])
        out.append(int(kv.last_logits.argmax()))
    assert out == plain


def test_a_failing_step_leaves_the_cache_untouched(backend):
    """A verify step that fails after its forward (acceptance raises), and a decode step whose forward fails
    part-way on another thread, are rolled back; the session goes on as if they never ran (MLX: the
    aborted step's lazy cache writes are evaluated on the thread that built them)."""
    m = model(backend)
    engine = Engine(m, KVStrategy("sink_window", 4, 16), prefill_chunk=16)
    history = ids(40, 13)
    want = generate(engine, history, 8)
    kv = engine.new_session_kv()
    engine.prefill(kv, history)
    before = (kv.next_position, kv.resident_positions, kv.nbytes, kv.last_logits.clone())

    def boom(*a, **k):
        raise RuntimeError("acceptance failed")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(steps, "accept_drafts", boom)
        with pytest.raises(RuntimeError, match="acceptance failed"):
            steps.verify_block(m, kv, want[0], [5, 6], SamplingParams(), None, budget=4)
    assert (kv.next_position, kv.resident_positions, kv.nbytes) == before[:3]
    assert torch.equal(kv.last_logits, before[3])
    # and a forward that fails part-way (layer 1), on another thread: layer 0's rows were written
    real_finish, errors = m.finish, []

    def finish(layer, x, o):
        if layer == 1:
            raise RuntimeError("layer 1 failed")
        return real_finish(layer, x, o)

    def step():
        try:
            steps.decode_step(m, kv, want[0])
        except RuntimeError as e:
            errors.append(str(e))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(m, "finish", finish)
        t = threading.Thread(target=step)
        t.start()
        t.join()
    assert errors == ["layer 1 failed"] and (kv.next_position, kv.resident_positions, kv.nbytes) == before[:3]
    out = [want[0]]
    while len(out) < 8:
        steps.decode_step(m, kv, out[-1])
        out.append(int(kv.last_logits.argmax()))
    assert out == want


@pytest.mark.parametrize("strategy", [KVStrategy("full"), KVStrategy("sink_window", 4, 16), paged()], ids=lambda s: s.name)
def test_greedy_speculative_equals_autoregressive(backend, strategy):
    """Self drafts (mostly accepted, some corrupted) and n-gram drafts: the same tokens as plain decoding."""
    from inference_engine.engine.prompt_lookup import PromptLookupDrafter

    m = model(backend)
    history = ids(12, 14) * 3 + ids(10, 15)  # longer than the window; repeats give n-gram drafts
    want = generate(Engine(m, strategy, prefill_chunk=32), history, 24)
    for drafter, k in ((ModelDrafter(m, corrupt_every=3), 3), (PromptLookupDrafter(), 4)):
        spec = Engine(m, strategy, prefill_chunk=32, drafter=drafter, spec_k=k)
        got, done, _ = run(spec, spec.new_session_kv(), history, 24)
        assert got == want, type(drafter).__name__
        assert done.drafted_tokens > 0  # verify blocks really ran
        if isinstance(drafter, ModelDrafter) and strategy.name == "full":  # drafts = the verifier's own tokens, but some
            assert 0 < done.accepted_tokens < done.drafted_tokens  # corrupted: rollback kept prefixes


def test_speculative_sampling_is_deterministic_per_seed(backend):
    m = model(backend)
    spec = Engine(m, KVStrategy("sink_window", 4, 16), prefill_chunk=32, drafter=ModelDrafter(m), spec_k=3)
    s = lambda seed: generate(spec, ids(30, 16), 16, temperature=1.0, seed=seed)  # noqa: E731
    assert s(5) == s(5) and s(5) != s(6)


# -- cache state --------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", [KVStrategy("full"), KVStrategy("sink_window", 4, 24), paged(window=24)],
                         ids=lambda s: s.name)
def test_state_round_trip_through_files_continues_token_identical(backend, strategy, tmp_path):
    """state() -> safetensors + JSON -> SessionKV.from_state: same bytes, positions and logits, and two
    more turns (greedy, then sampled) equal to the session that never left memory."""
    from safetensors.torch import load_file, save_file

    from inference_engine.kv.slot_cache import CacheState

    engine = Engine(model(backend), strategy, prefill_chunk=16)
    kept, hist = engine.new_session_kv(), ids(60, 17)
    hist += generate(engine, hist, 6, kv=kept)
    st = kept.state()
    save_file({k: v.contiguous() for k, v in st.tensors.items()}, str(tmp_path / "kv.safetensors"))
    (tmp_path / "kv.json").write_text(json.dumps(st.meta))
    saved = CacheState(load_file(str(tmp_path / "kv.safetensors")), json.loads((tmp_path / "kv.json").read_text()))
    back = SessionKV.from_state(saved, engine.model.geometry(), max_step=16, max_context=engine.max_context)
    assert (back.nbytes, back.next_position, back.resident_positions) == (kept.nbytes, kept.next_position, kept.resident_positions)
    assert torch.equal(back.last_logits, kept.last_logits)
    for more, sampling in ((ids(9, 18), {}), (ids(20, 19), {"temperature": 0.8, "seed": 11})):
        hist += more
        a, b = generate(engine, hist, 7, kv=back, **sampling), generate(engine, hist, 7, kv=kept, **sampling)
        assert a == b
        hist += a
    assert back.dropped_total == kept.dropped_total


# -- concurrent sessions ------------------------------------------------------------------------
def run_concurrently(engine, jobs) -> list:
    out, errors = [None] * len(jobs), []

    def work(i, hist, params):
        try:
            out[i] = [e.token_id for e in engine.generate(engine.new_session_kv(), hist, params) if isinstance(e, TokenGenerated)]
        except Exception as e:  # noqa: BLE001 - reported below, with the session it came from
            errors.append(f"session {i}: {e!r}")

    threads = [threading.Thread(target=work, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return out


@pytest.mark.parametrize("batching", ["off", "on"])
def test_concurrent_sessions_equal_their_solo_runs(backend, batching):
    """Sessions generating at once on their own threads (steps may run on another session's thread,
    batched into one forward when on) give each what it gives alone. int4: row-independent linears."""
    m = int4_model(backend)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    jobs = [(ids(30 + 9 * i, 30 + i), GenerateParams(max_tokens=12, sampling=sampled if i % 2 else SamplingParams()))
            for i in range(4)]
    strategy = KVStrategy("sink_window", 4, 24)
    solo = Engine(m, strategy, prefill_chunk=16, batching="off")
    want = [run_concurrently(solo, [job])[0] for job in jobs]
    engine = Engine(SlowModel(m), strategy, prefill_chunk=16, batching=batching)
    assert run_concurrently(engine, jobs) == want
    if batching == "on":
        assert max(engine.loop.stats.batch_sizes) > 1, engine.loop.stats.batch_sizes  # steps really shared forwards


def test_auto_batching_is_on_only_where_exact(backend):
    """batching auto = on for int4 on the CPU (row-independent linears, checked above), off for fp32."""
    assert Engine(int4_model(backend), KVStrategy("full")).loop.batching
    assert not Engine(model(backend), KVStrategy("full")).loop.batching


def test_the_backend_fixture_runs_the_backend_it_names(backend):
    """Guard against a parametrisation that silently runs torch twice."""
    m = model(backend)
    assert m.backend_name == backend
    if backend == "mlx":
        import mlx.core as mx

        assert isinstance(m.tensor([1, 2]), mx.array)
        assert isinstance(m.cat([m.tensor([1]), m.tensor([2, 3])], 0), mx.array)
        assert np.array_equal(np.array(m.cat([m.tensor([1]), m.tensor([2, 3])], 0)), [1, 2, 3])
