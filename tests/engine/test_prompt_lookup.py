"""`--drafter ngram`: prompt lookup proposes what followed the latest earlier match, nothing when
there is none, and never changes the verifier's output."""
import numpy as np
import pytest
import torch

from factories import load_model, tiny_model_dir
from inference_engine.engine.events import GenerationDone, TokenGenerated
from inference_engine.engine.generate import Engine
from inference_engine.engine.prompt_lookup import PromptLookupDrafter
from inference_engine.engine.requests import GenerateParams
from inference_engine.engine.tuning import fastest_thread_count, thread_candidates
from inference_engine.kv.strategy import KVStrategy


def test_lookup_prefers_the_longest_suffix_and_the_latest_match():
    d = PromptLookupDrafter(max_ngram=3)
    ctx = np.array([5, 6, 7, 8, 1, 6, 7, 9, 2, 5, 6, 7])
    assert d.lookup(ctx, 3).tolist() == [8, 1, 6]  # "5 6 7" matched at 0 (trigram beats the later "6 7")
    assert d.lookup(np.array([1, 2, 3, 9, 2, 3, 4, 2, 3]), 2).tolist() == [4, 2]  # latest "2 3"
    assert d.lookup(np.array([1, 2, 3, 4]), 3).size == 0  # no earlier occurrence of anything: no draft
    assert d.lookup(np.array([7, 7, 7]), 4).tolist() == [7]  # what follows, up to the end


def test_a_short_match_drafts_only_what_it_earns():
    """k_by_match caps a match of n tokens at k_by_match[n - 1] drafts (default: 1 after one token, 2 after two, k
    from three on); match() says where the continuation starts and how long the matched suffix is."""
    ctx = np.array([5, 6, 7, 8, 1, 6, 7, 9, 2, 5, 6, 7])
    d = PromptLookupDrafter()
    assert d.match(ctx) == (3, 3) and d.lookup(ctx, 4).tolist() == [8, 1, 6, 7]  # three tokens matched: k
    two = np.array([1, 2, 3, 9, 4, 2, 3])
    assert d.match(two) == (3, 2) and d.lookup(two, 4).tolist() == [9, 4]  # "2 3": two drafts
    one = np.array([1, 2, 3, 9, 4, 2, 8, 3])
    assert d.match(one) == (3, 1) and d.lookup(one, 4).tolist() == [9]  # "3": one draft
    assert PromptLookupDrafter(k_by_match=()).lookup(one, 4).tolist() == [9, 4, 2, 8]  # uncapped: as before
    assert d.match(np.array([1, 2, 3])) == (-1, 0) and d.lookup(np.array([1, 2, 3]), 4).size == 0
    with pytest.raises(ValueError, match="k_by_match"):
        PromptLookupDrafter(k_by_match=(0, 2))


def test_ngram_speculation_is_exact_and_drafts_only_on_matches():
    m = load_model(str(tiny_model_dir("llama")))
    phrase = torch.randint(3, 200, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    history = phrase * 5  # repetitive, as re-quoted tool output is

    def run(engine):
        evs = list(engine.generate(engine.new_session_kv(), history, GenerateParams(max_tokens=24)))
        return [e.token_id for e in evs if isinstance(e, TokenGenerated)], next(e for e in evs if isinstance(e, GenerationDone))

    ref, _ = run(Engine(m, KVStrategy("full"), prefill_chunk=32))
    got, done = run(Engine(m, KVStrategy("full"), prefill_chunk=32, drafter=PromptLookupDrafter(), spec_k=4))
    assert got == ref
    assert done.drafted_tokens > 0
    fresh = list(range(100, 140))  # nothing repeats: no drafts at all
    e = Engine(m, KVStrategy("full"), prefill_chunk=32, drafter=PromptLookupDrafter(min_ngram=3), spec_k=4)
    evs = list(e.generate(e.new_session_kv(), fresh, GenerateParams(max_tokens=1)))
    assert next(x for x in evs if isinstance(x, GenerationDone)).drafted_tokens == 0


def test_threads_auto_measures_every_candidate():
    m = load_model(str(tiny_model_dir("llama")))
    best, timings = fastest_thread_count(m, [1, 2], timed_steps=2)
    assert set(timings) == {1, 2} and best in (1, 2) and all(t > 0 for t in timings.values())
    assert thread_candidates(2) == [1, 2] and thread_candidates(8) == [1, 2, 4, 8] and thread_candidates(6) == [1, 2, 4, 6]
