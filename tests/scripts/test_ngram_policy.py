"""scripts/research/ngram_policy.py's replay: a replayed decode loop (the engine's prompt lookup and draft gate) accepts
exactly the drafts that match the verifier's greedy continuation, as the engine's loop would (pure: no model)."""
import pytest

from factories import load_script


def load():
    return load_script("scripts/research/ngram_policy.py")


def test_a_replay_accepts_up_to_the_first_draft_that_differs():
    mod = load()
    cost = [1.0, 1.1, 1.2, 1.3, 1.4]
    prompt = [5, 6, 7, 8, 9, 5, 6]
    # greedy output: 7 8 (follows 5 6 as in the prompt), then 1 (the prompt had 9), then new tokens
    out = [7, 8, 1, 2, 3, 4]
    r = mod.replay(prompt, out, ("now", 3, 1, [4]), cost, gate="none")
    # step 1 feeds 7: the suffix "5 6 7" matched at 0 -> drafts 8 9 5 6 (room 4): 8 accepted, then 1 emitted (n = 3)
    # step 2 feeds 1: no earlier 1 -> a decode step (n = 4); step 3 feeds 2, step 4 feeds 3: none (n = 6)
    assert (r["steps"], r["drafted"], r["accepted"], r["ar_steps"]) == (4, 4, 1, 5)
    assert r["cost_steps"] == pytest.approx(1.4 + 3 * 1.0)
    assert r["by_match"] == {"3": [1, 4, 1]}
    # capped at 1 token for matches of up to 3 tokens: 1 drafted, 1 accepted
    r1 = mod.replay(prompt, out, ("k1", 3, 1, [1, 1, 1]), cost, gate="none")
    assert (r1["drafted"], r1["accepted"], r1["cost_steps"]) == (1, 1, pytest.approx(1.1 + 3 * 1.0))


def test_drafts_never_reach_past_the_tokens_left():
    mod = load()
    prompt, out = [1, 2, 3, 1, 2, 3, 1, 2], [3, 1, 2]
    r = mod.replay(prompt, out, ("now", 3, 1, [4]), [1.0, 1.1, 1.2, 1.3, 1.4], gate="none")
    # step 1 feeds 3 with room 1 (3 tokens, 1 emitted, the step emits at least one more): 1 draft accepted
    assert (r["steps"], r["drafted"], r["accepted"]) == (1, 1, 1)


def test_the_gates_differ_only_in_what_a_cheap_empty_block_counts_for():
    """Drafts of one token that mostly miss: the engine's gate (a miss only while the moving gain is under 1) keeps
    drafting while the accepted ones pay; the gate before paused after two empty blocks in a row; none never pauses."""
    mod = load()
    cost = [1.0, 1.02, 1.2, 1.3, 1.4]
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    out = [6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5, 0, 2, 8, 8, 4, 1, 9, 7, 1, 6, 9, 3, 9, 9, 3, 7, 5, 1]
    runs = {g: mod.replay(prompt, out, ("one", 5, 1, [1]), cost, g) for g in mod.GATES}
    assert runs["none"]["drafted"] >= runs["cost"]["drafted"] >= runs["cost-before"]["drafted"] > 0
    assert runs["cost"]["drafted"] > runs["cost-before"]["drafted"]


def test_bad_policies_are_refused():
    mod = load()
    assert mod.parse_policy("a=8:2:2/4") == ("a", 8, 2, [2, 4])
    for bad in ("a=2:3:4", "=3:1:4", "a=3:1:0"):
        with pytest.raises(SystemExit, match="bad policy"):
            mod.parse_policy(bad)
