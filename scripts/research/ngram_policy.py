"""Which prompt-lookup policy (`--drafter ngram`) pays most, replayed against the verifier's own greedy output on
prompts the speculative bench never runs (issue 28: `ngram` k = 4 >= 1.5x own AR on code editing).

A greedy verify step's outcome depends only on the verifier's greedy continuation: a block of drafts is accepted up
to its first token that differs from it. So one greedy AR generation per prompt (the engine, int4, --tokens tokens)
lets every policy be replayed exactly as the engine would run it (engine/generate.py: the context is the prompt and
the tokens emitted so far, ending with the token being fed; room for drafts = the tokens left - 1; the cost gate,
engine/speculative.DraftGate, with verify costs measured here by engine/tuning.verify_costs), without running the
model again. Time is modelled as the verify blocks' measured cost in decode steps (drafting itself, ~1 % of decode
time for prompt lookup in results/speculative_ngram_avx512.json, is left out), so a policy's modelled speedup is
(AR decode steps) / (sum over its steps of cost[drafts]); the bench (scripts/bench_speculative.py) is what measures.

Prompts: the held-out prompts of smollm2-135m-dlm per style, in the bench's `spread` order, from index --skip on (the
bench takes the first --prompts-per-style, 8 in its runs of record): the policies are chosen on prompts the bench
does not use. Policies (--policies, comma list of NAME=max_ngram:min_ngram:k_by_match), each under three draft gates (`cost`, the
engine's; `cost-before`, the gate before 2026-12-01; `none`):
  k_by_match: the most tokens drafted after a match of n tokens (PromptLookupDrafter's k_by_match), `4` for every n
              or e.g. `1/2/4` (n = 1, 2, >= 3); the engine's k (--k) caps them all

    python scripts/research/ngram_policy.py --threads 2 --out results/research/ngram_policy_avx512.json
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_common import ROOT, run_metadata, write_json  # noqa: E402

POLICIES = ("before=3:1:4,default=5:1:1/2,max3=3:1:1/2,max8=8:1:1/2,one=5:1:1/1,short3=5:1:1/2/3,min2=5:2:1/2,"
            "k2=5:1:2")  # before: the drafter before 2026-12-01; default: PromptLookupDrafter()'s since


def parse_policy(spec: str) -> tuple[str, int, int, list[int]]:
    name, _, rest = spec.partition("=")
    mx, mn, ks = rest.split(":")
    k_by = [int(k) for k in ks.split("/")]
    if not name or not 1 <= int(mn) <= int(mx) or any(k < 1 for k in k_by):
        raise SystemExit(f"ngram_policy: bad policy {spec!r} (NAME=max_ngram:min_ngram:k[/k...], 1 <= min <= max)")
    return name, int(mx), int(mn), k_by


GATES = ("cost", "cost-before", "none")


def replay(prompt: list, out: list, policy: tuple, cost: list, gate: str) -> dict:
    """The engine's decode loop over `out` (the greedy continuation, out[0] from the prefill) under `policy` and a draft
    gate: `cost` (the engine's DraftGate), `cost-before` (record's by_gain=False: every empty block a miss, the
    gate before 2026-12-01) or `none` (every step drafts)."""
    from inference_engine.engine.prompt_lookup import PromptLookupDrafter
    from inference_engine.engine.speculative import DraftGate

    _, mx, mn, k_by = policy
    drafter = PromptLookupDrafter(max_ngram=mx, min_ngram=mn, k_by_match=tuple(k_by))
    k_max = len(cost) - 1
    g = DraftGate()
    ctx = np.asarray(prompt + out, dtype=np.int64)
    n, steps, spent, drafted, accepted, by_match = 1, 0, 0.0, 0, 0, {}
    while n < len(out):
        room = len(out) - n - 1
        drafts: np.ndarray = ctx[:0]
        match = 0
        if room > 0 and (gate == "none" or g.open()):
            seen = ctx[: len(prompt) + n]
            drafts = drafter.lookup(seen, min(k_max, room))
            match = drafter.match(seen)[1]
        truth = out[n: n + len(drafts)]
        a = 0
        while a < len(drafts) and a < len(truth) and int(drafts[a]) == truth[a]:
            a += 1
        if len(drafts):
            if gate != "none":
                g.record(a, len(drafts), cost, by_gain=gate != "cost-before")
            m = by_match.setdefault(str(min(match, 4)), [0, 0, 0])
            m[0], m[1], m[2] = m[0] + 1, m[1] + len(drafts), m[2] + a
        steps += 1
        spent += cost[len(drafts)]
        drafted, accepted = drafted + len(drafts), accepted + a
        n += a + 1
    ar_steps = len(out) - 1
    return {"ar_steps": ar_steps, "steps": steps, "cost_steps": spent, "drafted": drafted, "accepted": accepted,
            "by_match": by_match}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--styles", default="chat,code,edit")
    p.add_argument("--heldout-from", default="smollm2-135m-dlm")
    p.add_argument("--skip", type=int, default=8, help="the first prompts of each style (the bench's) left out")
    p.add_argument("--prompts", type=int, default=12, help="prompts per style after --skip")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="the most drafts a block takes (the engine's --spec-k)")
    p.add_argument("--cost-steps", type=int, default=40, help="timed forwards per block size (tuning.verify_costs)")
    p.add_argument("--policies", default=POLICIES)
    p.add_argument("--out", default=str(ROOT / "results" / "research" / "ngram_policy.json"))
    args = p.parse_args(argv)
    policies = [parse_policy(s) for s in args.policies.split(",")]

    import json

    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_speculative import order_prompts, run, style_prompts

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.generate import Engine
    from inference_engine.engine.tuning import verify_costs
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model
    from kv_cache_proposer import resolve_checkpoint

    torch.set_num_threads(args.threads)
    meta = run_metadata(vars(args))
    path = resolve_model(args.model)
    model = TorchCausalLM.load(path, weights="int4")
    model.use_step_graphs("auto")
    engine = Engine(model, KVStrategy("sink_window"))
    with model.inference():
        cost, _ = verify_costs(model, args.k, timed_steps=args.cost_steps)
    heldout = json.loads((resolve_checkpoint(args.heldout_from) / "heldout_prompts.json").read_text())
    t0 = time.perf_counter()
    refs: dict = {}
    for style in args.styles.split(","):
        chosen = order_prompts(style_prompts(style, heldout, path))[args.skip: args.skip + args.prompts]
        refs[style] = []
        for pr in chosen:
            toks, _ = run(engine, pr["ids"], args.tokens)
            refs[style].append((pr["key"], list(pr["ids"]), toks))
    gen_s = time.perf_counter() - t0
    by_style: dict = {}
    for style, rows in refs.items():
        by_style[style] = {}
        for gate in GATES:
            for pol in policies:
                runs = [replay(prompt, out, pol, cost, gate) for _, prompt, out in rows]
                tot = {k: sum(r[k] for r in runs) for k in ("ar_steps", "steps", "cost_steps", "drafted", "accepted")}
                by_match: dict = {}
                for r in runs:
                    for m, v in r["by_match"].items():
                        b = by_match.setdefault(m, [0, 0, 0])
                        b[0], b[1], b[2] = b[0] + v[0], b[1] + v[1], b[2] + v[2]
                by_style[style][pol[0] if gate == "cost" else f"{pol[0]}[{gate}]"] = tot | {
                    "modelled_speedup": round(tot["ar_steps"] / tot["cost_steps"], 4),
                    "tokens_per_step": round((tot["ar_steps"]) / max(1, tot["steps"]), 4),
                    "alpha": round(tot["accepted"] / max(1, tot["drafted"]), 4),
                    "by_match_length": {m: {"blocks": v[0], "drafted": v[1], "accepted": v[2]} for m, v in sorted(by_match.items())}}
        print(style, {k: v["modelled_speedup"] for k, v in by_style[style].items()}, flush=True)
    doc = meta | {
        "what": "modelled speedup = AR decode steps / the policy's verify steps weighted by the measured cost of a block of "
                "n drafts (verify_cost[n], decode step = 1); the verifier's greedy output replayed (exact acceptance); "
                "[none]: every step drafts (no gate); [cost-before]: the gate before 2026-12-01 (every empty block a miss)",
        "verify_cost": cost, "generate_s": round(gen_s, 1),
        "policies": {name: {"max_ngram": mx, "min_ngram": mn, "k_by_match_length": kb} for name, mx, mn, kb in policies},
        "prompts": {s: [k for k, _, _ in rows] for s, rows in refs.items()},
        "by_style": by_style}
    write_json(pathlib.Path(args.out), doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
