"""Prefill cost of `paged` against `full`, up to the trained context and past it (issue 29 item 3: prefill time
<= 1.15x `full`'s at 4k and 7.5k; prefill tok/s at 32k >= 0.5x its rate at 2k), side by side in one process.

One session per arm prefills --tokens tokens (an arm's own cap with --arm-tokens) in --chunk chunks (the daemon's
defaults: sink 4, window 508 (paged's default since 2026-12-01; 1020 before), pages of 64, 8 recalled, int4 weights,
the native CPU step on). Arms:
  full                  `full` (it stops at the trained context);
  native                `paged` as it runs by default: every row of a prefill chunk chooses its pages and attends in
                        C++ as the one-token step at its position would (csrc/paged_rows.h), bit for bit;
  full/row, native/row  the same with the native step's tasks run row by row (the order before the default's,
                        by the data they read: csrc/row_step.cpp order_by_data, the same bits);
  python-recall         `paged` with the recall in kv/paged.py (each chunk's rows batched: two attention calls per
                        layer, `_attend_far_chunk` past the context), the dense work in the native step's segments:
                        the path before csrc/paged_rows.h;
  <arm>+fp32q           that arm with the compact keys scored against the fp32 query (kv/paged_store.query_int8(False):
                        the choice before the int8 query became the default);
  <arm>+rowbounds       that arm with every row of a chunk making the bounds of the pages past the bounds table itself
                        (the module's made_bounds(0): before they were made once a layer; the same bits);
  <arm>+tasksalone      that arm with a chunk's per-task planning, choice and merges on the calling thread (the
                        module's paged_tasks_apart(0): before they ran on the threads; the same bits);
  <arm>+sfN             that arm with the page shortlist from N candidate pages (--page-shortlist-from N), not
                        --shortlist-from's (the daemon's default unless given);
  <arm>+wN              that arm with a window of N positions (`--window N`), not --window's;
  <arm>+farN            that arm with InfLLM's layout from position N (`--page-far-from N`): how the daemon's default
                        (`--page-far-from 4096 --page-far-after context`) runs one append that takes a session past the
                        trained context from under N, such as a whole 32k prompt (the session is switched at the
                        append's start, Engine._switch_far); without it an arm keeps the trained context (far_from 0).
  <arm>+ceN             that arm with a query choosing its pages at every N-th position past the trained context
                        (`--page-choice-every N`), the others taking the last choice's pages.
--start-random N first fills each (paged) arm's cache with N positions of random K/V through its own API, then prefills
real tokens from N on: the cost far into a history (past the shortlist's 256 pages, say) in minutes.
--interleave runs the arms chunk by chunk in turn (each arm its own session; a drift in the box's speed then lands on
every arm alike), else one after another. Per arm: each chunk's seconds, the cumulative seconds at 4,096 and 7,680
tokens, and the rate per segment (up to 2k, 2k to 4k, 4k to the trained context, past it, and the last 4,096 tokens).
The logits of the chunk ending at 7,680 tokens of each paged arm against `full`'s (max abs difference; argmax equal).

    .venv/bin/python scripts/research/paged_far_prefill.py --tokens 32768 --arm-tokens full=7680,python-recall=9216
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, fill_with_random_kv, run_metadata, write_json  # noqa: E402

OUT = ROOT / "results" / "research" / "paged_prefill_native.json"
CHECKPOINTS = (4096, 7680)


def merge(files: list[str], out: str) -> int:
    """Runs of this script merged into one file: per run its commit, load at start, each arm's segments and the
    ratios (the run-to-run spread on a shared box is the yardstick for any difference)."""
    import json

    runs = []
    for f in files:
        d = json.loads(pathlib.Path(f).read_text())
        runs.append({"file": f, "commit": d["commit"], "dirty_worktree": d["dirty_worktree"], "date_utc": d["date_utc"],
                     "command": d["command"], "cpu": d["machine"]["cpu"],
                     "load_average_at_start": d["machine"]["load_average_at_start"],
                     "segments": {arm: v["segments"] for arm, v in d["arms"].items()}, "ratios": d.get("ratios", {})})
    write_json(pathlib.Path(out), run_metadata({"merge": files}) | {"what": "paged_far_prefill runs merged", "runs": runs})
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--tokens", type=int, default=12288)
    ap.add_argument("--arm-tokens", default="", help="per arm caps, e.g. full=7680,python-recall=9216")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arms", default="full,native,python-recall")
    ap.add_argument("--start-random", type=int, default=0,
                    help="fill each paged arm's cache with this many positions of random K/V first (bench_common."
                         "fill_with_random_kv: archiving, compact keys and bounds made as in serving) and prefill real "
                         "tokens from there: the cost far into a history without prefilling all of it")
    ap.add_argument("--interleave", action="store_true",
                    help="run the arms chunk by chunk in turn (side by side) instead of one after another")
    ap.add_argument("--kv-dtype", default="auto", choices=("auto", "fp32", "fp16"),
                    help="the resident K/V and page store dtype, as `kakeya serve --kv-dtype` resolves it per strategy "
                         "(auto: fp16 where the native step reads it in its registers; before 2026-12-01 this script "
                         "ran fp32 for every arm)")
    ap.add_argument("--shortlist-from", type=int, default=-1,
                    help="paged: the candidate pages past which the page shortlist applies, as `kakeya serve "
                         "--page-shortlist-from` (-1: the daemon's default)")
    ap.add_argument("--window", type=int, default=-1,
                    help="paged: the window, as `kakeya serve --window` (-1: the daemon's default for paged; this "
                         "script used 1020 until 2026-12-01, when paged's default became 508)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--merge", nargs="+", default=None, help="merge these runs' JSON files into --out and stop")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)

    import torch

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.steps import forward
    from inference_engine.kv.factory import make_cache
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model
    from inference_engine.server.app import resolve_kv_dtype
    from inference_engine.server.config import ServeConfig

    torch.set_num_threads(args.threads)
    meta = run_metadata(vars(args))
    model = TorchCausalLM.load(resolve_model(args.model), weights=args.weights)
    if not model.use_native_step():
        raise SystemExit("the native step is unavailable here (see the log)")
    native = model.native_step
    ctx = model.spec.max_context
    caps = {k: int(v) for k, v in (kv.split("=") for kv in args.arm_tokens.split(",") if kv)}
    # the K/V dtype the daemon takes for each strategy with these settings
    kv_dtypes = {name: resolve_kv_dtype(ServeConfig(kv_strategy=name, kv_dtype=args.kv_dtype), model)
                 for name in ("full", "paged")}
    # and the candidate pages from which its page shortlist applies (the daemon's --page-shortlist-from default unless
    # --shortlist-from is given; an arm +sfN sets N)
    shortlist_from = ServeConfig.page_shortlist_from if args.shortlist_from < 0 else args.shortlist_from
    window = ServeConfig(kv_strategy="paged").resolved_window if args.window < 0 else args.window
    paged = KVStrategy("paged", 4, window, page_size=64, recall_pages=8, kv_dtype=kv_dtypes["paged"],
                       shortlist_from=shortlist_from)
    ids = torch.randint(3, model.spec.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    arms, last = {}, {}
    from inference_engine.kv import paged_store

    def setup(arm: str) -> None:  # the process switches an arm runs under
        paged_store.query_int8("+fp32q" not in arm)
        native.module.made_bounds(0 if "+rowbounds" in arm else 1)
        native.module.paged_tasks_apart(0 if "+tasksalone" in arm else 1)
        native.paged_recall = "python" if arm == "python-recall" else "whole"
        native.module.order_by_data(0 if "/row" in arm else 1)

    names = args.arms.split(",")
    base = {arm: arm.split("/")[0].split("+")[0] for arm in names}
    n_of = {arm: min(args.tokens, caps.get(arm, args.tokens), ctx if base[arm] == "full" else args.tokens) for arm in names}
    full = KVStrategy("full", kv_dtype=kv_dtypes["full"])

    def strategy_of(arm: str) -> KVStrategy:
        if base[arm] == "full":
            return full
        mods = arm.replace("/row", "").split("+")[1:]  # "/row" may sit anywhere in the name
        sf = [int(m[2:]) for m in mods if m.startswith("sf") and m[2:].isdigit()]
        w = [int(m[1:]) for m in mods if m.startswith("w") and m[1:].isdigit()]
        far = [int(m[3:]) for m in mods if m.startswith("far") and m[3:].isdigit()]
        ce = [int(m[2:]) for m in mods if m.startswith("ce") and m[2:].isdigit()]
        return dataclasses.replace(paged, **({"shortlist_from": sf[0]} if sf else {}), **({"window": w[0]} if w else {}),
                                   **({"far_from": far[0]} if far else {}), **({"choice_every": ce[0]} if ce else {}))

    caches = {arm: make_cache(strategy_of(arm), model.geometry(), max_step=args.chunk, max_context=ctx) for arm in names}
    shortlist_froms = {arm: strategy_of(arm).shortlist_from for arm in names if base[arm] != "full"}
    windows = {arm: strategy_of(arm).window for arm in names if base[arm] != "full"}
    far_froms = {arm: strategy_of(arm).far_from for arm in names if base[arm] != "full"}
    chunks_of: dict = {arm: [] for arm in names}
    start = args.start_random
    if start:
        if any(base[arm] == "full" for arm in names) or start % args.chunk:
            raise SystemExit("--start-random takes paged arms only, and a multiple of --chunk")
        for arm in names:
            fill_with_random_kv(caches[arm], start, args.chunk, torch.Generator().manual_seed(start))

    def run_chunk(arm: str, a: int) -> None:
        setup(arm)
        n = n_of[arm]
        part = ids[a:min(a + args.chunk, n)]
        t = time.perf_counter()
        logits, _ = forward(model, model.tensor(part), range(a, a + len(part)), caches[arm], logits="last")
        caches[arm].commit()
        chunks_of[arm].append((a + len(part), time.perf_counter() - t))
        if a + len(part) == CHECKPOINTS[-1]:
            last[arm] = logits.float()
        print(f"{arm}: {a + len(part)} tokens, chunk {chunks_of[arm][-1][1]:.2f} s", flush=True)

    with torch.inference_mode():
        if args.interleave:  # chunk by chunk, every arm in turn: a drift in the box's speed lands on every arm alike
            for a in range(start, max(n_of.values()), args.chunk):
                for arm in names:
                    if a < n_of[arm]:
                        run_chunk(arm, a)
        else:
            for arm in names:
                for a in range(start, n_of[arm], args.chunk):
                    run_chunk(arm, a)
    for arm in names:
        n, chunks = n_of[arm], chunks_of[arm]
        caches[arm] = None  # free it

        def span(lo: int, hi: int) -> dict | None:
            s = [(end, dt) for end, dt in chunks if lo < end <= hi]
            if not s or s[-1][0] != min(hi, n):
                return None
            tokens, seconds = s[-1][0] - lo, sum(dt for _, dt in s)
            return {"tokens": tokens, "seconds": round(seconds, 2), "tok_s": round(tokens / seconds, 1)}

        segments = {"to_2k": span(0, 2048), "2k_to_4k": span(2048, 4096), "4k_to_context": span(4096, ctx),
                    "past_context": span(ctx, n) if n > ctx else None,
                    "last_4k": span(n - 4096, n) if n >= 8192 else None}
        arms[arm] = {"tokens": n, "chunk_seconds": [round(dt, 3) for _, dt in chunks], "segments": segments,
                     "cumulative_s": {str(c): round(sum(dt for end, dt in chunks if end <= c), 2)
                                      for c in CHECKPOINTS if c <= n},
                     "whole_tok_s": round(n / sum(dt for _, dt in chunks), 1)}
        if segments["last_4k"] and segments["to_2k"]:
            arms[arm]["last_4k_over_to_2k"] = round(segments["last_4k"]["tok_s"] / segments["to_2k"]["tok_s"], 3)
            arms[arm]["whole_over_to_2k"] = round(arms[arm]["whole_tok_s"] / segments["to_2k"]["tok_s"], 3)
    native.paged_recall = "whole"
    native.module.order_by_data(1)
    native.module.made_bounds(1)
    native.module.paged_tasks_apart(1)
    paged_store.query_int8(True)
    ratios = {}
    for arm in arms:  # an arm's rate over its variant's (the int8 query over the fp32 one, bounds made once over per row)
        for suffix in ("+fp32q", "+rowbounds", "+tasksalone"):
            other = arms.get(arm + suffix)
            if other is None:
                continue
            for seg, v in arms[arm]["segments"].items():
                if v and other["segments"].get(seg):
                    ratios[f"{arm} / {arm}{suffix}, tok/s {seg}"] = round(v["tok_s"] / other["segments"][seg]["tok_s"], 3)
    for arm in arms:
        if arm == "full" or "full" not in arms:
            continue
        for c in CHECKPOINTS:
            if str(c) in arms[arm]["cumulative_s"] and str(c) in arms["full"]["cumulative_s"]:
                ratios[f"{arm} / full, prefill seconds to {c}"] = round(
                    arms[arm]["cumulative_s"][str(c)] / arms["full"]["cumulative_s"][str(c)], 3)
        if arm in last and "full" in last:  # the chunk ending at the last checkpoint
            ratios[f"{arm} vs full, logits at {CHECKPOINTS[-1]}: max abs diff"] = float((last[arm] - last["full"]).abs().max())
            ratios[f"{arm} vs full, logits at {CHECKPOINTS[-1]}: argmax equal"] = bool(
                torch.equal(last[arm].argmax(-1), last["full"].argmax(-1)))
    doc = meta | {"model": model.model_id, "max_context": ctx,
                  "strategy": "paged sink 4, pages of 64, 8 recalled (shortlist 64 past shortlist_from pages), "
                              "the window per arm ('window')",
                  "window": windows,
                  "far_from": far_froms,
                  "kv_dtype": kv_dtypes,
                  "shortlist_from": shortlist_froms,
                  "arms": arms, "ratios": ratios}
    write_json(pathlib.Path(args.out), doc)
    print(ratios, {a: (v.get("last_4k_over_to_2k"), v.get("whole_over_to_2k")) for a, v in arms.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
