"""Speculative vs plain AR decoding of the same engine, side by side, on held-out prompts.

For each held-out prompt (chat-style and code-style, never seen in drafter training) and each
k in --ks, greedy-generate --tokens tokens with speculation and once without; record the
acceptance rate alpha = accepted / drafted, tokens emitted per verifier forward, decode tok/s,
the drafter's share of decode time, and check the outputs are token-identical. Writes
results/speculative.json and .png.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import ROOT, run_metadata, write_json  # noqa: E402


class TimedDrafter:
    """Wraps a drafter to account the time spent drafting."""

    def __init__(self, inner):
        self.inner, self.seconds, self.calls = inner, 0.0, 0
        self.context_window, self.uses_verifier_hidden = inner.context_window, inner.uses_verifier_hidden

    def draft(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self.inner.draft(*a, **kw)
        finally:
            self.seconds += time.perf_counter() - t
            self.calls += 1


def run(engine, ids, n):
    from inference_engine.engine.events import GenerationDone, TokenGenerated
    from inference_engine.engine.generate import GenerateParams

    toks, done = [], None
    for ev in engine.generate(engine.new_session_kv(), ids, GenerateParams(max_tokens=n)):
        if isinstance(ev, TokenGenerated):
            toks.append(ev.token_id)
        elif isinstance(ev, GenerationDone):
            done = ev
    return toks, done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="smollm2-135m-dlm", help="a dLM drafter name/dir, or ngram (prompt lookup)")
    ap.add_argument("--weights", default="fp32", choices=("fp32", "int8", "int4"))
    ap.add_argument("--heldout-from", default="smollm2-135m-dlm",
                    help="drafter checkpoint whose held-out prompts are used (the same set for every drafter)")
    ap.add_argument("--ks", default="2,4,8,16")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts-per-style", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-strategy", default="sink_window")
    ap.add_argument("--out", default=str(ROOT / "results" / "speculative.json"))
    args = ap.parse_args()

    import torch

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.generate import Engine
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model
    from kv_cache_proposer import load_drafter, resolve_checkpoint

    torch.set_num_threads(args.threads)
    model = TorchCausalLM.load(resolve_model(args.model), weights=args.weights)
    if args.drafter == "ngram":
        from inference_engine.engine.prompt_lookup import PromptLookupDrafter

        drafter = TimedDrafter(PromptLookupDrafter())
    else:
        drafter = TimedDrafter(load_drafter(args.drafter, verifier_embed=model.embed, verifier_lm_head=model.lm_head))
    heldout = json.loads((resolve_checkpoint(args.heldout_from) / "heldout_prompts.json").read_text())
    prompts = [(style, p) for style in ("chat", "code") for p in heldout[style][: args.prompts_per_style]]
    ks = [int(k) for k in args.ks.split(",")]
    strategy = KVStrategy(args.kv_strategy)
    ar = Engine(model, strategy)
    specs = {k: Engine(model, strategy, drafter=drafter, spec_k=k) for k in ks}

    per_prompt = []
    for i, (style, p) in enumerate(prompts):
        ids = p["ids"]
        row = {"key": p["key"], "style": style, "prompt_tokens": len(ids)}
        t0 = time.perf_counter()
        ref, done = run(ar, ids, args.tokens)
        row["ar"] = {"decode_s": done.total_seconds - done.time_to_first_token_seconds, "generated": done.generated_tokens}
        for k, eng in specs.items():
            drafter.seconds = drafter.calls = 0
            toks, done = run(eng, ids, args.tokens)
            steps = max(1, done.generated_tokens - 1 - done.accepted_tokens)
            row[f"k{k}"] = {
                "drafted": done.drafted_tokens,
                "accepted": done.accepted_tokens,
                "verifier_steps": steps,
                "decode_s": done.total_seconds - done.time_to_first_token_seconds,
                "drafter_s": drafter.seconds,
                "generated": done.generated_tokens,
                "identical_to_ar": toks == ref,
            }
        per_prompt.append(row)
        print(f"[{i + 1}/{len(prompts)}] {style} {p['key']}: " + " ".join(
            f"k{k} a={row[f'k{k}']['accepted']}/{row[f'k{k}']['drafted']}" for k in ks) + f" ({time.perf_counter() - t0:.1f}s)", flush=True)

    def agg(rows, k):
        d = sum(r[f"k{k}"]["drafted"] for r in rows)
        a = sum(r[f"k{k}"]["accepted"] for r in rows)
        steps = sum(r[f"k{k}"]["verifier_steps"] for r in rows)
        gen = sum(r[f"k{k}"]["generated"] - 1 for r in rows)
        dec = sum(r[f"k{k}"]["decode_s"] for r in rows)
        ar_dec = sum(r["ar"]["decode_s"] for r in rows)
        ar_gen = sum(r["ar"]["generated"] - 1 for r in rows)
        return {
            "alpha": a / d if d else 0.0,
            "mean_accepted_per_step": a / steps,
            "mean_tokens_per_verifier_step": gen / steps,
            "spec_decode_tok_s": gen / dec,
            "ar_decode_tok_s": ar_gen / ar_dec,
            "speedup": (gen / dec) / (ar_gen / ar_dec),
            "drafter_share_of_decode": sum(r[f"k{k}"]["drafter_s"] for r in rows) / dec,
            "all_identical_to_ar": all(r[f"k{k}"]["identical_to_ar"] for r in rows),
        }

    summary = {style: {f"k{k}": agg([r for r in per_prompt if r["style"] == style], k) for k in ks} for style in ("chat", "code")}
    summary["all"] = {f"k{k}": agg(per_prompt, k) for k in ks}
    best = max(ks, key=lambda k: summary["all"][f"k{k}"]["speedup"])
    targets = {
        "alpha_k2_min": 0.40,
        "alpha_k2": summary["all"]["k2"]["alpha"] if 2 in ks else None,
        "met_alpha": (summary["all"]["k2"]["alpha"] >= 0.40) if 2 in ks else None,
        "speedup_min": 1.5,
        "best_k": best,
        "best_speedup": summary["all"][f"k{best}"]["speedup"],
        "met_speedup": summary["all"][f"k{best}"]["speedup"] >= 1.5,
    }
    out = run_metadata(vars(args) | {"n_prompts": len(prompts), "heldout_split_rule": heldout.get("split_rule")})
    out |= {"summary": summary, "targets": targets, "prompts": per_prompt}
    import pathlib

    path = pathlib.Path(args.out)
    write_json(path, out)
    plot(summary, ks, path.with_suffix(".png"))
    print(json.dumps(summary["all"], indent=1))
    print(targets)
    return 0


def plot(summary, ks, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for style in ("chat", "code", "all"):
        s = summary[style]
        axes[0].plot(ks, [s[f"k{k}"]["alpha"] for k in ks], marker="o", label=style)
        axes[1].plot(ks, [s[f"k{k}"]["mean_tokens_per_verifier_step"] for k in ks], marker="o", label=style)
        axes[2].plot(ks, [s[f"k{k}"]["speedup"] for k in ks], marker="o", label=style)
    axes[0].axhline(0.4, ls="--", c="gray", lw=0.8)
    axes[2].axhline(1.0, ls=":", c="gray", lw=0.8)
    axes[2].axhline(1.5, ls="--", c="gray", lw=0.8)
    for a, t in zip(axes, ("acceptance rate alpha", "tokens per verifier step", "decode speedup vs AR")):
        a.set(title=t, xlabel="k (drafted tokens per step)", xscale="log", xticks=ks, xticklabels=ks)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    sys.exit(main())
