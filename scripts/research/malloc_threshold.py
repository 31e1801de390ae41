"""What glibc's malloc keeps of freed memory, and what giving it back costs: arms side by side.

Arms (--arms):
- `glibc`: glibc's defaults (a dynamic mmap threshold; freed heap kept) — the baseline;
- `mmap:K`: a fixed mmap threshold of K KiB (the daemon's --malloc-mmap-threshold-kb K; server/host_memory.py),
  set as the daemon sets it, after the imports, before the model loads;
- `trim`: glibc's defaults, and malloc_trim(0) at each turn's end (after the prefill, after the decode steps), as
  the daemon's --malloc-trim on does when its engine loop runs out of work (server/host_memory.trim); its time
  (`trim_ms`, each call's) is not in the prefill's or the steps' (the daemon runs it after the turn);
- `trim-chunk`: `trim`, and malloc_trim(0) after every prefill chunk too (its time in the prefill's): whether
  trimming inside a long append would lower its peak (the daemon does not do this).

Each (arm, strategy) is a process of its own (what one session freed must not serve the next one's allocations),
run in turn with the other arms, `--rounds` times, the order reversed every other round. A process loads the
model (--weights int4, the native step where the machine takes it, as `--compile auto` does) and runs one session
of its strategy (daemon defaults: `paged` with --page-ram-mb 128): a prefill of --prefill real-model tokens (random
ids) in the daemon's chunks of 256, then --decode decode steps (token 17, row-exact). It measures:

- prefill tok/s and the decode step's median;
- the anonymous RSS at its peak through the session (sampled every 5 ms) and after it (the cache still alive,
  after gc), each less the process's anonymous RSS before the cache was made;
- what the cache says it holds (kv_bytes: resident + selection + warm RAM), for the RSS to be compared with.

Ratios: each arm's figures over `glibc`'s, medians over rounds.

    .venv/bin/python scripts/research/malloc_threshold.py --arms glibc,mmap:1024,trim --rounds 3
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, PeakRSS, run_metadata, write_json  # noqa: E402

OUT = ROOT / "results" / "research" / "malloc_threshold.json"


def anon() -> int:
    import psutil

    m = psutil.Process().memory_info()
    return m.rss - m.shared


def child(args) -> dict:
    from inference_engine.server.host_memory import set_mmap_threshold, trim

    import torch

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.steps import forward
    from inference_engine.kv.byte_counts import kv_bytes
    from inference_engine.kv.factory import make_cache
    from inference_engine.model_store import resolve_model
    from inference_engine.server.config import ServeConfig

    arm = args.child_arm
    fixed = set_mmap_threshold(int(arm.split(":")[1])) if arm.startswith("mmap:") else False

    def at_turn_end() -> float:
        if not arm.startswith("trim"):
            return 0.0
        t = time.perf_counter()
        trim()
        return 1e3 * (time.perf_counter() - t)
    torch.set_num_threads(args.threads)
    model = TorchCausalLM.load(resolve_model(args.model), weights=args.weights)
    native = model.use_native_step()
    g = model.geometry()
    vocab = model.spec.vocab_size
    out: dict = {"arm": arm, "threshold_set": fixed, "native_step": native, "strategies": {}}
    token = model.tensor([17])
    for name in [args.strategies]:
        strategy, _ = ServeConfig(kv_strategy=name).strategy()
        ids = torch.randint(0, vocab, (args.prefill,), generator=torch.Generator().manual_seed(1))
        gc.collect()
        before = anon()
        with PeakRSS(0.005) as mem:
            cache = make_cache(strategy, g, max_step=args.chunk, max_context=model.spec.max_context)
            t0 = time.perf_counter()
            for a in range(0, args.prefill, args.chunk):
                part = ids[a:a + args.chunk]
                forward(model, model.tensor(part.tolist()), range(a, a + part.numel()), cache, logits="last")
                cache.commit()
                if arm == "trim-chunk":
                    trim()
            prefill_s = time.perf_counter() - t0
            trims = [at_turn_end()]
            steps = []
            for _ in range(args.decode):
                at = cache.next_position
                t1 = time.perf_counter()
                forward(model, token, range(at, at + 1), cache, logits="last", row_exact=True)
                cache.commit()
                steps.append(time.perf_counter() - t1)
            trims.append(at_turn_end())
        gc.collect()
        tiers = kv_bytes(cache)
        out["strategies"][name] = {
            "prefill_tok_s": args.prefill / prefill_s, "decode_step_ms": 1e3 * statistics.median(steps),
            "peak_anon_mib": (mem.peak_anon - before) / 2**20, "after_anon_mib": (anon() - before) / 2**20,
            "cache_holds_mib": (tiers.resident + tiers.selection + tiers.stored) / 2**20,
            "trim_ms": max(trims) if arm.startswith("trim") else None}
        del cache
        gc.collect()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arms", default="glibc,mmap:4096,trim,trim-chunk", help="glibc (the baseline), mmap:KIB, trim, trim-chunk")
    ap.add_argument("--strategies", default="paged,sink_window")
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--child-arm", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_arm is not None:
        print(json.dumps(child(args)), flush=True)
        return 0

    arms = args.arms.split(",")
    if "glibc" not in arms or any(a not in ("glibc", "trim", "trim-chunk") and not a.startswith("mmap:") for a in arms):
        raise SystemExit(f"--arms takes glibc (required: the baseline), mmap:KIB, trim and trim-chunk, got {args.arms!r}")
    strategies = args.strategies.split(",")
    runs: dict[str, dict[str, list]] = {a: {s: [] for s in strategies} for a in arms}
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    for r in range(args.rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            for s in strategies:
                cmd = [sys.executable, os.path.abspath(__file__), "--child-arm", arm, "--model", args.model,
                       "--weights", args.weights, "--threads", str(args.threads), "--strategies", s, "--prefill", str(args.prefill),
                       "--chunk", str(args.chunk), "--decode", str(args.decode)]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    raise SystemExit(f"arm {arm} ({s}) failed:\n{done.stderr[-3000:]}")
                got = json.loads(done.stdout.strip().splitlines()[-1])
                runs[arm][s].append(got["strategies"][s] | {k: got[k] for k in ("threshold_set", "native_step")})
                print(r, arm, s, runs[arm][s][-1], file=sys.stderr, flush=True)

    keys = ("prefill_tok_s", "decode_step_ms", "peak_anon_mib", "after_anon_mib", "cache_holds_mib", "trim_ms")
    medians = {a: {s: {k: statistics.median(run[k] for run in rs) for k in keys if rs[0][k] is not None}
                   for s, rs in by.items()} for a, by in runs.items()}
    ratios = {a: {s: {k: medians[a][s][k] / medians["glibc"][s][k] for k in keys if k != "trim_ms"} for s in strategies}
              for a in arms if a != "glibc"}
    meta = run_metadata(vars(args) | {"what": "medians over rounds; ratios = the arm's over glibc's "
                                                                 "defaults"})
    write_json(pathlib.Path(args.out), meta | {"medians": medians, "ratios": ratios, "runs": runs})
    print(json.dumps({"medians": medians, "ratios": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
