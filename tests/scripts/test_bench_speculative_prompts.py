"""scripts/bench_speculative.py's prompt order: the held-out file groups prompts by source key (its first 9 code
prompts are one module), so the first N prompts of a style must be spread over keys, each prompt exactly once."""
import json

from factories import ROOT, load_script


def load():
    return load_script("scripts/bench_speculative.py")


def test_spread_takes_one_prompt_per_key_before_a_second():
    order = load().order_prompts
    prompts = [{"key": k, "i": i} for i, k in enumerate("aaaabccd")]
    got = order(prompts, "spread")
    assert [p["key"] for p in got] == list("abcdacaa") and sorted(p["i"] for p in got) == list(range(8))
    assert order(prompts, "file") == prompts and order([], "spread") == []


def test_the_shipped_held_out_code_prompts_are_spread():
    held = json.loads((ROOT / "kv_cache_proposer" / "checkpoints" / "smollm2-135m-dlm" / "heldout_prompts.json").read_text())
    first = load().order_prompts(held["code"], "spread")[:8]
    keys = {p["key"] for p in held["code"]}
    assert len({p["key"] for p in first}) == min(8, len(keys))
