#!/usr/bin/env python
"""Measure a drafter's greedy acceptance α (k = 2, 4, 8) on its held-out prompts against the
transformers verifier, plus its per-call latency, and record both in the checkpoint manifest.

    python scripts/training/eval_drafter.py --drafter smollm2-135m-dlm \
        --verifier ~/.cache/kakeya/models/smollm2-135m-instruct
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from kv_cache_proposer.drafter import MANIFEST_FILE, load_drafter, resolve_checkpoint  # noqa: E402
from kv_cache_proposer.training import dataset  # noqa: E402
from kv_cache_proposer.training.acceptance import acceptance, draft_latency_ms, verifier_continuations  # noqa: E402
from kv_cache_proposer.training.teacher import default_teacher_dir, load_verifier, verifier_embed_and_head  # noqa: E402


@torch.inference_mode()
def verifier_step_ms(model, ctx: int = 128, reps: int = 10) -> float:
    """Median time of one transformers decode step (1 new token on a KV cache of `ctx` tokens)."""
    import statistics
    import time

    ids = torch.randint(0, 1000, (1, ctx))
    out = model(input_ids=ids, use_cache=True)
    past, nxt, ts = out.past_key_values, torch.tensor([[5]]), []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        ts.append((time.perf_counter() - t0) * 1000)
        past = out.past_key_values
    return round(statistics.median(ts), 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="smollm2-135m-dlm")
    ap.add_argument("--verifier", default="~/.cache/kakeya/models/smollm2-135m-instruct")
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--stride", type=int, default=2)
    ap.add_argument("--limit", type=int, default=60, help="prompts per style")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--threshold", type=float, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tag", default="", help="store under acceptance_<tag> instead of replacing the headline figures")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--no-hidden", action="store_true", help="ablation: draft without the verifier hidden states")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ck = resolve_checkpoint(args.drafter)
    model, tok = load_verifier(pathlib.Path(args.verifier).expanduser())
    embed, head = verifier_embed_and_head(model)
    drafter = load_drafter(str(ck), verifier_embed=embed, verifier_lm_head=head)
    held = json.loads((ck / "heldout_prompts.json").read_text())
    report = {"verifier_max_new_tokens": args.max_new, "stride": args.stride, "verifier_hidden": not args.no_hidden,
              "steps": args.steps or drafter.config.denoise_steps,
              "threshold": drafter.config.confidence_threshold if args.threshold is None else args.threshold}
    eos, pad = dataset.eos_ids(model, tok), dataset.pad_id(model, tok)
    allv = {}
    for style in ("chat", "code"):
        prompts = [p["ids"] for p in held[style][: args.limit]]
        cache = default_teacher_dir(ck.name) / f"eval-{style}-{args.limit}-{args.max_new}.pt"
        if cache.exists():
            seqs, hidden = torch.load(cache)
        else:  # the verifier's greedy continuations are the same for every drafter config: compute once
            seqs, hidden = verifier_continuations(model, prompts, args.max_new, eos, pad)
            cache.parent.mkdir(parents=True, exist_ok=True)
            torch.save((seqs, hidden), cache)
        r = acceptance(drafter, seqs, hidden, [len(p) for p in prompts], stride=args.stride, steps=args.steps,
                       threshold=args.threshold, use_hidden=not args.no_hidden)
        r["prompts"] = len(prompts)
        gen = torch.tensor([t for s, p in zip(seqs, prompts) for t in s[len(p):]])
        r["draft_vocab_coverage"] = round(torch.isin(gen, drafter.model.draft_vocab.cpu()).float().mean().item(), 4)
        report[style] = r
        allv[style] = r
        print(style, json.dumps(r))
    w = {s: allv[s]["positions"]["2"] for s in allv}
    tot = sum(w.values())
    for k in (2, 4, 8):
        report[f"alpha_k{k}"] = round(sum(allv[s][f"alpha_k{k}"] * w[s] for s in allv) / tot, 4)
    report["latency_ms_per_draft_call"] = {
        "context_tokens": drafter.context_window, "threads": args.threads, "by_k": draft_latency_ms(
            drafter, embed.shape[1], steps=args.steps, threshold=args.threshold, vocab=embed.shape[0]),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus (shared)",
    }
    report["verifier_decode_step_ms"] = verifier_step_ms(model)
    lat = report["latency_ms_per_draft_call"]["by_k"]
    report["drafter_share_of_spec_step"] = {  # one draft call vs one verifier forward over k+1 tokens ~ a decode step
        k: round(v / (v + report["verifier_decode_step_ms"]), 3) for k, v in lat.items()}
    print(json.dumps({k: v for k, v in report.items() if k not in ("chat", "code")}, indent=1))
    if not args.no_write:
        mpath = ck / MANIFEST_FILE
        man = json.loads(mpath.read_text())
        man["acceptance" + (f"_{args.tag}" if args.tag else "")] = report
        mpath.write_text(json.dumps(man, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
