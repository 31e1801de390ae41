"""Speculative vs plain AR decoding of the same engine, side by side, on held-out prompts.

For each held-out prompt and each drafter in --drafters and k in --ks, greedy-generate --tokens
tokens with speculation and once without; record the acceptance rate alpha = accepted / drafted,
tokens emitted per verifier forward, decode tok/s, the drafter's share of decode time, and check
the outputs are token-identical; per slot j, alpha_j = P(draft j accepted | drafts < j accepted) and the
histogram of accepted drafts per verify step (recorded by wrapping the engine's acceptance rule). Styles (the dLM
drafter's held-out split, never trained on):
  chat  a question about a command (man pages), raw
  code  a Python function's opening, to be continued (code completion)
  edit  the same held-out function inside a chat-templated editing request ("add type hints,
        reply with the whole function"): the answer re-states the input, as agents' edits do
Writes results/speculative.json and .png (one file: every drafter and k of the run). The arms of one
prompt run back to back, so on a loaded machine the ratios are side by side while absolute tok/s move;
the JSON records the load average at start and end.
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
        if getattr(inner, "capture_layers", ()):  # v2: the engine captures these layers and keeps the drafter's cache
            self.capture_layers, self.new_state, self.config = inner.capture_layers, inner.new_state, inner.config

    def draft(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self.inner.draft(*a, **kw)
        finally:
            self.seconds += time.perf_counter() - t
            self.calls += 1


class AcceptanceLog:
    """Wraps steps.accept_drafts to record (drafted, accepted) of every verify step of the current arm."""

    def __init__(self):
        import inference_engine.engine.steps as steps_mod

        self.rows: list[tuple[int, int]] = []
        inner = steps_mod.accept_drafts

        def accept(drafts, logits, params, gen):
            acc, nxt = inner(drafts, logits, params, gen)
            self.rows.append((len(drafts), len(acc)))
            return acc, nxt

        steps_mod.accept_drafts = accept


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
    ap.add_argument("--drafters", default="ngram,smollm2-135m-dlm,smollm2-135m-dflash",
                    help="comma list: ngram (prompt lookup; ngram+before: as before 2026-12-01) and/or dLM drafter "
                         "names/dirs")
    ap.add_argument("--weights", default="int4", choices=("fp32", "int8", "int4"))
    ap.add_argument("--styles", default="chat,code,edit")
    ap.add_argument("--heldout-from", default="smollm2-135m-dlm",
                    help="drafter checkpoint whose held-out prompts are used (the same set for every drafter)")
    ap.add_argument("--ks", default="2,4,8,16")
    ap.add_argument("--prompt-order", default="spread", choices=("spread", "file"),
                    help="spread: the first prompt of every source key, then the second of each, ... (the held-out file "
                         "groups prompts by key: its first 9 code prompts are one module); file: the file's order, as runs "
                         "before 2026-11-28 took it")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts-per-style", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-strategy", default="sink_window")
    ap.add_argument("--compile", default="off", choices=("off", "auto", "on"),
                    help="the step's dense work through inductor's segments (on) or eager (off: the CPU default)")
    ap.add_argument("--out", default=str(ROOT / "results" / "speculative.json"))
    ap.add_argument("--v2-drafter", default="smollm2-135m-dflash", help="the drafter issue 18's targets are checked on")
    ap.add_argument("--time-budget-min", type=float, default=0.0, help="stop starting prompts after this long (0 = all)")
    ap.add_argument("--draft-gates", default="cost",
                    help="comma list; cost: the daemon's gate, acceptance weighed against verify blocks' cost measured "
                         "here (Engine.measure_verify_cost: verify block and draft); cost-before: that gate as before "
                         "2026-12-01 (every empty block a miss too, the draft's cost not counted); cost-verify: the "
                         "gate with the verify blocks' cost only (the draft's not counted, as before 2026-12-01); "
                         "misses: only empty blocks pause drafting (before 2026-11-27); none: every step drafts k (the "
                         "drafter's acceptance apart from the timing the cost gate depends on). With several, each "
                         "drafter runs under each, arms after the first named drafter[gate]")
    args = ap.parse_args()
    load_at_start = os.getloadavg()

    import torch

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.generate import Engine
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model
    from kv_cache_proposer import load_drafter, resolve_checkpoint

    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    model = TorchCausalLM.load(path, weights=args.weights)
    model.use_step_graphs(args.compile)
    drafters = {}
    for name in args.drafters.split(","):
        if name in ("ngram", "ngram+before"):  # +before: the prompt lookup before 2026-12-01 (3-grams, k after any match)
            from inference_engine.engine.prompt_lookup import PromptLookupDrafter

            drafters[name] = TimedDrafter(PromptLookupDrafter() if name == "ngram" else
                                          PromptLookupDrafter(max_ngram=3, k_by_match=()))
        else:  # NAME as the daemon loads it (weights "auto": a v2 drafter int8 on the CPU); NAME+fp32 / NAME+int8
            base, _, variant = name.partition("+")
            if variant not in ("", "fp32", "int8"):
                raise SystemExit(f"bench_speculative: unknown drafter variant +{variant} (+fp32 or +int8)")
            drafters[name] = TimedDrafter(load_drafter(base, verifier_embed=model.embed, verifier_lm_head=model.lm_head,
                                                       weights=variant or "auto"))
    heldout = json.loads((resolve_checkpoint(args.heldout_from) / "heldout_prompts.json").read_text())
    styles = args.styles.split(",")
    per_style = {style: order_prompts(style_prompts(style, heldout, path), args.prompt_order)[: args.prompts_per_style]
                 for style in styles}
    # styles interleaved, so a run stopped by --time-budget-min still covers each style about equally
    prompts = [(style, per_style[style][i]) for i in range(args.prompts_per_style) for style in styles if i < len(per_style[style])]
    ks = [int(k) for k in args.ks.split(",")]
    strategy = KVStrategy(args.kv_strategy)
    ar = Engine(model, strategy)
    gates = args.draft_gates.split(",")
    if not gates or any(g not in ("cost", "cost-before", "cost-verify", "misses", "none") for g in gates):
        raise SystemExit(f"--draft-gates: cost, cost-before, cost-verify, misses and/or none, got {args.draft_gates!r}")
    label = {(d, g): d if g == gates[0] else f"{d}[{g}]" for d in drafters for g in gates}
    arms = [(label[d, g], k) for d in drafters for g in gates for k in ks]
    specs = {(label[d, g], k): Engine(model, strategy, drafter=drafters[d], spec_k=k) for d in drafters for g in gates
             for k in ks}
    verify_cost: dict = {}
    for d in drafters:
        for k in ks:
            for g in ("cost", "cost-before", "cost-verify"):  # measured per drafter and k (a draft's cost is its own)
                if g in gates:
                    eng = specs[label[d, g], k]
                    eng.draft_cost_in_gate = g == "cost"
                    eng.measure_verify_cost()
                    verify_cost[f"{d}/{g}/{k}"] = eng.verify_cost
                    eng.gate_by_gain = g != "cost-before"
            if "none" in gates:
                specs[label[d, "none"], k].gate_drafts = False
    drafter_of = {label[d, g]: d for d in drafters for g in gates}

    log = AcceptanceLog()
    for eng in (ar, *specs.values()):  # warm-up: first-call allocations and kernel selection stay out of the timings
        run(eng, prompts[0][1]["ids"], 8)
    per_prompt = []
    t_bench = time.perf_counter()
    for i, (style, p) in enumerate(prompts):
        if args.time_budget_min and time.perf_counter() - t_bench > args.time_budget_min * 60:
            print(f"time budget spent: {i} of {len(prompts)} prompts run", flush=True)
            break
        ids = p["ids"]
        row = {"key": p["key"], "style": style, "prompt_tokens": len(ids)}
        t0 = time.perf_counter()
        ref, done = run(ar, ids, args.tokens)
        row["ar"] = {"decode_s": done.total_seconds - done.time_to_first_token_seconds, "generated": done.generated_tokens}
        for (d, k), eng in specs.items():
            drafter = drafters[drafter_of[d]]
            drafter.seconds = drafter.calls = 0
            log.rows = []
            toks, done = run(eng, ids, args.tokens)
            steps = max(1, done.generated_tokens - 1 - done.accepted_tokens)
            row[arm_key(d, k)] = {
                "drafted": done.drafted_tokens,
                "accepted": done.accepted_tokens,
                "verifier_steps": steps,
                "decode_s": done.total_seconds - done.time_to_first_token_seconds,
                "drafter_s": drafter.seconds,
                "generated": done.generated_tokens,
                "identical_to_ar": toks == ref,
                "blocks": [list(r) for r in log.rows],  # (drafted, accepted) per verify step
            }
        per_prompt.append(row)
        print(f"[{i + 1}/{len(prompts)}] {style} {p['key']}: " + " ".join(
            f"{arm_key(d, k)} a={row[arm_key(d, k)]['accepted']}/{row[arm_key(d, k)]['drafted']}" for d, k in arms)
            + f" ({time.perf_counter() - t0:.1f}s)", flush=True)

    def agg(rows, key):
        d = sum(r[key]["drafted"] for r in rows)
        a = sum(r[key]["accepted"] for r in rows)
        steps = sum(r[key]["verifier_steps"] for r in rows)
        gen = sum(r[key]["generated"] - 1 for r in rows)
        dec = sum(r[key]["decode_s"] for r in rows)
        ar_dec = sum(r["ar"]["decode_s"] for r in rows)
        ar_gen = sum(r["ar"]["generated"] - 1 for r in rows)
        return {
            "alpha": a / d if d else 0.0,
            "mean_accepted_per_step": a / steps,
            "mean_tokens_per_verifier_step": gen / steps,
            "spec_decode_tok_s": gen / dec,
            "ar_decode_tok_s": ar_gen / ar_dec,
            "speedup": (gen / dec) / (ar_gen / ar_dec),
            "drafter_share_of_decode": sum(r[key]["drafter_s"] for r in rows) / dec,
            "identical_to_ar": sum(r[key]["identical_to_ar"] for r in rows),
            "prompts": len(rows),
            **per_slot(rows, key),
        }

    groups = {style: [r for r in per_prompt if r["style"] == style] for style in styles} | {"all": per_prompt}
    summary = {style: {arm_key(d, k): agg(rows, arm_key(d, k)) for d, k in arms} for style, rows in groups.items()}
    # Issue 14's targets: the best drafter >= 1.3x own AR on code editing, never below 1.0x on chat.
    best = {style: max(summary[style], key=lambda a: summary[style][a]["speedup"]) for style in summary}
    targets = {
        "best_arm": best,
        "best_speedup": {style: summary[style][a]["speedup"] for style, a in best.items()},
        "edit_best_speedup_min": 1.3,
        "met_edit": summary["edit"][best["edit"]]["speedup"] >= 1.3 if "edit" in summary else None,
        "chat_speedup_floor": 1.0,
        "met_chat_floor": summary["chat"][best["chat"]]["speedup"] >= 1.0 if "chat" in summary else None,
        "all_identical_to_ar": all(v["identical_to_ar"] == v["prompts"] for s in summary.values() for v in s.values()),
    }
    if "ngram/k4" in summary.get("all", {}):  # issue 28: ngram k = 4 >= 1.5x own AR on code editing, >= 1.0x on chat
        targets["issue28_ngram_k4"] = {s: {"speedup": round(summary[s]["ngram/k4"]["speedup"], 3), "target": t,
                                           "met": summary[s]["ngram/k4"]["speedup"] >= t}
                                       for s, t in (("edit", 1.5), ("chat", 1.0)) if s in summary}
        targets["issue28_ngram_k4"]["gate"] = gates[0]
    v2 = issue18_targets(summary, args.v2_drafter) if args.v2_drafter in drafters else None
    out = run_metadata(vars(args) | {"verify_cost_measured": {str(k): [round(c, 3) for c in v] for k, v in verify_cost.items()},
                                     "n_prompts": len(per_prompt), "heldout_split_rule": heldout.get("split_rule"),
                                     "edit_instruction": EDIT_INSTRUCTION})
    out["machine"]["load_average_at_start"], out["machine"]["load_average_at_end"] = load_at_start, os.getloadavg()
    out |= {"summary": summary, "targets": targets, "targets_issue18": v2, "prompts": per_prompt}
    import pathlib

    out_path = pathlib.Path(args.out)
    write_json(out_path, out)
    plot(summary, list(dict.fromkeys(d for d, _ in arms)), ks, styles, out_path.with_suffix(".png"))
    print(json.dumps({s: {a: round(v["speedup"], 3) for a, v in summary[s].items()} for s in summary}, indent=1))
    print(targets)
    print(json.dumps(v2, indent=1))
    return 0


def per_slot(rows, key) -> dict:
    """alpha per block slot (accepted given the slots before it were) and the accepted-count histogram."""
    blocks = [b for r in rows for b in r[key].get("blocks", [])]
    kmax = max((d for d, _ in blocks), default=0)
    alpha = []
    for j in range(1, kmax + 1):
        reached = sum(1 for d, a in blocks if d >= j and a >= j - 1)
        alpha.append(round(sum(1 for d, a in blocks if a >= j) / reached, 4) if reached else None)
    hist = [sum(1 for _, a in blocks if a == n) for n in range(kmax + 1)]
    return {"alpha_per_slot": alpha, "accepted_histogram": hist, "verify_steps": len(blocks),
            "mean_accepted_per_verify_step": sum(a for _, a in blocks) / len(blocks) if blocks else 0.0}


def issue18_targets(summary: dict, drafter: str) -> dict:
    """Issue 18: at k = 4, tokens per verify step >= 2.5 on code/editing and >= 2.0 on chat; greedy speedup
    >= 1.8x / 1.4x over own AR; outputs exact. Tokens per verify step = accepted drafts + the verifier's own
    token (the acceptance length tau of EAGLE/DFlash); verify steps counted over the steps that drafted."""
    out = {"drafter": drafter, "k": 4, "tokens_per_step_min": {"code": 2.5, "edit": 2.5, "chat": 2.0},
           "speedup_min": {"code": 1.8, "edit": 1.8, "chat": 1.4}, "measured": {}}
    for style in ("chat", "code", "edit"):
        arm = summary.get(style, {}).get(arm_key(drafter, 4))
        if arm is None:
            continue
        tau = 1.0 + arm["mean_accepted_per_verify_step"]
        out["measured"][style] = {
            "tokens_per_verify_step": round(tau, 4), "mean_tokens_per_verifier_forward": round(arm["mean_tokens_per_verifier_step"], 4),
            "speedup": round(arm["speedup"], 4), "alpha_per_slot": arm["alpha_per_slot"],
            "identical_to_ar": f"{arm['identical_to_ar']}/{arm['prompts']}",
            "met_tokens_per_step": tau >= out["tokens_per_step_min"][style],
            "met_speedup": arm["speedup"] >= out["speedup_min"][style],
        }
    return out


EDIT_INSTRUCTION = "Add type hints to this Python function. Reply with the complete function only."


def arm_key(drafter: str, k: int) -> str:
    return f"{drafter}/k{k}"


def order_prompts(prompts: list, order: str = "spread") -> list:
    """`spread`: round-robin over the prompts' source keys in first-seen order, each key's prompts in file order, so the
    first N prompts come from as many sources as N allows; `file`: unchanged."""
    if order == "file":
        return list(prompts)
    by_key: dict = {}
    for p in prompts:
        by_key.setdefault(p["key"], []).append(p)
    groups = list(by_key.values())
    return [g[i] for i in range(max((len(g) for g in groups), default=0)) for g in groups if i < len(g)]


def style_prompts(style: str, heldout: dict, model_path) -> list:
    """Held-out prompts of a style; `edit` wraps the held-out code in a chat-templated editing request
    (the chat template is applied here, by the client, as the SDK's chat helper does)."""
    if style != "edit":
        return heldout[style]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    out = []
    for p in heldout["code"]:
        code = tok.decode(p["ids"][:200])
        msg = [{"role": "user", "content": f"{EDIT_INSTRUCTION}\n\n```python\n{code}\n```"}]
        text = tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=False)
        out.append({"key": p["key"], "ids": tok(text, add_special_tokens=False)["input_ids"]})
    return out


def plot(summary, drafters, ks, styles, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for style in styles:
        for d in drafters:
            s, lab = summary[style], f"{style} {d}"
            axes[0].plot(ks, [s[arm_key(d, k)]["alpha"] for k in ks], marker="o", label=lab)
            axes[1].plot(ks, [s[arm_key(d, k)]["mean_tokens_per_verifier_step"] for k in ks], marker="o", label=lab)
            axes[2].plot(ks, [s[arm_key(d, k)]["speedup"] for k in ks], marker="o", label=lab)
    axes[2].axhline(1.0, ls=":", c="gray", lw=0.8)
    axes[2].axhline(1.3, ls="--", c="gray", lw=0.8)
    for a, t in zip(axes, ("acceptance rate alpha", "tokens per verifier step", "decode speedup vs own AR")):
        a.set(title=t, xlabel="k (drafted tokens per step)", xscale="log", xticks=ks, xticklabels=ks)
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    sys.exit(main())
