"""Prefill cost of `paged` past the trained context: a prefill chunk's rows batched (`_attend_far_chunk`,
two attention calls per layer) against row by row (`_attend_rows`, three calls per row per layer), side by
side in one process on the same tokens (issue 29 item 3: prefill tok/s at 32k >= 0.5x its rate at 2k).

One session per arm prefills --tokens tokens in --chunk chunks (the daemon's defaults: sink 4, window 1020,
pages of 64, 8 recalled, int4 weights on the CPU); the seconds of each chunk are summed per segment: up
to 2k, 2k to the trained context, and past it. Also: the row-by-row arm's last chunk's logits against the
batched arm's (max abs difference), so the batched path's numbers come with its agreement.

    .venv/bin/python scripts/research/paged_far_prefill.py --tokens 12288 --threads 2
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, run_metadata, write_json  # noqa: E402

OUT = ROOT / "results" / "research" / "paged_far_prefill.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--tokens", type=int, default=12288)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arms", default="batched,rows")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)

    import torch

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.steps import forward
    from inference_engine.kv.factory import make_cache
    from inference_engine.kv.paged import PagedCache
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model

    torch.set_num_threads(args.threads)
    meta = run_metadata(vars(args))
    model = TorchCausalLM.load(resolve_model(args.model), weights=args.weights)
    ctx = model.spec.max_context
    strategy = KVStrategy("paged", 4, 1020, page_size=64, recall_pages=8)
    ids = torch.randint(3, model.spec.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    real = PagedCache._attend_far_chunk
    arms, last = {}, {}
    for arm in args.arms.split(","):
        PagedCache._attend_far_chunk = real if arm == "batched" else (lambda self, *a, **k: None)  # type: ignore[method-assign]
        cache = make_cache(strategy, model.geometry(), max_step=args.chunk, max_context=ctx)
        segments = {"to_2k": [0, 0.0], "2k_to_context": [0, 0.0], "past_context": [0, 0.0]}
        with torch.inference_mode():
            for a in range(0, len(ids), args.chunk):
                part = ids[a:a + args.chunk]
                t = time.perf_counter()
                logits, _ = forward(model, model.tensor(part), range(a, a + len(part)), cache, logits="last")
                cache.commit()
                dt = time.perf_counter() - t
                seg = "to_2k" if a + len(part) <= 2048 else ("2k_to_context" if a + len(part) <= ctx else "past_context")
                segments[seg][0] += len(part)
                segments[seg][1] += dt
                print(f"{arm}: {a + len(part)} tokens, chunk {dt:.2f} s", flush=True)
        last[arm] = logits.float()
        arms[arm] = {"segments": {k: {"tokens": n, "seconds": round(s, 2), "tok_s": round(n / s, 1) if s else None}
                                  for k, (n, s) in segments.items()},
                     "timings": {k: round(v, 2) if isinstance(v, float) else v for k, v in cache.timings.items()}}
        seg = arms[arm]["segments"]
        if seg["past_context"]["tok_s"] and seg["to_2k"]["tok_s"]:
            arms[arm]["past_context_over_to_2k"] = round(seg["past_context"]["tok_s"] / seg["to_2k"]["tok_s"], 3)
    PagedCache._attend_far_chunk = real  # type: ignore[method-assign]
    doc = meta | {"model": model.model_id, "max_context": ctx, "strategy": "paged sink 4, window 1020, pages of 64, 8 recalled",
                  "arms": arms}
    if "batched" in arms and "rows" in arms:
        doc["past_context_batched_over_rows"] = round(arms["batched"]["segments"]["past_context"]["tok_s"]
                                                      / arms["rows"]["segments"]["past_context"]["tok_s"], 3)
        doc["last_chunk_logits_max_abs_diff"] = float((last["batched"] - last["rows"]).abs().max())
        doc["last_chunk_argmax_equal"] = bool(torch.equal(last["batched"].argmax(-1), last["rows"].argmax(-1)))
    write_json(pathlib.Path(args.out), doc)
    print({k: v for k, v in doc.items() if k.startswith(("past", "last"))})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
