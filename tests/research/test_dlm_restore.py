"""dlm_restore (kakeya_research/dlm_restore): sink+window resident cache + per-step restored K/V of
every evicted position, plugged into the runtime through the strategy registry and the layout's extra keys.

Same-model restoration (the verifier as its own cache-free proposer, f_θ = identity) must
reproduce `full`: logits within float noise, greedy tokens identical, across prefill chunks,
decode steps and speculative verify steps with rollback; restored tensors never outlive the
layer that reads them, and resident bytes are sink_window's.
"""
import dataclasses
import gc
import weakref

import pytest
import torch

from drafters import HashDrafter, SelfDrafter
from factories import feed, load_model, require_smollm2, tiny_model_dir
from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.generate import Engine, GenerateParams
from inference_engine.kv import registry
from inference_engine.kv.factory import make_cache
from inference_engine.kv.registry import make_strategy
from inference_engine.kv.strategy import KVStrategy
from inference_engine.engine.steps import forward
from kakeya_research.dlm_restore.cache import DLMRestoreCache
from kakeya_research.dlm_restore.seam import RestorePlan, RestoreSource, RestoreStep, verifier_source
from kakeya_research.dlm_restore.strategy import DLMRestoreStrategy
from kv_cache_proposer.same_model import VerifierRestoreSource

ARCHS = ["llama", "qwen3", "gemma3"]  # gemma3: a local layer (window 16) and a global one
SINK, WINDOW = 4, 12


def model(arch="llama", **kw):
    return load_model(str(tiny_model_dir(arch, **kw)))


def new_cache(m, strategy, max_step=64, **kw):
    return make_cache(strategy, m.geometry(), max_step=max_step, max_context=m.spec.max_context, **kw)


def ids(n, seed=0, vocab=256):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(engine, history, n):
    kv = engine.new_session_kv()
    events = engine.generate(kv, history, GenerateParams(max_tokens=n))
    return [e.token_id for e in events if isinstance(e, TokenGenerated)], kv


class RecordingSource:
    """Wraps a RestoreSource; records the layers asked for and weak references to what it returned."""

    name = "recording"

    def __init__(self, inner):
        self.inner, self.calls, self.returned, self.alive_at_request = inner, [], [], []

    def open_step(self, history, evicted):
        step = self.inner.open_step(history, evicted)
        outer = self

        class Step:
            def kv_for_layer(self, layer):
                outer.alive_at_request.append(sum(r() is not None for r in outer.returned))
                k, v = step.kv_for_layer(layer)
                outer.calls.append((layer, evicted.numel()))
                outer.returned += [weakref.ref(k), weakref.ref(v)]
                return k, v

            def close(self):
                step.close()

        return Step()


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_equal_full_whatever_the_chunking(arch):
    m = model(arch)
    history = ids(150)  # > 11 windows
    full = feed(m, new_cache(m, KVStrategy("full")), history, 16)
    for chunk in (1, 9, 64):
        cache = new_cache(m, make_strategy("dlm_restore", SINK, WINDOW))
        got = feed(m, cache, history, chunk)
        torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)
        assert cache.evicted_total == 150 - SINK - WINDOW + 1 and cache.dropped_total == 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("drafter", [None, "self", "hash"])
def test_greedy_equals_full_across_speculative_steps(arch, drafter):
    m = model(arch)
    history = ids(70, seed=1)
    d = {None: None, "self": SelfDrafter(m, context_window=256, corrupt_every=3), "hash": HashDrafter(m.spec.vocab_size)}[drafter]
    spec_k = 3 if d is not None else 0
    ref, _ = greedy(Engine(m, KVStrategy("full"), prefill_chunk=32), history, 40)
    got, kv = greedy(Engine(m, make_strategy("dlm_restore", SINK, WINDOW), prefill_chunk=32, drafter=d, spec_k=spec_k), history, 40)
    assert got == ref
    assert kv.resident_positions == SINK + WINDOW - 1 and kv.dropped_total == 0


def test_speculative_rollback_is_exact():
    m = model()
    strategy = make_strategy("dlm_restore", SINK, WINDOW)
    history, extra, tail = ids(40), ids(6, seed=1), ids(5, seed=2)
    a = new_cache(m, strategy)
    feed(m, a, history, 16)
    forward(m, torch.tensor(extra), torch.arange(a.next_position, a.next_position + 6), a)
    a.commit(2)  # a verify step of which 2 tokens are kept
    b = new_cache(m, strategy)
    feed(m, b, history + extra[:2], 16)
    torch.testing.assert_close(feed(m, a, tail, 5), feed(m, b, tail, 5), rtol=1e-5, atol=1e-5)
    assert (a.resident_positions, a.next_position, a.evicted_total) == (b.resident_positions, b.next_position, b.evicted_total)


def test_restored_kv_live_one_layer_at_a_time_and_are_freed():
    m = model(num_hidden_layers=4)
    src = RecordingSource(VerifierRestoreSource(m))
    cache = new_cache(m, make_strategy("dlm_restore", SINK, WINDOW), resources=src)
    feed(m, cache, ids(60), 8)
    after_one = cache.nbytes
    feed(m, cache, ids(40, seed=4), 1)
    gc.collect()
    assert cache.nbytes == after_one
    # every step asked for layers 0..L-1 in order, for all evicted positions
    layers = [layer for layer, _ in src.calls]
    assert layers == list(range(4)) * (len(layers) // 4) and len(layers) > 4 * 40
    # when layer i+1's K/V are requested, layer i's are already gone; none outlive the step
    assert max(src.alive_at_request) == 0
    assert all(r() is None for r in src.returned)


def test_resident_state_is_sink_windows():
    m = model()
    history = ids(120)
    sw = new_cache(m, KVStrategy("sink_window", SINK, WINDOW))
    dr = new_cache(m, make_strategy("dlm_restore", SINK, WINDOW))
    feed(m, sw, history, 16)
    feed(m, dr, history, 16)
    assert isinstance(dr, DLMRestoreCache)
    assert dr.nbytes == sw.nbytes and dr.resident_positions == sw.resident_positions
    assert sorted(dr.pos[dr.pos >= 0].tolist()) == sorted(sw.pos[sw.pos >= 0].tolist())
    assert dr.evicted_total == sw.dropped_total and dr.dropped_total == 0


def test_the_registry_finds_dlm_restore_and_the_layout_carries_its_restoration():
    """The runtime names no dlm_restore class: its registry finds the plugin, whose parameters are a KVStrategy
    of their own, and the cache hands the forward its restoration as the layout's extra keys."""
    p = registry.plugin("dlm_restore")
    assert "dlm_restore" in registry.names() and p.research and p.params is DLMRestoreStrategy and not p.exact_verify
    st = make_strategy("dlm_restore", SINK, WINDOW, restore_refresh=3)
    assert isinstance(st, DLMRestoreStrategy) and registry.strategy_from_dict(dataclasses.asdict(st)) == st
    with pytest.raises(ValueError, match="unknown kv strategy 'dlm_restore' for KVStrategy"):
        KVStrategy("dlm_restore", SINK, WINDOW)  # the product's parameters do not describe it
    m = model()
    cache = new_cache(m, st)
    assert isinstance(cache, DLMRestoreCache)
    feed(m, cache, ids(40), 8)
    layout = cache.prepare(range(40, 41), torch.tensor([5]))
    assert isinstance(layout.extra_keys, RestorePlan) and layout.extra_keys.positions.tolist() == list(range(SINK, 41 - WINDOW))
    cache.abort()

    class Mlx:
        backend_name = "mlx"

    with pytest.raises(NotImplementedError, match="torch backend only"):
        verifier_source(Mlx())


def test_a_restore_source_plugs_in_through_the_seam():
    """A proposer of another kind supplies pre-RoPE K/V; the verifier positions them. An
    identity 'projection' over the same-model proposer equals full; a wrong one does not."""
    m = model("qwen3")  # k_norm: the verifier must apply its own norm to restored keys
    history = ids(80)
    full = feed(m, new_cache(m, KVStrategy("full")), history, 16)
    verifier = VerifierRestoreSource(m)

    class Projected:
        name = "projected"

        def __init__(self, f):
            self.f = f

        def open_step(self, history, evicted):
            step = verifier.open_step(history, evicted)
            f = self.f

            class Step:
                def kv_for_layer(self, layer):
                    k, v = step.kv_for_layer(layer)
                    return f(layer, k), v

                def close(self):
                    step.close()

            return Step()

    identity, rolled = Projected(lambda layer, k: k), Projected(lambda layer, k: k.roll(1, dims=-1))
    assert isinstance(identity, RestoreSource)
    assert isinstance(verifier.open_step(torch.tensor(history), torch.arange(4, 10)), RestoreStep)
    strategy = make_strategy("dlm_restore", SINK, WINDOW)
    torch.testing.assert_close(feed(m, new_cache(m, strategy, resources=identity), history, 16), full, rtol=1e-4, atol=1e-4)
    wrong = feed(m, new_cache(m, strategy, resources=rolled), history, 16)
    torch.testing.assert_close(wrong[: SINK + WINDOW], full[: SINK + WINDOW], rtol=1e-4, atol=1e-4)  # nothing evicted yet
    assert not torch.allclose(wrong[-1], full[-1], atol=1e-3)


def test_history_stops_at_the_trained_context():
    m = model(max_position_embeddings=64)
    cache = new_cache(m, make_strategy("dlm_restore", SINK, WINDOW))
    feed(m, cache, ids(64), 16)
    resident = cache.resident_positions
    with pytest.raises(ValueError, match="trained context"):
        forward(m, torch.tensor([5]), torch.tensor([64]), cache)
    cache.abort()
    assert (cache.next_position, cache.resident_positions) == (64, resident)
    cache.check_inv1()


def test_unknown_restore_source_is_rejected():
    with pytest.raises(ValueError, match="restore_from 'oracle'"):
        make_strategy("dlm_restore", SINK, WINDOW, restore_from="oracle")
    m = model()
    with pytest.raises(ValueError, match="needs a restore_source"):  # cross-model without its proposer
        Engine(m, make_strategy("dlm_restore", SINK, WINDOW, restore_from="drafter"))


@pytest.mark.model
def test_smollm2_passkey_beyond_the_window_equals_full():
    """SmolLM2, 4+64 window, ~400-token history with the passkey near the start (long
    evicted when the question comes), speculative verify steps: dlm_restore == full."""
    path = require_smollm2()
    from transformers import AutoTokenizer

    m = load_model(str(path))
    tok = AutoTokenizer.from_pretrained(path)
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 16
    text = (f"<|im_start|>user\nThe pass key is 48213. Remember it. {filler}\nWhat is the pass key?<|im_end|>\n"
            "<|im_start|>assistant\nThe pass key is")
    history = tok(text, add_special_tokens=False)["input_ids"]
    assert 380 <= len(history) <= 440
    ref, _ = greedy(Engine(m, KVStrategy("full"), prefill_chunk=128), history, 8)
    assert "48213" in tok.decode(ref).replace(" ", "")  # full retrieves it ...
    forgetful, _ = greedy(Engine(m, KVStrategy("sink_window", 4, 64), prefill_chunk=128), history, 8)
    assert forgetful != ref  # ... a 4+64 window cannot ...
    d = HashDrafter(m.spec.vocab_size)
    got, kv = greedy(Engine(m, make_strategy("dlm_restore", 4, 64), prefill_chunk=128, drafter=d, spec_k=2), history, 8)
    assert got == ref  # ... restoration does, token for token, through verify steps
    assert kv.resident_positions == 4 + 64 - 1


# -- refresh option: restored K/V reused for up to N steps ------------------------------------

class CountingSource:
    """Counts proposer runs (open_step calls) of the same-model source."""

    name = "counting"

    def __init__(self, inner):
        self.inner, self.opened = inner, 0

    def open_step(self, history, evicted):
        self.opened += 1
        return self.inner.open_step(history, evicted)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("refresh", [2, 5])
def test_refresh_reuses_restored_kv_and_still_equals_full(arch, refresh):
    """Same-model with refresh N: the proposer runs about once per N steps, and the result is still
    `full`'s (positions evicted after a refresh stay resident until the next one)."""
    m = model(arch)
    history = ids(120)
    full = feed(m, new_cache(m, KVStrategy("full")), history, 16)
    for chunk in (1, 7):
        src = CountingSource(VerifierRestoreSource(m))
        every = CountingSource(VerifierRestoreSource(m))
        cache = new_cache(m, make_strategy("dlm_restore", SINK, WINDOW, restore_refresh=refresh), resources=src)
        torch.testing.assert_close(feed(m, cache, history, chunk), full, rtol=1e-4, atol=1e-4)
        feed(m, new_cache(m, make_strategy("dlm_restore", SINK, WINDOW), resources=every), history, chunk)
        assert every.opened > 0 and src.opened == pytest.approx(every.opened / refresh, abs=2)
        assert cache.dropped_total == 0
        # between refreshes the held set and the extra resident rows are live memory
        assert cache.held_nbytes > 0 and cache.nbytes == cache.store.nbytes + cache.held_nbytes
        assert cache.peak_nbytes >= cache.nbytes


@pytest.mark.parametrize("drafter", ["self", "hash"])
def test_refresh_greedy_equals_full_across_speculative_steps(drafter):
    m = model("llama")
    history = ids(70, seed=1)
    d = {"self": SelfDrafter(m, context_window=256, corrupt_every=3), "hash": HashDrafter(m.spec.vocab_size)}[drafter]
    ref, _ = greedy(Engine(m, KVStrategy("full"), prefill_chunk=32), history, 40)
    got, kv = greedy(Engine(m, make_strategy("dlm_restore", SINK, WINDOW, restore_refresh=4), prefill_chunk=32, drafter=d, spec_k=3),
                     history, 40)
    assert got == ref
    assert kv.dropped_total == 0


def test_refresh_one_holds_nothing_and_bad_values_are_refused():
    m = model()
    cache = new_cache(m, make_strategy("dlm_restore", SINK, WINDOW, restore_refresh=1))
    feed(m, cache, ids(60), 8)
    assert cache.held_nbytes == 0 and cache.resident_positions == SINK + WINDOW - 1
    for bad in (0, -3, 1.5):
        with pytest.raises(ValueError, match="restore_refresh"):
            make_strategy("dlm_restore", SINK, WINDOW, restore_refresh=bad)


def test_refresh_rolled_back_step_is_not_adopted():
    """A refresh step of which only part is kept (speculative rollback) leaves nothing held from it."""
    m = model()
    strategy = make_strategy("dlm_restore", SINK, WINDOW, restore_refresh=3)
    a = new_cache(m, strategy)
    feed(m, a, ids(40), 40)  # one step: nothing evicted yet, nothing held
    assert a.held_nbytes == 0
    forward(m, torch.tensor(ids(6, seed=1)), torch.arange(40, 46), a)  # a refresh step (27 evicted positions)
    a.commit(2)
    assert a.held_nbytes == 0  # not adopted: the next step refreshes again
    tail = ids(5, seed=2)
    b = new_cache(m, KVStrategy("full"))
    feed(m, b, ids(40) + ids(6, seed=1)[:2], 16)
    torch.testing.assert_close(feed(m, a, tail, 1), feed(m, b, tail, 1), rtol=1e-4, atol=1e-4)


# -- pinned positions: the worst-restored evicted positions stay resident -----------------------

class CorruptingSource:
    """The exact same-model proposer, except that K/V at `bad` positions come back far off."""

    name = "corrupting"

    def __init__(self, inner, bad):
        self.inner, self.bad = inner, set(bad)

    def open_step(self, history, evicted):
        step = self.inner.open_step(history, evicted)
        hit = torch.tensor([int(p) in self.bad for p in evicted])
        outer_hit = hit

        class Step:
            def kv_for_layer(self, layer):
                k, v = step.kv_for_layer(layer)
                k, v = k.clone(), v.clone()
                k[:, outer_hit] += 3.0
                v[:, outer_hit] += 3.0
                return k, v

            def close(self):
                step.close()

        return Step()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_pinned_positions_are_the_worst_restored_and_make_it_exact(arch):
    m = model(arch)
    history = ids(120)
    bad = [9, 30, 31, 77]
    full = feed(m, new_cache(m, KVStrategy("full")), history, 16)
    strategy = make_strategy("dlm_restore", SINK, WINDOW, restore_from="drafter", restore_pin=len(bad))
    for chunk in (1, 16):
        cache = new_cache(m, strategy, resources=CorruptingSource(VerifierRestoreSource(m), bad))
        got = feed(m, cache, history, chunk)
        assert cache.pinned_positions == bad
        torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)  # the only wrong K/V are never used
        assert cache.resident_positions == SINK + WINDOW - 1 + len(bad) and cache.dropped_total == 0
    # the same corruption without pins changes the output: the test can fail
    unpinned = feed(m, new_cache(m, make_strategy("dlm_restore", SINK, WINDOW, restore_from="drafter"),
                                 resources=CorruptingSource(VerifierRestoreSource(m), bad)), history, 16)
    assert not torch.allclose(unpinned[-1], full[-1], atol=1e-3)


def test_pinned_cache_memory_is_flat_and_fewer_pins_keep_the_worst():
    m = model()
    bad = [12, 40, 41, 90, 130]
    src = CorruptingSource(VerifierRestoreSource(m), bad)
    cache = new_cache(m, make_strategy("dlm_restore", SINK, WINDOW, restore_from="drafter", restore_pin=3), resources=src)
    feed(m, cache, ids(60), 8)
    first = cache.nbytes
    feed(m, cache, ids(100, seed=3), 1)
    assert cache.nbytes == first  # sink + window + pins, whatever the history
    assert len(cache.pinned_positions) == 3 and set(cache.pinned_positions) <= set(bad)


def test_pin_needs_a_learned_proposer():
    with pytest.raises(ValueError, match="restore_pin"):
        make_strategy("dlm_restore", SINK, WINDOW, restore_pin=4)  # same-model: exact, nothing to pin
    with pytest.raises(ValueError, match="restore_pin"):
        make_strategy("sink_window", SINK, WINDOW, restore_pin=4)
    with pytest.raises(ValueError, match="cannot be combined"):
        make_strategy("dlm_restore", SINK, WINDOW, restore_from="drafter", restore_pin=4, restore_refresh=2)


def test_pinned_greedy_equals_full_across_speculative_steps():
    m = model("llama")
    history = ids(70, seed=1)
    bad = [8, 20, 21, 45]
    ref, _ = greedy(Engine(m, KVStrategy("full"), prefill_chunk=32), history, 40)
    src = CorruptingSource(VerifierRestoreSource(m), bad)
    strategy = make_strategy("dlm_restore", SINK, WINDOW, restore_from="drafter", restore_pin=len(bad))
    engine = Engine(m, strategy, prefill_chunk=32, drafter=SelfDrafter(m, context_window=256, corrupt_every=3), spec_k=3,
                    strategy_resources=src)
    got, kv = greedy(engine, history, 40)
    assert got == ref
    assert kv.cache.pinned_positions == bad


# -- attention-mass calibration: a per-(layer, head) logit offset on the restored columns ------

class BiasedSource:
    """The exact same-model proposer whose steps carry a `logit_bias` (num_layers, num_heads)."""

    name = "biased"

    def __init__(self, inner, bias):
        self.inner, self.bias = inner, bias

    def open_step(self, history, evicted):
        step = self.inner.open_step(history, evicted)
        step.logit_bias = self.bias
        return step


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_logit_bias_is_applied_to_the_restored_columns_only(arch):
    m = model(arch)
    s = m.spec
    history = ids(90, seed=4)
    strategy = make_strategy("dlm_restore", SINK, WINDOW, restore_from="drafter")
    full = feed(m, new_cache(m, KVStrategy("full")), history, 16)
    window = feed(m, new_cache(m, KVStrategy("sink_window", SINK, WINDOW)), history, 1)
    zero = torch.zeros(s.num_layers, s.num_heads)
    got = feed(m, new_cache(m, strategy, resources=BiasedSource(VerifierRestoreSource(m), zero)), history, 16)
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)  # no offset: exact restoration is still `full`
    # an offset of -1e9 removes the restored positions from attention: what is left is sink_window
    # (one token per step: a prefill chunk of dlm_restore attends to all its resident keys, sink_window to each query's window)
    gone = feed(m, new_cache(m, strategy, resources=BiasedSource(VerifierRestoreSource(m), zero - 1e9)), history, 1)
    torch.testing.assert_close(gone, window, rtol=1e-4, atol=1e-4)
    # a finite offset on one head of one layer changes the output, and only from the first evicting step on
    one = zero.clone()
    one[0, 1] = 2.0
    moved = feed(m, new_cache(m, strategy, resources=BiasedSource(VerifierRestoreSource(m), one)), history, 16)
    first_evicted = SINK + WINDOW  # the first step whose queries see a restored position
    torch.testing.assert_close(moved[:first_evicted], full[:first_evicted], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(moved[-1], full[-1], atol=1e-3)


def test_logit_bias_equals_attention_with_offset_logits():
    """Reference: one decode step after a one-chunk prefill (every K/V so far computed without any
    offset), by hand: softmax over [restored logits + b, resident logits]."""
    m = model("llama")
    s = m.spec
    history = ids(40, seed=5)
    n = len(history)
    bias = torch.randn(s.num_layers, s.num_heads, generator=torch.Generator().manual_seed(0))
    cache = new_cache(m, make_strategy("dlm_restore", SINK, WINDOW, restore_from="drafter"),
                      resources=BiasedSource(VerifierRestoreSource(m), bias))
    feed(m, cache, history[:-1], n - 1)
    got = feed(m, cache, history[-1:], 1)[-1]
    x = m.embed_ids(torch.tensor(history))
    rope = m.rope(torch.arange(n))
    g = s.num_heads // s.num_kv_heads
    kp = torch.arange(n)
    restored = (kp >= SINK) & (kp <= n - 1 - WINDOW)  # out of the last query's window
    causal = kp[None, :] <= kp[:, None]
    with torch.inference_mode():
        for i in range(s.num_layers):
            q, k, v = m.project(i, x)
            q, k = m.position_q(i, q, rope)[0], m.position_k(i, k, rope)
            scores = (q @ k.repeat_interleave(g, 0).transpose(1, 2)) * s.attn_scale  # (H, n, n)
            scores[:, -1] += torch.where(restored, bias[i][:, None], torch.zeros(()))  # the decode step's row only
            o = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v.repeat_interleave(g, 0)
            x = m.finish(i, x, o)
        want = m.logits(m.final_norm(x)[-1:])[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, feed(m, new_cache(m, KVStrategy("full")), history, n)[-1], atol=1e-3)
