"""How `paged`'s per-step page choice and its bytes grow with the history (issue 29, item 2).

A real PagedCache with the model's geometry (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64) is filled to
each history length with random K/V through the cache's own API (prepare, update_and_fetch, commit: the rows
are archived and their compact keys and page bounds made exactly as in serving; no model forward, so the
history can reach 100k tokens in minutes). At each length one decode step's page choice runs for every layer
with a random query, timed for exact scoring (`shortlist_pages` 0: every compact key read) and for each
shortlist (page bounds read, then the shortlisted pages' keys), the variants interleaved per repeat. The
choice's cost does not depend on what the keys hold (one query: a shortlist of S pages is S pages); which
pages it finds does, and that is measured on real prompts by paged_shortlist.py and niah_ladder.py.

Per length: bytes by tier (resident = sink + window slab; selection = what every step reads to choose: the
compact keys, or the page bounds with a shortlist; stored = the page store, plus the compact keys with a
shortlist) and the median seconds of one decode step's choice over all layers.

With --model, the cache has that model's geometry and trained context, and each variant also times
--decode-steps whole decode steps of the real model (its weights, --weights) over that synthetic history:
forward + commit of one token, row-exact as the engine decodes, past the trained context in InfLLM's layout.
What a decode step costs at 32k against 1k (issue 29: >= 0.8x) is read from these, side by side in one run: every
length keeps its own cache, and the steps are interleaved (each round one step per length, variant and arm, then
`full`), so a drift in the box's speed lands on every cell alike.
--step-arms times each whole decode step per arm, interleaved: `pieces` (every op from Python, what a paged step ran
before the native segments), `native` (the native CPU step as it runs by default: a paged decode step is one C++ call,
its page choice, page reads and attention included, csrc/paged_rows.h), `native-segments` (the same recall in C++, but
layer by layer between the C++ segments of the dense work, backends/torch/native.NativeSegments: what a verify block
runs), `native-python-recall` (the segments, page choice and attention in kv/paged.py: the native step before
csrc/paged_rows.h), `native-keys1` (the default step with the compact keys' dots summed one or two keys at a time,
as before key_dots8: the same bits; the fp32 query's kernel only, so with `--queries fp32`), `native-keys-avx2` (the
default step with the int8 query's 4-bit keys scored by the AVX2 code where an AVX-512 VNNI build takes two keys a
vector: the same bits). --full-reference N also
times
`full` at N tokens of the same random history through the native whole-step call (issue 29: paged at 32k >= 0.9x
full at 1k). --kv-dtypes fp32,fp16 times every cell (and `full`) with each resident K/V dtype (`--kv-dtype`: fp16
keeps the slab and the page store in fp16), interleaved as well; keys then end in `+kv_fp16` / `+kv_fp32`.
--queries int8,fp32 times every cell (and `full`) with the compact keys scored against the int8 query (the default,
kv/paged_store.query_int8) and against the fp32 one (before), interleaved; keys then end in `+q_int8` / `+q_fp32`.

    .venv/bin/python scripts/research/paged_scaling.py --lengths 1024,8192,32768,102400 --shortlists 32,64
    .venv/bin/python scripts/research/paged_scaling.py --model smollm2-135m-instruct --weights int4 \
        --lengths 1024,32768 --decode-steps 8
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, fill_with_random_kv, run_metadata, write_json  # noqa: E402

OUT = ROOT / "results" / "research" / "paged_scaling.json"


def merge(files: list[str], out: str) -> int:
    """Runs of this script merged into one file (one experiment, its parts side by side): per run its file, commit,
    command, CPU and load at start, its far_from and RAM budget, the decode step per length and arm, `full`'s reference
    and the ratios. Each run's cells were interleaved within it; runs one after another are compared by their ratios."""
    import json

    runs = []
    for f in files:
        d = json.loads(pathlib.Path(f).read_text())
        lengths = d["lengths"]
        runs.append({"file": f, "commit": d["commit"], "dirty_worktree": d["dirty_worktree"], "date_utc": d["date_utc"],
                     "command": d["command"], "cpu": d["machine"]["cpu"],
                     "load_average_at_start": d["machine"]["load_average_at_start"],
                     "far_from": d["config"].get("far_from", 0), "page_ram_mb": d["config"].get("page_ram_mb"),
                     "decode_step_s": {n: v["decode_step_s"] for n, v in lengths.items() if n.isdigit()},
                     "full_reference": lengths.get("full_reference"), "ratios": lengths.get("ratios", {})})
    write_json(pathlib.Path(out), run_metadata({"merge": files}) | {"what": "paged_scaling runs merged", "runs": runs})
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1024,8192,32768,102400")
    ap.add_argument("--shortlists", default="32,64")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30, help="SmolLM2-135M's geometry by default")
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="", help="a model from the store: its geometry, context and decode steps")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--step-arms", default="native",
                    help="comma list of pieces, native, native-segments, native-python-recall, native-keys1, "
                         "native-keys-avx2 (with --model)")
    ap.add_argument("--full-reference", type=int, default=0, help="also time full at this many tokens (with --model)")
    ap.add_argument("--kv-dtypes", default="fp32", help="comma list of fp32, fp16: the resident K/V (and page store) dtype")
    ap.add_argument("--queries", default="int8",
                    help="comma list of int8, fp32: the query the compact keys are scored against (paged_store.query_int8)")
    ap.add_argument("--far-from", type=int, default=0,
                    help="paged: InfLLM's layout from this position (`kakeya serve --page-far-from`; 0: the trained "
                         "context). The daemon's default past the context is 4096 (`--page-far-after context`: a "
                         "session runs the trained context's layout until it passes it, then 4096's), which at every "
                         "length here is what 4096 from the start gives: the same bits under 4096")
    ap.add_argument("--page-ram-mb", type=float, default=None,
                    help="paged: the page store's RAM budget a session (`kakeya serve --page-ram-mb`; default: the "
                         "daemon's, 128); the rest, and past the shortlist's start the older compact keys, in "
                         "memory-mapped spill files")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--merge", nargs="+", default=None, help="merge these runs' JSON files into --out and stop")
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, args.out)

    import torch

    from inference_engine.kv import paged_store
    from inference_engine.kv.factory import make_cache
    from inference_engine.kv.layout import CacheGeometry
    from inference_engine.kv.strategy import KVStrategy

    torch.set_num_threads(args.threads)
    shortlists = [int(s) for s in args.shortlists.split(",")]
    lengths = sorted(int(n) for n in args.lengths.split(","))
    kv_dtypes = args.kv_dtypes.split(",")
    if not kv_dtypes or any(dt not in ("fp32", "fp16") for dt in kv_dtypes):
        raise SystemExit(f"--kv-dtypes takes fp32 and/or fp16, got {args.kv_dtypes!r}")
    tag = {dt: (f"+kv_{dt}" if len(kv_dtypes) > 1 else "") for dt in kv_dtypes}  # step keys' suffix
    queries = args.queries.split(",")
    if not queries or any(qq not in ("int8", "fp32") for qq in queries):
        raise SystemExit(f"--queries takes int8 and/or fp32, got {args.queries!r}")
    qtag = {qq: (f"+q_{qq}" if len(queries) > 1 else "") for qq in queries}
    model = None
    if args.model:
        from inference_engine.backends.torch.model import TorchCausalLM
        from inference_engine.engine.steps import forward
        from inference_engine.model_store import resolve_model

        model = TorchCausalLM.load(resolve_model(args.model), weights=args.weights)
        arms = args.step_arms.split(",")
        if any(a.startswith("native") for a in arms) and not model.use_native_step():
            raise SystemExit("the native step is unavailable here (see the log)")
        native_step = model.native_step

        def arm(name: str) -> None:
            model.native_step = native_step if name.startswith("native") else None
            if native_step is not None:  # native = the default (a decode step whole, its recall in C++)
                native_step.paged_recall = {"native-segments": "segments", "native-python-recall": "python"}.get(name, "whole")
                # native-keys1: the default step with the compact keys' scores summed one or two keys at a time
                native_step.module.score_eight(0 if name == "native-keys1" else 1)
                # native-keys-avx2: the default step with the keys scored by the AVX2 code on an AVX-512 VNNI build
                native_step.module.score_keys_avx512(0 if name == "native-keys-avx2" else 1)
        geometry = model.geometry()
        args.layers, args.kv_heads, args.head_dim = geometry.num_layers, geometry.num_kv_heads, geometry.head_dim
        args.heads = model.spec.num_heads
        context = model.spec.max_context
    else:
        geometry = CacheGeometry(num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                                 layer_windows=(None,) * args.layers, dtype=torch.float32, device="cpu")
        context = lengths[-1] + args.chunk  # past the longest history: every choice below it, at true positions
    strategies = {dt: KVStrategy("paged", 4, 508, page_size=64, recall_pages=8, shortlist_pages=shortlists[0],
                                 shortlist_from=0, kv_dtype=dt, far_from=args.far_from,
                                 **({} if args.page_ram_mb is None else {"page_ram_mb": args.page_ram_mb}))
                  for dt in kv_dtypes}
    gen = torch.Generator().manual_seed(0)
    out: dict = {}
    caches: dict = {}
    t_fill = time.perf_counter()
    for n in lengths:  # a cache per length and dtype (filled in turn), so the decode steps below can interleave them
        for dt in kv_dtypes[1:] if model is not None else ():
            caches[n, dt] = make_cache(strategies[dt], geometry, max_step=args.chunk, max_context=context)
            fill_with_random_kv(caches[n, dt], n, args.chunk, torch.Generator().manual_seed(n))
        # the first dtype's cache also times the page choice alone (its cost does not depend on the K/V's dtype)
        cache = caches[n, kv_dtypes[0]] = make_cache(strategies[kv_dtypes[0]], geometry, max_step=args.chunk,
                                                     max_context=context)
        fill_with_random_kv(cache, n, args.chunk, torch.Generator().manual_seed(n))
        q = torch.randn(args.heads, 1, args.head_dim, generator=gen)
        # "<S>-<path>": the shortlist's choice with few-query scoring forced to each other path ("int": torch._int_mm,
        # "float", "native": the native step's kernel), against the path paged_store.scoring_path() measured fastest
        # here (`scoring` below)
        measured = paged_store.scoring_path()
        others = [p for p in ("int", "float", "native") if p != measured
                  and (p != "native" or paged_store._score_kernel is not None)]
        times: dict = {"exact": []} | {str(s): [] for s in shortlists} | {f"{s}-{p}": [] for s in shortlists for p in others}
        for _ in range(args.repeats):
            for name in times:  # interleaved: the same load for every variant
                paged_store._scoring = name.split("-")[1] if "-" in name else measured
                cache.shortlist = cache.shortlist_from = 0 if name == "exact" else int(name.split("-")[0])
                cache.prepare(range(n, n + 1))
                plan = cache._step
                t0 = time.perf_counter()
                if plan is not None:
                    for layer in range(args.layers):
                        cache._choose_pages(layer, q, cache.store.k[layer], plan, None)
                times[name].append(time.perf_counter() - t0)
                cache.abort()
        paged_store._scoring = measured
        cache.shortlist = cache.shortlist_from = shortlists[0]
        pages = cache.pages.rows // 64
        out[str(n)] = {
            "archived_positions": cache.pages.rows, "pages": pages,
            "bytes": {"resident": cache.resident_nbytes, "page_bounds": cache.bounds.nbytes,
                      "compact_keys": cache.keys.nbytes, "page_store": cache.pages.nbytes},
            "tiers_with_shortlist": {"hot": cache.resident_nbytes + cache.bounds.nbytes,
                                     "stored": cache.pages.nbytes + cache.keys.nbytes},
            "tiers_exact": {"hot": cache.resident_nbytes + cache.keys.nbytes, "stored": cache.pages.nbytes},
            "bytes_by_kv_dtype": {dt: {"resident": caches[n, dt].resident_nbytes, "page_store": caches[n, dt].pages.nbytes}
                                  for dt in kv_dtypes if (n, dt) in caches},
            "choice_s_per_decode_step": {k: statistics.median(v) for k, v in times.items()},
        }
        print(n, out[str(n)], flush=True)
    if model is not None:
        # whole decode steps, interleaved: each round one step per (length, variant, arm) in turn, and of `full` at
        # --full-reference tokens, so a drift in the box's speed lands on every cell alike (the ratios below are
        # taken side by side)
        variants = ["exact"] + [str(s) for s in shortlists]
        cells = {f"{name}/{a}{tag[dt]}{qtag[qq]}": (name, a, dt, qq)
                 for name in variants for a in arms for dt in kv_dtypes for qq in queries}
        steps = {n: {key: [] for key in cells} for n in lengths}
        full: dict = {}
        ref = None
        if args.full_reference:
            for dt in kv_dtypes:
                full[dt] = make_cache(KVStrategy("full", kv_dtype=dt), geometry, max_step=args.chunk, max_context=context)
                fill_with_random_kv(full[dt], args.full_reference, args.chunk, torch.Generator().manual_seed(1))
            ref_cells = {f"{a}{tag[dt]}{qtag[qq]}": (a, dt, qq) for a in arms for dt in kv_dtypes for qq in queries}
            ref = {key: [] for key in ref_cells}
        token = model.tensor([17])

        def timed(cache) -> float:
            at = cache.next_position
            t0 = time.perf_counter()
            forward(model, token, range(at, at + 1), cache, logits="last", row_exact=True)
            cache.commit()
            return time.perf_counter() - t0

        for _ in range(args.decode_steps):
            for n in lengths:
                for key in steps[n]:
                    name, a, dt, qq = cells[key]
                    arm(a)
                    paged_store.query_int8(qq == "int8")
                    c = caches[n, dt]
                    c.shortlist = c.shortlist_from = 0 if name == "exact" else int(name)
                    steps[n][key].append(timed(c))
            if ref is not None:
                for key in ref:
                    a, dt, qq = ref_cells[key]
                    arm(a)
                    paged_store.query_int8(qq == "int8")
                    ref[key].append(timed(full[dt]))
        paged_store.query_int8(True)
        for n in lengths:
            out[str(n)]["decode_step_s"] = {k: statistics.median(v) for k, v in steps[n].items()}
            out[str(n)]["decode_step_s_mean"] = {k: statistics.mean(v) for k, v in steps[n].items()}
        if ref is not None:
            out["full_reference"] = {"tokens": args.full_reference, "decode_step_s": {a: statistics.median(v) for a, v in ref.items()}}
            print("full", out["full_reference"], flush=True)
        out["native_steps"] = ({"whole": native_step.steps, "whole_paged": native_step.paged_steps,
                                "segments": native_step.segment_steps} if native_step else None)
        first, last = str(lengths[0]), str(lengths[-1])
        out["ratios"] = {f"{key}: step at {first} / step at {last} (decode rate at {last} over {first})":
                         out[first]["decode_step_s"][key] / out[last]["decode_step_s"][key]
                         for key in out[first]["decode_step_s"]}
        if "full_reference" in out:
            for a, s_full in out["full_reference"]["decode_step_s"].items():
                for key, s_paged in out[last]["decode_step_s"].items():
                    if key.endswith("/" + a):
                        out["ratios"][f"{key} at {last} vs full/{a} at {args.full_reference}"] = s_full / s_paged
    out["scoring"] = paged_store.scoring_path()
    meta = run_metadata(vars(args) | {"strategy": f"paged sink 4, window 508, page 64, recall 8, far_from {args.far_from}",
                                      "max_context": context,
                                      "decode_steps_interleaved": "each round: one step per (length, variant, arm), then full",
                                      "kv": "random normal K/V (the choice's cost and bytes do not depend on them)",
                                      "fill_s": time.perf_counter() - t_fill})
    write_json(pathlib.Path(args.out), meta | {"lengths": out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
