"""What `--page-far-after context` costs the turn that takes a `paged` session past the trained context
(docs/paged.md, "far_from once past the context"), side by side with the default in one process.

Each arm's session, through the engine as the daemon drives it (`Engine.generate`, the daemon's paged defaults, its
--kv-dtype auto, chunks of 256, int4 weights, the native step): a first turn of --history tokens (random ids) and one
generated token, then the crossing turn: --append tokens, which take the history past the trained context, and
--decode generated tokens. Per arm: the first turn's seconds, the crossing turn's time to its first token (the
re-encode, when there is one, is in it) and its decode rate. Arms:
  default   `paged` with far_from = the trained context (the daemon's default before 2026-12-01);
  context   `--page-far-from F --page-far-after context`: at the crossing the session, already holding positions past
            F, is re-encoded once: its K/V of positions under F copied (PagedCache.copy_rows: the same bits under both
            layouts), the tokens from F on prefilled again;
  context-whole  the same with every token prefilled again (copyable_prefix refused: the re-encode before the copy);
  start     `--page-far-from F` from the session's start (what `context` equals once past the context).
--rounds runs the arms in turn that many times (a drift in the box's speed lands on every arm alike); medians.
A session that crosses the context in one append from under F (a long first prompt) is switched without a re-encode:
nothing to measure there.

    .venv/bin/python scripts/research/paged_far_switch.py --history 7936 --append 512 --decode 16 --rounds 2
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, run_metadata, write_json  # noqa: E402

OUT = ROOT / "results" / "research" / "paged_far_switch.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--history", type=int, default=7936, help="the first turn's tokens (past --far-from, under the context)")
    ap.add_argument("--append", type=int, default=512, help="the crossing turn's tokens")
    ap.add_argument("--decode", type=int, default=16, help="tokens the crossing turn generates")
    ap.add_argument("--far-from", type=int, default=4096)
    ap.add_argument("--arms", default="default,context,context-whole,start")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)

    import torch

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.events import GenerationDone
    from inference_engine.engine.generate import Engine
    from inference_engine.engine.requests import GenerateParams
    from inference_engine.model_store import resolve_model
    from inference_engine.server.app import resolve_kv_dtype
    from inference_engine.server.config import ServeConfig

    torch.set_num_threads(args.threads)
    meta = run_metadata(vars(args))
    model = TorchCausalLM.load(resolve_model(args.model), weights=args.weights)
    if not model.use_native_step():
        raise SystemExit("the native step is unavailable here (see the log)")
    ctx = model.spec.max_context
    if not args.far_from < args.history < ctx < args.history + args.append:
        raise SystemExit(f"need --far-from < --history < the trained context ({ctx}) < --history + --append")
    arms = {"default": {"page_far_from": 0}, "context": {"page_far_from": args.far_from, "page_far_after": "context"},
            "context-whole": {"page_far_from": args.far_from, "page_far_after": "context"},
            "start": {"page_far_from": args.far_from}}
    from inference_engine.kv.paged import PagedCache

    copyable_prefix = PagedCache.copyable_prefix
    names = args.arms.split(",")
    engines = {}
    for arm in names:
        cfg = ServeConfig(kv_strategy="paged", prefill_chunk=args.chunk, **arms[arm])
        strategy, _ = cfg.strategy(kv_dtype=resolve_kv_dtype(cfg, model))
        engines[arm] = Engine(model, strategy, prefill_chunk=args.chunk)
    ids = torch.randint(3, model.spec.vocab_size, (args.history + args.append,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    runs: dict = {arm: [] for arm in names}
    try:
        for r in range(args.rounds):
            for arm in names:
                e = engines[arm]
                PagedCache.copyable_prefix = (lambda self, other: 0) if arm == "context-whole" else copyable_prefix  # type: ignore[method-assign]
                kv = e.new_session_kv()
                history = ids[: args.history]
                t = time.perf_counter()
                first = [ev for ev in e.generate(kv, history, GenerateParams(max_tokens=1))]
                first_s = time.perf_counter() - t
                history = history + [first[0].token_id] + ids[args.history :]
                t = time.perf_counter()
                done = [ev for ev in e.generate(kv, history, GenerateParams(max_tokens=args.decode))][-1]
                assert isinstance(done, GenerationDone) and done.generated_tokens == args.decode
                decode_s = done.total_seconds - done.time_to_first_token_seconds
                runs[arm].append({"first_turn_s": round(first_s, 3), "crossing_ttft_s": round(done.time_to_first_token_seconds, 3),
                                  "crossing_turn_s": round(time.perf_counter() - t, 3),
                                  "decode_tok_s": round((args.decode - 1) / decode_s, 2),
                                  "re_encoded": kv.epoch, "reencoded_tokens": done.reencoded_tokens,
                                  "far_from_after": getattr(kv.cache, "far_from", None)})
                print(f"round {r} {arm}: {runs[arm][-1]}", flush=True)
                del kv
    finally:
        PagedCache.copyable_prefix = copyable_prefix  # type: ignore[method-assign]

    def med(arm: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[arm])

    summary = {arm: {k: med(arm, k) for k in ("first_turn_s", "crossing_ttft_s", "decode_tok_s")} for arm in names}
    ratios = {}
    for arm in names:
        if arm != "default" and "default" in names:
            ratios[f"{arm} / default, crossing turn's time to first token"] = round(
                summary[arm]["crossing_ttft_s"] / summary["default"]["crossing_ttft_s"], 3)
            ratios[f"{arm} / default, decode tok/s after the crossing"] = round(
                summary[arm]["decode_tok_s"] / summary["default"]["decode_tok_s"], 3)
    write_json(pathlib.Path(args.out),
               meta | {"trained_context": ctx, "runs": runs, "median": summary, "ratios": ratios})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
