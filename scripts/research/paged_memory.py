"""`paged`'s memory per session at long histories, with and without the disk tier (issue 29, item 2).

Issue 29's target: at 32k and 100k tokens of history, hot (resident + selection) <= 64 MB and host RAM <= hot +
`--page-ram-mb` (default 128), the rest on disk. Each variant runs in its own process (so its RSS is its own):

  spill  page_ram_mb 128 (the default; --page-ram-mb): the newest pages within the budget in RAM, older ones in
         spill files
  ram    page_ram_mb 0: every page in RAM (what paged did before the disk tier), the control

Each process loads the real model (its weights, --weights; its decode steps on the path `kakeya serve --compile`
takes, --compile; the K/V dtype the daemon resolves for `paged`, --kv-dtype), notes its RSS, then fills one real PagedCache with random
K/V through the cache's own API (prepare, update_and_fetch, commit: rows archived, compact keys and page bounds made
as in serving; no model forward, so the history reaches 100k tokens in minutes) to each length in turn, and there:

  * the cache's tiers (`kv_bytes`: resident, selection (hot together), stored = warm (RAM), cold (disk));
  * the process's RssAnon / RssFile (/proc/self/status) less what they were before the cache: what the session
    costs in anonymous memory, and how much of its spill files' map the kernel holds resident (page cache,
    reclaimable; not the session's RAM); and the anonymous peaks on the way there (sampled every 5 ms, less RssAnon
    before the cache): through the fill (the cache alone), and through the steps (the forward's transient buffers
    included: the model's, not the session's);
  * --decode-steps whole decode steps of the real model over that history (forward + commit of one token,
    row-exact as the engine decodes; past the trained context in InfLLM's layout), median, after one untimed step
    (its first step makes far_keys from the whole page store: the fill runs no model step); for `spill` also with its
    spill files dropped from the page cache before every step (madvise + fsync + posix_fadvise DONTNEED): each
    recalled page read from the disk.

With --resume-step, also each length's first decode step after the session is saved and loaded into a new cache
(after the RSS readings): with far_keys in the saved state, and without them (how states saved before far_keys
were saved load: that step makes them from the whole page store), side by side.

The query's recalled pages follow from random keys, so they are spread over the whole history (no locality: the
worst case for a disk tier). Ratios side by side: decode spill / ram at each length, 32k / 1k per variant.

    .venv/bin/python scripts/research/paged_memory.py --lengths 1024,32768,102400 --decode-steps 16
"""
from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, PeakRSS, fill_with_random_kv, run_metadata, write_json  # noqa: E402

OUT = ROOT / "results" / "research" / "paged_memory.json"
VARIANTS = {"spill": 128, "ram": 0}  # page_ram_mb


def rss() -> dict:
    """This process's RSS, after giving glibc's free heap memory back to the system (malloc_trim): what is held,
    not what the allocator keeps for reuse."""
    from inference_engine.server.host_memory import trim

    trim()
    out = {}
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def drop_spill_files(cache) -> int:
    """Drop every spill file of the cache from the page cache (and from this process's map): the next read of any
    spilled row goes to the disk. Returns the number of files."""
    n = 0
    for table in (cache.pages, cache.keys, cache.far_keys):
        for f in getattr(table, "files", {}).values():
            if f.map is not None:
                f.map.madvise(mmap.MADV_DONTNEED)
            os.fsync(f.fd)
            os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
    return n


def run_variant(args) -> dict:
    import torch

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.steps import forward
    from inference_engine.kv.byte_counts import kv_bytes
    from inference_engine.kv.factory import make_cache
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model

    from inference_engine.server.app import resolve_kv_dtype
    from inference_engine.server.config import ServeConfig

    torch.set_num_threads(args.threads)
    model = TorchCausalLM.load(resolve_model(args.model), weights=args.weights)
    model.use_step_graphs(args.compile)
    g = model.geometry()
    budget = args.page_ram_mb if args.variant == "spill" else VARIANTS[args.variant]
    # the K/V dtype the daemon takes for `paged` with these settings (--kv-dtype auto: fp16 where the native step reads
    # it in its registers)
    kv_dtype = resolve_kv_dtype(ServeConfig(kv_strategy="paged", kv_dtype=args.kv_dtype), model)
    # and the candidate pages from which the page shortlist applies (the daemon's --page-shortlist-from default unless
    # --shortlist-from is given)
    shortlist_from = ServeConfig.page_shortlist_from if args.shortlist_from < 0 else args.shortlist_from
    strategy = KVStrategy("paged", 4, 508, page_size=64, recall_pages=8, page_ram_mb=budget, kv_dtype=kv_dtype,
                          shortlist_from=shortlist_from)
    gen = torch.Generator().manual_seed(0)
    token = model.tensor([17])

    def fill(cache, n: int) -> None:
        fill_with_random_kv(cache, n, args.chunk, gen)

    # the model's own first-use allocations (workspaces, kernels' caches) go to the baseline, not to the cache
    warm = make_cache(strategy, g, max_step=args.chunk, max_context=model.spec.max_context)
    fill(warm, 2048)
    for _ in range(2):
        forward(model, token, range(warm.next_position, warm.next_position + 1), warm, logits="last", row_exact=True)
        warm.commit()
    del warm
    gc.collect()
    before = rss()
    cache = make_cache(strategy, g, max_step=args.chunk, max_context=model.spec.max_context)
    out: dict = {"rss_before_cache": before, "page_ram_mb": strategy.page_ram_mb, "kv_dtype": kv_dtype,
                 "shortlist_from": shortlist_from,
                 "step": model.describe_step(), "lengths": {}}

    def step() -> float:
        at = cache.next_position
        t0 = time.perf_counter()
        forward(model, token, range(at, at + 1), cache, logits="last", row_exact=True)
        cache.commit()
        return time.perf_counter() - t0

    def resumed_step(live, keep_far_keys: bool) -> float:
        """The first decode step of the session saved (`state()`) and loaded into a new cache, as a restarted daemon
        resumes it: with far_keys in the state, or without them (a state saved before they were saved: the step
        makes them from the page store)."""
        st = live.state()
        if not keep_far_keys:
            st.tensors = {k: v for k, v in st.tensors.items() if not k.startswith("far_keys.")}
        other = make_cache(strategy, g, max_step=args.chunk, max_context=model.spec.max_context)
        other.load_state(st)
        del st
        at = other.next_position
        t0 = time.perf_counter()
        forward(model, token, range(at, at + 1), other, logits="last", row_exact=True)
        other.commit()
        dt = time.perf_counter() - t0
        del other
        gc.collect()
        return dt

    for n in sorted(int(x) for x in args.lengths.split(",")):
        with PeakRSS(0.005) as fill_mem:  # the fill to this length (the cache's API, no model): the anonymous peak on the way
            t_fill = time.perf_counter()
            fill(cache, n)
            fill_s = time.perf_counter() - t_fill
        with PeakRSS(0.005) as mem:  # the steps (the model's own transient buffers included)
            first = step()  # untimed: past the context, the first step builds far_keys
            times = [step() for _ in range(args.decode_steps)]
            row: dict = {"history": cache.next_position, "fill_s": fill_s, "first_step_s": first,
                         "decode_step_s": statistics.median(times), "decode_step_s_all": times}
            if args.variant == "spill" and cache.cold_nbytes:
                cold_times = []
                for _ in range(args.decode_steps):
                    drop_spill_files(cache)
                    cold_times.append(step())
                row["decode_step_s_spill_files_dropped"] = statistics.median(cold_times)
                row["decode_step_s_spill_files_dropped_all"] = cold_times
        row["peak_anon_of_cache"] = fill_mem.peak_anon - before["RssAnon"]
        row["peak_anon_steps"] = mem.peak_anon - before["RssAnon"]
        tiers = kv_bytes(cache)
        gc.collect()
        now = rss()
        row |= {"tiers": {"resident": tiers.resident, "selection": tiers.selection, "hot": tiers.resident + tiers.selection,
                          "warm_ram": tiers.stored, "cold_disk": tiers.cold},
                "rss": now, "rss_anon_of_cache": now["RssAnon"] - before["RssAnon"],
                "rss_file_of_cache": now["RssFile"] - before["RssFile"],
                "shortlisting": cache.shortlisting, "past_context": cache.next_position >= model.spec.max_context}
        if args.resume_step:  # after the RSS readings: the copies a state makes are not the session's
            row["resumed_first_step_s"] = resumed_step(cache, keep_far_keys=True)
            row["resumed_first_step_s_without_far_keys"] = resumed_step(cache, keep_far_keys=False)
        out["lengths"][str(n)] = row
        print(args.variant, n, {k: v for k, v in row.items() if not k.endswith("_all")}, file=sys.stderr, flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1024,32768,102400")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=0,
                    help="positions a fill step appends (0: the daemon's --prefill-chunk, 256; before 2026-12-01 this "
                         "script filled 512 at a time, whose grown slab and archive made a higher peak)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--compile", default="auto", choices=("off", "auto"),
                    help="the decode steps' path, as `kakeya serve --compile` (auto: the native CPU row step; before "
                         "2026-12-01 this script ran the Python pieces)")
    ap.add_argument("--kv-dtype", default="auto", choices=("auto", "fp32", "fp16"),
                    help="the K/V dtype, as `kakeya serve --kv-dtype` resolves it (before 2026-12-01 this script ran fp32)")
    ap.add_argument("--shortlist-from", type=int, default=-1,
                    help="paged: the candidate pages past which the page shortlist applies, as `kakeya serve "
                         "--page-shortlist-from` (-1: the daemon's default)")
    ap.add_argument("--page-ram-mb", type=float, default=VARIANTS["spill"], help="the spill variant's budget")
    ap.add_argument("--resume-step", action="store_true",
                    help="also time each length's first decode step after a save and a load (with far_keys saved, and "
                         "without them, as states saved before them load); after the RSS readings")
    ap.add_argument("--variant", default="", help=argparse.SUPPRESS)  # internal: run one variant, JSON on stdout
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    if not args.chunk:
        from inference_engine.server.config import ServeConfig

        args.chunk = ServeConfig().prefill_chunk
    if args.variant:
        print(json.dumps(run_variant(args)))
        return 0

    variants = {}
    for name in args.variants.split(","):
        cmd = [sys.executable, __file__, "--variant", name] + [
            f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in vars(args).items()
            if k not in ("variant", "variants", "out") and v is not False]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, check=True, text=True)
        variants[name] = json.loads(done.stdout.strip().splitlines()[-1])
    lengths = sorted(int(x) for x in args.lengths.split(","))
    ratios: dict = {}
    short = str(lengths[0])
    for name, v in variants.items():
        rows = v["lengths"]
        ratios[f"{name}_decode_rate_vs_{short}"] = {n: rows[short]["decode_step_s"] / r["decode_step_s"] for n, r in rows.items()}
    if {"spill", "ram"} <= variants.keys():
        ratios["spill_over_ram_decode_time"] = {n: variants["spill"]["lengths"][n]["decode_step_s"] / r["decode_step_s"]
                                                for n, r in variants["ram"]["lengths"].items()}
    target = {}
    if "spill" in variants:
        for n, r in variants["spill"]["lengths"].items():
            t = r["tiers"]
            budget = variants["spill"]["page_ram_mb"] * 2 ** 20
            target[n] = {"hot_le_64MB": t["hot"] <= 64 * 2 ** 20,
                         "tiers_ram_le_hot_plus_budget": t["hot"] + t["warm_ram"] <= t["hot"] + budget,
                         "rss_anon_of_cache_le_hot_plus_budget": r["rss_anon_of_cache"] <= t["hot"] + budget,
                         "peak_anon_of_cache_le_hot_plus_budget": r["peak_anon_of_cache"] <= t["hot"] + budget}
    meta = run_metadata(vars(args) | {"strategy": "paged sink 4, window 508, page 64, recall 8, shortlist 64 (variants' shortlist_from)",
                                      "kv": "random normal K/V through the cache's API; decode steps of the real model",
                                      "variants_page_ram_mb": VARIANTS})
    write_json(pathlib.Path(args.out), meta | {"variants": variants, "ratios": ratios, "issue_29_memory_target": target})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
