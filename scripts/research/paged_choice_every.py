"""What choosing pages at every N-th position past the trained context saves in a `paged` decode step (issue 29: decode at
32k >= 0.8x `paged` at 1k and >= 0.9x `full` at 1k), side by side in one run.

`--page-choice-every N` (kv/strategy.py `choice_every`): from the trained context on, a query chooses its pages itself
at every N-th position only; the others attend to the pages the last of those chose (each with its own window and its
own view of them). What it does to recall is measured by scripts/research/niah_ladder.py (arms `..._ceN`); this script
times it.

The real model (its weights, --weights) on the native CPU step, and one real PagedCache per (length, N), filled with
random K/V through the cache's own API to each length (bench_common.fill_with_random_kv: archived, compact keys and
bounds made as in serving; the choice's cost does not depend on what the keys hold), with the daemon's `paged` defaults
(sink 4, window 508, 8 pages of 64, a 64-page shortlist from 256 pages, fp16 K/V, InfLLM's layout from 4096 past the
context, the RAM budget --page-ram-mb). Every cell first takes N untimed steps (the first step past a random fill makes
far_keys from the whole store); then each round times N consecutive decode steps of every cell in turn (and N of `full`
at --full-reference tokens), so a drift in the box's speed lands on every cell alike, and every cell's round holds one
step that chooses. A step's time is a round's time over its steps (the mean: a rate, not a median, which would pick
the steps that do not choose).

    .venv/bin/python scripts/research/paged_choice_every.py --lengths 1024,32768 --every 1,2,4,8
Writes results/research/paged_choice_every.json. `--step python` times the Python pieces instead (the recall in
kv/paged.py, where a step whose rows all take the kept choice scores nothing).
"""
from __future__ import annotations

import argparse
import math
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, fill_with_random_kv, run_metadata, write_json  # noqa: E402

OUT = ROOT / "results" / "research" / "paged_choice_every.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--lengths", default="1024,32768", help="histories (the first is the reference, under the context)")
    ap.add_argument("--every", default="1,2,4", help="comma list of --page-choice-every values")
    ap.add_argument("--rounds", type=int, default=32,
                    help="rounds of lcm(--every) steps per cell (32 x 8 = 256 steps: four pages of 64 completed, each "
                         "with its archive and bounds, in every cell)")
    ap.add_argument("--full-reference", type=int, default=1024, help="also time `full` at this many tokens (0: no)")
    ap.add_argument("--far-from", type=int, default=4096, help="paged's far_from past the context (the daemon's default)")
    ap.add_argument("--page-ram-mb", type=float, default=128)
    ap.add_argument("--chunk", type=int, default=512, help="positions a fill step appends")
    ap.add_argument("--step", choices=("native", "python"), default="native",
                    help="the native CPU step (the daemon's on CPU), or the Python pieces with the recall in kv/paged.py "
                         "(`--compile off`, and the path a CUDA daemon runs)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)

    import torch

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.steps import forward
    from inference_engine.kv.factory import make_cache
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model

    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    everies = [int(x) for x in args.every.split(",")]
    model = TorchCausalLM.load(resolve_model(args.model), weights=args.weights)
    if args.step == "python":
        model.use_native_step(False)
    elif not model.use_native_step():
        raise SystemExit("the native step is unavailable here (see the log)")
    geometry, context = model.geometry(), model.spec.max_context
    t_fill = time.perf_counter()
    cells: dict = {}
    for n in lengths:
        # under the context every query chooses whatever N is: one cell there
        for every in (everies if n >= context else everies[:1]):
            s = KVStrategy("paged", 4, 508, page_size=64, recall_pages=8, kv_dtype="fp16", far_from=args.far_from,
                           page_ram_mb=args.page_ram_mb, choice_every=every)
            cache = make_cache(s, geometry, max_step=args.chunk, max_context=context)
            fill_with_random_kv(cache, n, args.chunk, torch.Generator().manual_seed(n))
            cells[f"paged@{n}/every{every}"] = cache
    if args.full_reference:
        cache = make_cache(KVStrategy("full", kv_dtype="fp16"), geometry, max_step=args.chunk, max_context=context)
        fill_with_random_kv(cache, args.full_reference, args.chunk, torch.Generator().manual_seed(1))
        cells[f"full@{args.full_reference}"] = cache
    fill_s = time.perf_counter() - t_fill
    token = model.tensor([17])
    k = math.lcm(*everies)  # steps a round: every cell's round holds whole periods

    def steps(cache, count: int) -> float:
        t0 = time.perf_counter()
        for _ in range(count):
            at = cache.next_position
            forward(model, token, range(at, at + 1), cache, logits="last", row_exact=True)
            cache.commit()
        return time.perf_counter() - t0

    for cache in cells.values():  # untimed: far_keys made after the fill, and the caches' first periods
        steps(cache, k)
    per_round: dict = {name: [] for name in cells}
    for _ in range(args.rounds):
        for name, cache in cells.items():
            per_round[name].append(steps(cache, k) / k)
    step_s = {name: statistics.mean(v) for name, v in per_round.items()}
    short = f"paged@{lengths[0]}/every{everies[0]}"
    ratios: dict = {}
    for name, s in step_s.items():
        if name.startswith("paged@") and name != short:
            ratios[f"{name} decode rate over {short}'s"] = step_s[short] / s
            if args.full_reference:
                ratios[f"{name} decode rate over full@{args.full_reference}'s"] = step_s[f"full@{args.full_reference}"] / s
    meta = run_metadata(vars(args) | {"steps_per_round": k, "fill_s": fill_s, "max_context": context,
                                      "strategy": f"paged sink 4, window 508, 8 pages of 64, shortlist 64 from 256 "
                                                  f"pages, fp16 K/V, far_from {args.far_from}",
                                      "kv": "random normal K/V (the choice's cost does not depend on them)"})
    out = {"decode_step_s": step_s, "decode_step_s_per_round": per_round,
           "decode_step_s_median_of_rounds": {name: statistics.median(v) for name, v in per_round.items()},
           "ratios": ratios, "positions_at_end": {name: c.next_position for name, c in cells.items()}}
    print(out["decode_step_s"], ratios, flush=True)
    write_json(pathlib.Path(args.out), meta | out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
