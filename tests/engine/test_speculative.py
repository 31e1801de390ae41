"""Speculative decoding never changes the verifier's output distribution."""
import pytest
import torch
from scipy.stats import chisquare

import inference_engine.engine.steps as steps_mod
from drafters import HashDrafter, SelfDrafter
from factories import load_model, tiny_model_dir
from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.generate import Engine, GenerateParams
from inference_engine.engine.sampling import SamplingParams, target_distribution
from inference_engine.kv.strategy import KVStrategy
from inference_engine.engine.steps import forward


def tokens(engine, history, n, sampling=SamplingParams()):
    evs = list(engine.generate(engine.new_session_kv(), history, GenerateParams(max_tokens=n, sampling=sampling)))
    return [e.token_id for e in evs if isinstance(e, TokenGenerated)], evs[-1]


def prompt(n, seed=0, vocab=256):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


STRATEGIES = [KVStrategy("full"), KVStrategy("sink_window", 4, 24)]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
@pytest.mark.parametrize("drafter_kind", ["self", "self_corrupted", "hash"])
def test_greedy_speculative_equals_autoregressive(arch, strategy, drafter_kind):
    model = load_model(str(tiny_model_dir(arch)))
    drafter = {
        "self": lambda: SelfDrafter(model),
        "self_corrupted": lambda: SelfDrafter(model, corrupt_every=3),
        "hash": lambda: HashDrafter(256),
    }[drafter_kind]()
    ar = Engine(model, strategy, prefill_chunk=32)
    for k in (1, 3, 7):
        spec = Engine(model, strategy, prefill_chunk=32, drafter=drafter, spec_k=k)
        history = prompt(70, seed=k)  # longer than the 4+24 window
        want, _ = tokens(ar, history, 40)
        got, done = tokens(spec, history, 40)
        assert got == want
        assert done.drafted_tokens > 0
        if drafter_kind == "self" and strategy.name == "full":
            assert done.accepted_tokens > done.drafted_tokens // 2


def test_multi_turn_speculative_session_equals_autoregressive():
    model = load_model(str(tiny_model_dir("qwen3")))
    strategy = KVStrategy("sink_window", 4, 16)
    results = []
    for engine in (Engine(model, strategy, prefill_chunk=16),
                   Engine(model, strategy, prefill_chunk=16, drafter=SelfDrafter(model, corrupt_every=4), spec_k=4)):
        kv, history = engine.new_session_kv(), []
        for turn in range(4):
            history += prompt(9, seed=turn)
            evs = list(engine.generate(kv, history, GenerateParams(max_tokens=11)))
            history += [e.token_id for e in evs if isinstance(e, TokenGenerated)]
        results.append(history)
    assert results[0] == results[1]


def test_eos_inside_an_accepted_block_stops_there():
    model = load_model(str(tiny_model_dir("llama")))
    ar = Engine(model, KVStrategy("full"))
    history = prompt(20, seed=3)
    ref, _ = tokens(ar, history, 12)
    eos = ref[5]
    first = ref.index(eos)
    spec = Engine(model, KVStrategy("full"), drafter=SelfDrafter(model), spec_k=8)
    evs = list(spec.generate(spec.new_session_kv(), history, GenerateParams(max_tokens=12, eos_token_ids=frozenset([eos]))))
    got = [e.token_id for e in evs if isinstance(e, TokenGenerated)]
    assert got == ref[: first + 1] and evs[-1].stop_reason == "eos"


def test_speculative_sampling_is_deterministic_per_seed():
    model = load_model(str(tiny_model_dir("llama")))
    spec = Engine(model, KVStrategy("sink_window", 4, 16), drafter=SelfDrafter(model), spec_k=4)
    def s(seed):
        return tokens(spec, prompt(30), 20, SamplingParams(temperature=1.0, seed=seed))[0]

    assert s(5) == s(5)
    assert s(5) != s(6)


# -- sampling exactness -----------------------------------------------------------------
VOCAB = 12
TEMP = SamplingParams(temperature=1.5)


def exact_marginals(model, history):
    """P(token at generated step 2) and P(step 3) by enumerating the verifier's tree."""
    def dist(ids):
        from inference_engine.kv.factory import make_cache

        cache = make_cache(KVStrategy("full"), model.geometry(), max_step=64, max_context=model.spec.max_context)
        logits, _ = forward(model, torch.tensor(ids), torch.arange(len(ids)), cache, logits="last")
        return target_distribution(logits[-1], TEMP).double()

    p1 = dist(history)
    p2 = torch.zeros(VOCAB, dtype=torch.double)
    p3 = torch.zeros(VOCAB, dtype=torch.double)
    for x in range(VOCAB):
        px = dist(history + [x])
        p2 += p1[x] * px
        for y in range(VOCAB):
            p3 += p1[x] * px[y] * dist(history + [x, y])
    return p2, p3


def empirical(engine, history, n):
    counts2 = torch.zeros(VOCAB)
    counts3 = torch.zeros(VOCAB)
    for seed in range(n):
        toks, _ = tokens(engine, history, 3, SamplingParams(temperature=TEMP.temperature, seed=seed))
        counts2[toks[1]] += 1
        counts3[toks[2]] += 1
    return counts2, counts3


def chi2_pvalue(counts, probs):
    keep = probs * counts.sum() >= 5  # pool rare cells so the chi-square approximation holds
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]]).double()
    exp = torch.cat([probs[keep], probs[~keep].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp / exp.sum() * obs.sum()
    return chisquare(obs.numpy(), exp.numpy()).pvalue


def always_accept(drafts, logits, params, gen):
    """A broken acceptance rule: takes every draft, then samples a bonus token."""
    probs = target_distribution(logits, params)
    return list(drafts), int(torch.multinomial(probs[len(drafts)], 1, generator=gen))


@pytest.fixture(scope="module")
def small_vocab_setup():
    model = load_model(str(tiny_model_dir("llama", vocab_size=VOCAB)))
    history = [3, 7, 1, 9, 4]
    return model, history, exact_marginals(model, history)


def small_vocab_drafter(kind, model):
    """hash: fixed drafts; dflash: a random-weight v2 drafter reading the verifier's layer-0 outputs."""
    if kind == "hash":
        return HashDrafter(VOCAB)
    from kv_cache_proposer.dflash_drafter import DFlashDrafter
    from kv_cache_proposer.dflash_model import DFlashConfig, DFlashModel

    torch.manual_seed(0)
    V, H = model.embed.shape
    cfg = DFlashConfig(vocab_size=V, verifier_hidden_size=H, capture_layers=(0,), hidden_size=32, num_layers=1, num_heads=4,
                       num_kv_heads=2, intermediate_size=64, draft_vocab_size=0, context_window=8)
    return DFlashDrafter(DFlashModel(cfg, model.embed.float(), model.lm_head.float()))


@pytest.mark.parametrize("drafter_kind", ["hash", "dflash"])
def test_speculative_sampling_matches_verifier_distribution(small_vocab_setup, drafter_kind):
    model, history, (p2, p3) = small_vocab_setup
    engine = Engine(model, KVStrategy("full"), drafter=small_vocab_drafter(drafter_kind, model), spec_k=2)
    c2, c3 = empirical(engine, history, 2000)
    assert chi2_pvalue(c2, p2) > 1e-3 and chi2_pvalue(c3, p3) > 1e-3


def test_the_exactness_check_catches_a_broken_acceptance_rule(small_vocab_setup, monkeypatch):
    model, history, (p2, p3) = small_vocab_setup
    monkeypatch.setattr(steps_mod, "accept_drafts", always_accept)
    engine = Engine(model, KVStrategy("full"), drafter=HashDrafter(VOCAB), spec_k=2)
    c2, c3 = empirical(engine, history, 2000)
    assert min(chi2_pvalue(c2, p2), chi2_pvalue(c3, p3)) < 1e-6


def test_draft_gate_backs_off_after_misses_and_resets_on_acceptance():
    from inference_engine.engine.speculative import DraftGate

    g = DraftGate()
    g.record(0)
    assert g.open()  # one miss: keep drafting
    pattern = []
    for _ in range(4):
        g.record(0)
        skipped = 0
        while not g.open():
            skipped += 1
        pattern.append(skipped)
    assert pattern == [2, 4, 8, 16]
    for _ in range(10):
        g.record(0)
    assert g.skip == DraftGate.MAX_SKIP
    g.skip = 0
    g.record(3)
    g.record(0)
    assert g.open()  # the acceptance reset the run of misses


def test_with_a_measured_cost_blocks_that_accept_too_little_for_it_are_misses_too():
    from inference_engine.engine.speculative import DraftGate

    cost = [1.0, 1.3, 1.6, 1.9, 2.2]  # a verify block of n drafts against a decode step
    g = DraftGate()
    for _ in range(6):  # 1 of 4 accepted each time: 2 tokens for 2.2 steps' time
        g.record(1, 4, cost)
    assert g.gain < 1.0 and g.skip > 0  # paused although every block accepted something
    paying = DraftGate()
    for _ in range(6):  # 3 of 4: 4 tokens for 2.2
        paying.record(3, 4, cost)
    assert paying.gain > 1.5 and paying.misses == 0 and paying.open()
    # after a pause, blocks that pay raise the average back over 1 and reset the run of misses
    g.skip = 0
    for _ in range(4):
        g.record(4, 4, cost)
    assert g.gain >= 1.0 and g.misses == 0 and g.open()
    # without a measured cost (or for a block size it does not cover) only empty blocks count
    plain = DraftGate()
    for _ in range(6):
        plain.record(1, 4, None)
        plain.record(1, 9, cost)
    assert plain.misses == 0 and plain.gain == 1.0


def test_verify_costs_are_measured_on_a_scratch_cache_per_block_size():
    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.tuning import verify_costs

    model = TorchCausalLM.load(tiny_model_dir("llama"), weights="int8")
    engine = Engine(model, KVStrategy("full"), prefill_chunk=32, drafter=SelfDrafter(model), spec_k=3)
    assert engine.verify_cost is None  # until measured (the daemon does at startup)
    cost = engine.measure_verify_cost()
    assert engine.verify_cost is cost and len(cost) == 4 and cost[0] == 1.0
    assert all(a <= b for a, b in zip(cost, cost[1:]))  # more rows never cost less
    costs, share = verify_costs(model, 1, timed_steps=1)
    assert len(costs) == 2 and share == 0.0  # no drafter: the verify blocks alone
    assert Engine(model, KVStrategy("full")).measure_verify_cost() is None  # no drafter, nothing to weigh


def test_a_steps_cost_in_the_gates_table_includes_its_draft():
    """measure_verify_cost adds a draft's own cost (timed in verify_costs' rounds, in decode steps) to every block of
    1..k drafts: the table is what a step that drafts costs in all; draft_cost_in_gate False leaves the verify blocks
    alone."""
    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.prompt_lookup import PromptLookupDrafter
    from inference_engine.engine.tuning import verify_costs

    model = TorchCausalLM.load(tiny_model_dir("llama"), weights="int8")
    lookup = PromptLookupDrafter()
    costs, share = verify_costs(model, 3, timed_steps=2, drafter=lookup)
    assert share > 0 and costs[0] == 1.0 and all(c >= 1.0 + share for c in costs[1:])  # a block never under a step
    engine = Engine(model, KVStrategy("full"), prefill_chunk=32, drafter=lookup, spec_k=3)
    cost = engine.measure_verify_cost()
    assert engine.draft_cost > 0 and cost[0] == 1.0 and all(c >= 1.0 + engine.draft_cost for c in cost[1:])
    plain = Engine(model, KVStrategy("full"), prefill_chunk=32, drafter=lookup, spec_k=3)
    plain.draft_cost_in_gate = False
    plain.measure_verify_cost()
    assert plain.draft_cost == 0.0 and plain.verify_cost[0] == 1.0


def test_the_cost_gate_drafts_less_when_verifying_costs_more_and_changes_nothing():
    """The gate's decisions follow acceptance and the cost table only (no clock here): a costlier table pauses a
    drafter that accepts a little sooner and longer; the tokens are the verifier's either way."""
    model = load_model(str(tiny_model_dir("llama")))
    history = prompt(40, seed=3)
    want, _ = tokens(Engine(model, KVStrategy("full"), prefill_chunk=32), history, 60)
    drafted = {}
    for name, cost in (("cheap", [1.0, 1.0, 1.0, 1.0, 1.0]), ("dear", [1.0, 3.0, 5.0, 7.0, 9.0])):
        engine = Engine(model, KVStrategy("full"), prefill_chunk=32, drafter=SelfDrafter(model, corrupt_every=2), spec_k=4)
        engine.verify_cost = cost
        got, done = tokens(engine, history, 60)
        assert got == want
        drafted[name] = done.drafted_tokens
    assert drafted["dear"] < drafted["cheap"]


def test_a_drafter_that_always_misses_drafts_rarely_and_changes_nothing():
    model = load_model(str(tiny_model_dir("llama")))
    history = prompt(40, seed=3)
    want, _ = tokens(Engine(model, KVStrategy("full"), prefill_chunk=32), history, 60)
    got, done = tokens(Engine(model, KVStrategy("full"), prefill_chunk=32, drafter=HashDrafter(256), spec_k=4), history, 60)
    assert got == want
    assert 0 < done.drafted_tokens < 4 * 30  # drafting paused after the misses (60 steps would draft 240)


def test_an_ungated_engine_drafts_every_step_and_the_gate_pauses_the_same_drafter():
    """Engine.gate_drafts = False (bench_speculative.py --draft-gates none): a drafter that always misses still drafts
    k every step, so its acceptance is measured on every position; the gated engine pauses it; outputs equal AR's."""
    model = load_model(str(tiny_model_dir("llama")))
    strategy = KVStrategy("full")
    history = prompt(20, seed=5)
    want, _ = tokens(Engine(model, strategy, prefill_chunk=32), history, 30)
    gated = Engine(model, strategy, prefill_chunk=32, drafter=HashDrafter(256), spec_k=3)
    ungated = Engine(model, strategy, prefill_chunk=32, drafter=HashDrafter(256), spec_k=3)
    ungated.gate_drafts = False
    got_gated, done_gated = tokens(gated, history, 30)
    got_ungated, done_ungated = tokens(ungated, history, 30)
    assert got_gated == want and got_ungated == want
    assert done_ungated.accepted_tokens == 0  # a hash of the context never matches this model
    # so each of the 29 steps after the first token emits one token and drafts k, or the room left (max_tokens 30)
    assert done_ungated.drafted_tokens == sum(min(3, 30 - n - 1) for n in range(1, 30))
    assert done_gated.drafted_tokens < done_ungated.drafted_tokens
