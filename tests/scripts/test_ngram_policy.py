"""scripts/research/ngram_policy.py's replay: its lookup is the engine's prompt lookup, and a replayed decode loop
accepts exactly the drafts that match the verifier's greedy continuation, as the engine's loop would (pure: no model)."""
import numpy as np
import pytest

from factories import load_script


def load():
    return load_script("scripts/research/ngram_policy.py")


@pytest.mark.parametrize("mx,mn", [(3, 1), (5, 2), (8, 1)])
def test_the_lookup_is_the_engines(mx, mn):
    from inference_engine.engine.prompt_lookup import PromptLookupDrafter

    mod, rng = load(), np.random.default_rng(0)
    drafter = PromptLookupDrafter(max_ngram=mx, min_ngram=mn)
    for _ in range(200):
        ctx = rng.integers(0, 6, size=int(rng.integers(2, 40)))
        start, n = mod.lookup(ctx, mx, mn)
        want = drafter.lookup(ctx, 4)
        got = ctx[start:start + 4] if n else ctx[:0]
        assert np.array_equal(got, want)


def test_a_replay_accepts_up_to_the_first_draft_that_differs():
    mod = load()
    cost = [1.0, 1.1, 1.2, 1.3, 1.4]
    prompt = [5, 6, 7, 8, 9, 5, 6]
    # greedy output: 7 8 (follows 5 6 as in the prompt), then 1 (the prompt had 9), then new tokens
    out = [7, 8, 1, 2, 3, 4]
    r = mod.replay(prompt, out, ("now", 3, 1, [4]), cost, gate=False)
    # step 1 feeds 7: the suffix "5 6 7" matched at 0 -> drafts 8 9 5 6 (room 4): 8 accepted, then 1 emitted (n = 3)
    # step 2 feeds 1: no earlier 1 -> a decode step (n = 4); step 3 feeds 2, step 4 feeds 3: none (n = 6)
    assert (r["steps"], r["drafted"], r["accepted"], r["ar_steps"]) == (4, 4, 1, 5)
    assert r["cost_steps"] == pytest.approx(1.4 + 3 * 1.0)
    assert r["by_match"] == {"3": [1, 4, 1]}
    # drafting k by the match's length: 1 token for a 3-token match here would be 1 drafted, 1 accepted
    r1 = mod.replay(prompt, out, ("k1", 3, 1, [1]), cost, gate=False)
    assert (r1["drafted"], r1["accepted"], r1["cost_steps"]) == (1, 1, pytest.approx(1.1 + 3 * 1.0))


def test_drafts_never_reach_past_the_tokens_left():
    mod = load()
    prompt, out = [1, 2, 3, 1, 2, 3, 1, 2], [3, 1, 2]
    r = mod.replay(prompt, out, ("now", 3, 1, [4]), [1.0, 1.1, 1.2, 1.3, 1.4], gate=False)
    # step 1 feeds 3 with room 1 (3 tokens, 1 emitted, the step emits at least one more): 1 draft accepted
    assert (r["steps"], r["drafted"], r["accepted"]) == (1, 1, 1)


def test_bad_policies_are_refused():
    mod = load()
    assert mod.parse_policy("a=8:2:2/4") == ("a", 8, 2, [2, 4])
    for bad in ("a=2:3:4", "=3:1:4", "a=3:1:0"):
        with pytest.raises(SystemExit, match="bad policy"):
            mod.parse_policy(bad)
