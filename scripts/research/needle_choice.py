"""Is a paged miss a selection miss? Per (layer, KV head), does the needle's page get chosen, and does the answer hold
the key, for a passkey document with the needle at chosen token positions, under one or more `far_from` values.

One document per --needle-at position (the ladder's passkey templates, its intro, filler, needle and question; the
key fixed by --key), prefilled in chunks of 256 through the daemon's engine (int4 by default, paged sink 4 + window
508 + 8 pages of 64, the ladder's arm); then --answer greedy one-token steps. Page choice runs in Python (the native
step's recall off: its choice is the same, bit for bit, tests/kv/test_paged.py) so each step's chosen pages can be
read; for the first --steps answer steps the JSON records, per layer, how many KV heads chose a page holding the
needle sentence's first 30 tokens.

    scripts/research/needle_choice.py --tokens 9500 --needle-at 1900,4900,6100 --far-from 0,4096 \\
        --out results/research/needle_choice.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import ROOT, run_metadata, write_json  # noqa: E402

import niah_ladder as nl  # noqa: E402


def document(tok, n_tokens: int, at: int, key: str) -> tuple[list, int]:
    """Ids of a passkey document of about n_tokens with its needle starting near token `at`, and where it starts."""
    needle = nl.EVAL_NEEDLE.format(key=key)
    per = nl._per_filler(tok, nl.EVAL_FILLER)
    overhead = len(tok(nl.EVAL_INTRO + needle + nl.EVAL_QUESTION, add_special_tokens=False)["input_ids"])
    reps = int((n_tokens - overhead) / per)
    k = max(0, min(reps, round((at - len(tok(nl.EVAL_INTRO, add_special_tokens=False)["input_ids"])) / per)))
    start = len(tok(nl.EVAL_INTRO + nl.EVAL_FILLER * k, add_special_tokens=False)["input_ids"])
    text = nl.EVAL_INTRO + nl.EVAL_FILLER * k + needle + nl.EVAL_FILLER * (reps - k) + nl.EVAL_QUESTION
    return tok(text, add_special_tokens=False)["input_ids"], start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--tokens", type=int, default=9500, help="document length in tokens (question included)")
    ap.add_argument("--needle-at", default="1900,4900,6100", help="token positions of the needle (comma list)")
    ap.add_argument("--far-from", default="0,4096", help="paged far_from values (comma list; 0 = the trained context)")
    ap.add_argument("--key", default="48213")
    ap.add_argument("--answer", type=int, default=8, help="greedy answer tokens")
    ap.add_argument("--steps", type=int, default=3, help="answer steps whose page choice is recorded")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="results/research/needle_choice.json")
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.steps import forward
    from inference_engine.kv.factory import make_cache
    from inference_engine.kv.paged import PagedCache
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model

    torch.set_num_threads(args.threads)
    meta = run_metadata(vars(args))
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(path))
    model = TorchCausalLM.load(path, weights=args.weights)
    if model.use_native_step():
        model.native_step.paged_recall = "python"  # page choice in kv/paged.py, where it can be read
    chosen: list = []
    real = PagedCache._choose_pages

    def recording(self, layer, q, k_all, plan, w):
        idx, ok = real(self, layer, q, k_all, plan, w)
        if getattr(self, "_record", False):
            chosen.append((layer, plan["first"], idx[:, -1].tolist(), ok[:, -1].tolist()))
        return idx, ok

    PagedCache._choose_pages = recording
    arm = nl.ARMS["paged_4+508_p64_m8"]
    cases = []
    for far in (int(x) for x in args.far_from.split(",")):
        for at in (int(x) for x in args.needle_at.split(",")):
            ids, start = document(tok, args.tokens, at, args.key)
            strategy = KVStrategy("paged", arm["sink"], arm["window"], page_size=arm["page_size"],
                                  recall_pages=arm["recall_pages"], far_from=far)
            cache = make_cache(strategy, model.geometry(), max_step=256, max_context=model.spec.max_context)
            t0 = time.monotonic()
            for i in range(0, len(ids) - 1, 256):
                part = ids[i:min(i + 256, len(ids) - 1)]
                forward(model, model.tensor(part), range(cache.next_position, cache.next_position + len(part)), cache,
                        logits="none")
                cache.commit()
            prefill_s = time.monotonic() - t0
            cache._record = True
            out, last = [], ids[-1]
            for _ in range(args.answer):
                logits, _ = forward(model, model.tensor([last]), range(cache.next_position, cache.next_position + 1), cache,
                                    logits="last", row_exact=True)
                cache.commit()
                last = int(model.to_host(logits)[-1].argmax())
                out.append(last)
            cache._record = False
            needle_pages = sorted({(p - cache.sink) // cache.page_size for p in range(start, start + 30)})
            steps: dict = {}
            for layer, first, idx, ok in chosen:
                heads = sum(any(x in needle_pages for x, o in zip(i_h, o_h) if o) for i_h, o_h in zip(idx, ok))
                steps.setdefault(first, {})[layer] = heads
            chosen.clear()
            answer = tok.decode(out)
            rows = [{"position": p, "heads_choosing_needle_per_layer": [v[layer] for layer in sorted(v)],
                     "pairs": sum(v.values()), "of_pairs": len(v) * model.geometry().num_kv_heads}
                    for p, v in sorted(steps.items())[: args.steps]]
            cases.append({"far_from": far or model.spec.max_context, "needle_at": start, "tokens": len(ids),
                          "needle_pages": needle_pages, "answer": answer, "hit": args.key in answer,
                          "prefill_s": round(prefill_s, 1), "answer_steps": rows})
            print(f"far_from {far or model.spec.max_context} needle at {start} of {len(ids)}: {answer!r} "
                  f"hit {args.key in answer}; needle page chosen by {[r['pairs'] for r in rows]} of {rows[0]['of_pairs']} "
                  f"(layer, KV head) pairs", flush=True)
    meta |= {"what": "per answer step, the (layer, KV head) pairs whose chosen pages hold the needle, and the answer",
             "model": str(path), "weights": args.weights, "arm": "paged_4+508_p64_m8", "cases": cases}
    write_json(ROOT / args.out, meta)  # an absolute --out stays itself (pathlib)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
