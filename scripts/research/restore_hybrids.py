"""Which restored K/V does passkey retrieval actually need? Oracle hybrids of true and f_θ-restored K/V.

The cross-model f_θ retrieves ~0/20 on the ladder while the same-model proposer retrieves like
`full`. This script locates the gap. For each ladder-style passkey document (the ladder's own
generator, niah_ladder.make_sample: nothing here is trained) it takes the state of a decode step
of `dlm_restore` 4+64 at the question: the positions [sink, n - window) are evicted and must be
restored. Every configuration builds the evicted positions' pre-RoPE K/V per layer from two
sources, the verifier's true K/V (what the same-model proposer restores) and the shipped f_θ's
output, mixed by layer band, by K vs V, and by position (needle sentence vs filler), then runs the
window + answer through the verifier (teacher-forced, one forward) and records:
  answer_exact   every answer token is the verifier's argmax (teacher-forced passkey recall)
  first_digit_exact  the answer tokens up to the key's first digit are (finding the needle, before copying it)
  kl_answer      KL(true-K/V logits || hybrid logits) on the answer tokens, mean
  k/v_rel_mse    rel-MSE of the hybrid K/V against the true ones over the evicted positions

    .venv/bin/python scripts/research/restore_hybrids.py --rungs 1000,2000 --samples 20
writes results/research/restore_hybrids.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, run_metadata, write_json  # noqa: E402


def configs(num_layers: int) -> dict:
    """name -> (layers taking f_θ, parts taking f_θ ("k", "v"), positions taking f_θ: all | needle | filler)."""
    third = num_layers // 3
    bands = {"0-%d" % (third - 1): range(0, third), "%d-%d" % (third, 2 * third - 1): range(third, 2 * third),
             "%d-%d" % (2 * third, num_layers - 1): range(2 * third, num_layers)}
    every = range(num_layers)
    out = {
        "true_kv (same-model)": (range(0), "kv", "all"),
        "ftheta_all (cross-model)": (every, "kv", "all"),
        "ftheta_k_only (true V)": (every, "k", "all"),
        "ftheta_v_only (true K)": (every, "v", "all"),
        "ftheta_filler_only (true needle)": (every, "kv", "filler"),
        "ftheta_needle_only (true filler)": (every, "kv", "needle"),
        # which half of the filler's restoration hurts: f_θ K with true V, or f_θ V with true K (needle true)
        "ftheta_filler_k_only (true needle, true V)": (every, "k", "filler"),
        "ftheta_filler_v_only (true needle, true K)": (every, "v", "filler"),
        # f_θ's V replaced by one mean V per (layer, kv head) over the evicted positions' true V (a running mean
        # a cache can keep from the rows it evicts): is a constant V better than f_θ's?
        "ftheta_k_mean_v (cross-model, V = evicted mean)": (every, "kv-meanv", "all"),
        "pin_top16, rest ftheta_k_mean_v": (every, "kv-meanv", "pin16"),
        "ftheta_filler_k_mean_v (true needle)": (every, "kv-meanv", "filler"),
    }
    for pin in (16, 32, 64):  # keep the P positions f_θ restores worst (measurable at eviction) exact
        out[f"pin_top{pin}_by_ftheta_error"] = (every, "kv", f"pin{pin}")
    out["pin_top16_by_ftheta_v_error"] = (every, "kv", "vpin16")  # V needs no RoPE: the store's rows as they are
    for pin, r in ((32, 4), (48, 6), (64, 8)):  # spans: a position's score is the max V error within +-r
        out[f"pin{pin}_span{r}_by_ftheta_v_error"] = (every, "kv", f"span{r}vpin{pin}")
    # ablations: the pinned positions alone (everything else evicted and dropped, no restoration), and a
    # window 16 positions longer instead of the pins (the same resident budget)
    out["pin_top16_by_ftheta_error, rest dropped"] = (range(0), "kv", "pin16-drop")
    out["no pins, window +16, rest dropped"] = (range(0), "kv", "window16-drop")
    for name, layers in bands.items():
        out[f"ftheta_layers_{name} only"] = (layers, "kv", "all")
        out[f"true_layers_{name} only"] = ([i for i in every if i not in layers], "kv", "all")
    return out


def needle_span(tok, ids, key: str) -> tuple[int, int]:
    """Token span [a, b) covering the needle sentence (found by its key's first occurrence), with a margin."""
    from niah_ladder import EVAL_NEEDLE

    needle = tok(EVAL_NEEDLE.format(key=key), add_special_tokens=False)["input_ids"]
    key_ids = tok(" " + key, add_special_tokens=False)["input_ids"][1:3]
    for i in range(len(ids) - len(key_ids)):
        if ids[i : i + len(key_ids)] == key_ids:
            start = max(0, i - 6)
            return start, min(len(ids), start + len(needle) + 8)
    raise ValueError("needle not found")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="smollm2-135m-dlm")
    ap.add_argument("--rungs", default="1000,2000")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--configs", default="", help="only the configurations whose name matches this regex (the first one "
                                                 "run is the teacher the KL is taken against; true_kv always runs first)")
    ap.add_argument("--out", default=str(ROOT / "results" / "research" / "restore_hybrids.json"))
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from transformers import AutoTokenizer

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from niah_ladder import make_sample, sample_rng

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.model_store import resolve_model
    from kv_cache_proposer.drafter import load_drafter
    from kv_cache_proposer.restore import load_projection, proposer_features
    from kv_cache_proposer.training import restore_data as rd

    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    model = TorchCausalLM.load(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    drafter = load_drafter(args.drafter, verifier_embed=model.embed, verifier_lm_head=model.lm_head)
    proj = load_projection(args.drafter)
    s = model.spec
    kv_dim = s.num_kv_heads * s.head_dim
    cfgs = configs(s.num_layers)
    if args.configs:
        import re

        cfgs = {k: v for i, (k, v) in enumerate(cfgs.items()) if i == 0 or re.search(args.configs, k)}
    results = {}
    t0 = time.time()
    for n in (int(r) for r in args.rungs.split(",")):
        agg = {name: {"answer_exact": 0, "first_digit_exact": 0, "kl_answer": 0.0, "k_rel_mse": 0.0, "v_rel_mse": 0.0} for name in cfgs}
        rows = []
        for i in range(args.samples):
            ids, key, depth = make_sample(tok, n, sample_rng("passkey", n, i))  # the ladder's samples
            answer = tok(" " + key, add_special_tokens=False)["input_ids"]
            full = torch.tensor(ids + answer)
            tail_start = len(ids) - args.window  # evicted: [sink, tail_start)
            a, b = needle_span(tok, ids, key)
            with torch.inference_mode():
                true = rd.verifier_kv(model, full[:tail_start])  # (L, tail_start, 2kv)
                feats = proposer_features(drafter.model, full, tail_start, proj.cfg.block, proj.cfg.features)[args.sink:]
                pred = proj.all_layers(proj.trunk(feats))  # (L, E, 2kv)
            pos = torch.arange(args.sink, tail_start)
            in_needle = (pos >= a) & (pos < b)
            # Per-position restoration error (mean over layers of K and V relative squared error). RoPE is a
            # rotation, so it equals the error against the resident (post-RoPE) keys at eviction time.
            tk = true[:, args.sink:, :kv_dim].pow(2).sum(-1).mean(1, keepdim=True)
            tv = true[:, args.sink:, kv_dim:].pow(2).sum(-1).mean(1, keepdim=True)
            d = (pred - true[:, args.sink:]).pow(2)
            err = (d[..., :kv_dim].sum(-1) / tk + d[..., kv_dim:].sum(-1) / tv).mean(0)  # (E,)
            err_v = (d[..., kv_dim:].sum(-1) / tv).mean(0)
            pinned = err.topk(min(64, err.numel())).indices + args.sink
            row_pins = {"needle_tokens_in_top16": int(((pinned[:16] >= a) & (pinned[:16] < b)).sum()),
                        "needle_tokens_in_top64": int(((pinned >= a) & (pinned < b)).sum()), "needle_tokens": b - a}
            ans_rows = slice(len(ids) - 1 - tail_start, len(full) - 1 - tail_start)
            first_digit = 1 + next(j for j, t in enumerate(answer) if tok.decode([t]).strip())  # answer tokens through it
            evicted_mean_v = true[:, args.sink:, kv_dim:].mean(1)  # (L, kv): per layer, over the evicted positions
            teacher = None
            row = {"key": key, "depth": round(depth, 3), "prompt_tokens": len(ids), "needle_span": [a, b]} | row_pins
            for name, (layers, parts, where) in cfgs.items():
                hyb = true[:, args.sink:].clone()
                keep = None
                if where.endswith("-drop"):  # prefix attends to the sink + the kept positions only
                    keep = torch.zeros(tail_start, dtype=torch.bool)
                    keep[: args.sink] = True
                    if where.startswith("pin"):
                        keep[err.topk(min(16, err.numel())).indices + args.sink] = True
                    else:
                        keep[tail_start - 16 :] = True
                    sel = torch.zeros_like(in_needle)
                elif where.startswith("span"):  # f_θ except the P positions whose +-r neighbourhood is worst
                    r, budget = (int(x) for x in where[4:].split("vpin"))
                    e = torch.nn.functional.max_pool1d(err_v[None, None], 2 * r + 1, 1, r)[0, 0]
                    sel = torch.ones_like(in_needle)
                    sel[e.topk(min(budget, e.numel())).indices] = False
                elif "pin" in where:  # f_θ everywhere except the P worst-restored positions
                    e = err_v if where.startswith("v") else err
                    sel = torch.ones_like(in_needle)
                    sel[e.topk(min(int(where.split("pin")[1]), e.numel())).indices] = False
                else:
                    sel = torch.ones_like(in_needle) if where == "all" else (in_needle if where == "needle" else ~in_needle)
                mean_v = parts.endswith("-meanv")
                parts = parts.removesuffix("-meanv")
                cols = slice(0, kv_dim) if parts == "k" else slice(kv_dim, 2 * kv_dim) if parts == "v" else slice(0, 2 * kv_dim)
                for layer in layers:
                    hyb[layer, sel, cols] = pred[layer, sel, cols]
                    if mean_v:
                        hyb[layer, sel, kv_dim:] = evicted_mean_v[layer]
                prefix = [rd.split_kv(torch.cat([true[layer, : args.sink], hyb[layer]]), s.num_kv_heads, s.head_dim)
                          for layer in range(s.num_layers)]
                with torch.inference_mode():
                    logits = rd.tail_logits(model, full, prefix, tail_start, keep)[ans_rows]
                if teacher is None:  # the first config is the true K/V
                    teacher = logits
                right = logits.argmax(-1) == torch.tensor(answer)
                hit = bool(right.all())
                first = bool(right[:first_digit].all())
                kl = float(F.kl_div(F.log_softmax(logits, -1), F.log_softmax(teacher, -1), log_target=True,
                                    reduction="none").sum(-1).mean())
                rk, rv = rd.rel_mse(hyb, true[:, args.sink:], kv_dim)
                g = agg[name]
                g["answer_exact"] += hit
                g["first_digit_exact"] += first
                g["kl_answer"] += kl / args.samples
                g["k_rel_mse"] += float(rk.mean()) / args.samples
                g["v_rel_mse"] += float(rv.mean()) / args.samples
                row[name] = hit
            rows.append(row)
            print(f"{n} sample {i}: " + " ".join(f"{int(row[c])}" for c in cfgs) + f"  needle in top16/top64 "
                  f"{row['needle_tokens_in_top16']}/{row['needle_tokens_in_top64']} of {row['needle_tokens']}  "
                  f"({time.time() - t0:.0f}s)", flush=True)
        for name, g in agg.items():
            g["answer_exact"] = f"{g['answer_exact']}/{args.samples}"
            g["first_digit_exact"] = f"{g['first_digit_exact']}/{args.samples}"
            print(f"{n} {name:40s} exact {g['answer_exact']:>6}  first digit {g['first_digit_exact']:>6}  KL {g['kl_answer']:.3f}  "
                  f"K rel-MSE {g['k_rel_mse']:.3f}  V {g['v_rel_mse']:.3f}", flush=True)
        results[str(n)] = {"configs": agg, "rows": rows}
    meta = run_metadata(vars(args) | {"configs": {k: {"ftheta_layers": list(v[0]), "ftheta_parts": v[1], "ftheta_positions": v[2]}
                                                  for k, v in cfgs.items()}})
    write_json(__import__("pathlib").Path(args.out), meta | {"results": results, "seconds": round(time.time() - t0)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
