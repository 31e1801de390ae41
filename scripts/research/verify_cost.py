"""What a speculative verify block costs against one decode step, on this CPU (issue 28's gate:
a 5-row verify block <= 1.3x one decode step).

One model, sessions of the daemon's default strategy at each --contexts length; per round and
context: --steps decode steps (`steps.decode_step`), then --steps verify blocks of 1 + (--rows - 1)
drafted tokens (`steps.verify_block`, greedy, drafts that are all rejected, so each block commits
one token and the context stays put), interleaved in rounds so a loaded machine slows both alike.
With several --compile modes (e.g. off,auto: the Python pieces and the native CPU row step) each mode
gets its own sessions, measured in the same rounds, and the JSON holds one block per mode. A mode
`auto/row` is the native step with a step's tasks run row by row (the order before the default's, by
the data they read: the same bits, csrc/row_step.cpp order_by_data); `auto/untrimmed` the native step scanning
every column of its rows' masks, its per-row loops on one thread, SiLU in plain floats (trim_columns 0, rows_apart
0, silu_vectors 0: the step before 39c54e0); `auto/planes2` the native step with the int4 kernel's activations as
two int8 planes in every layer, `auto/outliers` with one plane and native.OUTLIERS outlier channels per linear
exact (whichever native.PLANES makes the default, side by side); --prefill-chunk N also times a
prefill chunk of N rows at each context (forwarded, then aborted), where that order matters most.
Records the median ms of each and their ratio, and the split of a verify block's time: the same
forward with row_exact off (rows attend batched, as a prefill chunk does) shows what row-exact
attention costs.

    python scripts/research/verify_cost.py --threads 2 --out results/research/verify_cost.json
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_common import ROOT, run_metadata, write_json  # noqa: E402


def merge(args) -> int:
    runs, by_commit = [], {}
    for f in args.merge:
        d = json.loads(pathlib.Path(f).read_text())
        keys = ("decode_ms_median", "verify_ms_median", "verify_vs_decode")
        arms = {mode: {c: {k: v[k] for k in keys} for c, v in m.get("by_context", {}).items()}
                for mode, m in d["by_compile"].items()}
        cells = arms.get("auto", {})
        runs.append({"file": f, "commit": d["commit"], "dirty_worktree": d["dirty_worktree"], "date_utc": d["date_utc"],
                     "cpu": d["machine"]["cpu"], "rounds": d["config"].get("rounds"), "auto": cells, "by_compile": arms})
        for c, v in cells.items():
            for k, x in v.items():
                by_commit.setdefault(d["commit"][:7], {}).setdefault(c, {}).setdefault(k, []).append(x)
    ranges = {commit: {c: {k: [min(xs), max(xs)] for k, xs in v.items()} for c, v in cells.items()}
              for commit, cells in by_commit.items()}
    doc = run_metadata({"merge": args.merge}) | {
        "what": "verify_cost runs merged: the native step's decode and verify medians (ms) per run, and their range "
                "per commit (run-to-run spread on a shared box is the yardstick for any difference)",
        "runs": runs, "range_by_commit": ranges}
    write_json(pathlib.Path(args.out), doc)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--weights", default="int4", choices=("fp32", "int8", "int4"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", default="128,1024")
    p.add_argument("--rows", type=int, default=5, help="rows of a verify block: the fed token + rows - 1 drafts")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compile", default="off,auto",
                   help="--compile modes, comma-separated (off, auto, on, auto/row: native, attention row by row; "
                        "auto/untrimmed: native, every mask column scanned; auto/planes2: native, the int4 kernel's "
                        "activations as two int8 planes; auto/outliers: one plane with outlier channels), side by side")
    p.add_argument("--prefill-chunk", type=int, default=0, help="also time a prefill chunk of this many rows (0: no)")
    p.add_argument("--out", default=str(ROOT / "results" / "research" / "verify_cost.json"))
    p.add_argument("--merge", nargs="+", default=[], metavar="PART_JSON",
                   help="only merge these runs (e.g. of two commits, for a regression check) into --out: per run its "
                        "commit, every --compile arm's medians (side by side within the run), and per commit the range "
                        "of the native (--compile auto) medians over its runs")
    args = p.parse_args(argv)
    if args.merge:
        return merge(args)

    import torch

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine import steps
    from inference_engine.engine.generate import Engine
    from inference_engine.engine.requests import SamplingParams
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model
    from inference_engine.server.config import ServeConfig

    torch.set_num_threads(args.threads)
    meta = run_metadata(vars(args))
    m = TorchCausalLM.load(resolve_model(args.model), weights=args.weights)
    modes = args.compile.split(",")
    setups = {}
    for mode in modes:  # each mode's step machinery, swapped in around its measurements
        m.use_step_graphs(mode.split("/")[0])
        if mode.endswith("/planes2") and m.native_step is not None:  # the int4 kernel's two-plane activations
            m.use_native_step(planes=2, outliers=0)
        if mode.endswith("/outliers") and m.native_step is not None:  # one plane, outlier channels exact
            m.use_native_step(planes=1)
        setups[mode] = (m.graphs, m.native_step, m.describe_step())
    cfg = ServeConfig()
    strategy = KVStrategy(cfg.kv_strategy, cfg.sink, cfg.resolved_window)
    contexts = [int(c) for c in args.contexts.split(",")]
    engine = Engine(m, strategy, prefill_chunk=256)
    greedy = SamplingParams()
    sessions = {}
    span = min(1000, m.spec.vocab_size - 100)  # token ids 100 .. 100 + span (a tiny test model's vocabulary is small)
    for mode in modes:
        for c in contexts:
            kv = engine.new_session_kv()
            prompt = [(7 * i + 3) % span + 100 for i in range(c)]
            for i in range(0, c, 256):
                steps.prefill_chunk(m, kv, prompt[i : i + 256])
            sessions[mode, c] = kv

    def use(mode):
        m.graphs, m.native_step, _ = setups[mode]
        if m.native_step is not None:
            mod = m.native_step.module
            mod.order_by_data(0 if mode.endswith("/row") else 1)
            untrimmed = mode.endswith("/untrimmed")  # every mask column scanned, per-row loops on one thread
            mod.trim_columns(0 if untrimmed else 1)
            mod.rows_apart(0 if untrimmed else 1)
            mod.silu_vectors(0 if untrimmed else int(mod.q4_isa() != 0))

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def wrong_drafts(kv) -> list:
        """rows - 1 drafts the verifier rejects at once (the first is not its argmax)."""
        best = int(kv.last_logits.argmax())
        return [(best + 1 + j) % m.spec.vocab_size for j in range(args.rows - 1)]

    def verify(kv):
        drafts = wrong_drafts(kv)
        steps.verify_block(m, kv, int(kv.last_logits.argmax()), drafts, greedy, None, budget=args.rows, greedy=True)

    def batched_rows(kv):
        """The same rows through one forward that attends them batched (row_exact off), then aborted."""
        ids = [int(kv.last_logits.argmax()), *wrong_drafts(kv)]
        start = kv.cache.next_position
        steps.forward(m, m.tensor(ids), range(start, start + len(ids)), kv.cache, logits="all")
        kv.cache.abort()

    def prefill_rows(kv):
        """A prefill chunk of --prefill-chunk rows at the session's context, forwarded as the engine does, then aborted."""
        start = kv.cache.next_position
        ids = [(11 * i + 5) % span + 100 for i in range(args.prefill_chunk)]
        steps.forward(m, m.tensor(ids), range(start, start + len(ids)), kv.cache, logits="last", row_exact=True)
        kv.cache.abort()

    kinds = ["decode", "verify", "verify_rows_batched"] + (["prefill_chunk"] if args.prefill_chunk else [])
    times: dict = {key: {k: [] for k in kinds} for key in sessions}
    for (mode, _), kv in sessions.items():  # warm-up
        use(mode)
        steps.decode_step(m, kv, int(kv.last_logits.argmax()), greedy=True)
        verify(kv)
        batched_rows(kv)
        if args.prefill_chunk:
            prefill_rows(kv)
    for r in range(args.rounds):
        for (mode, c), kv in sessions.items():
            use(mode)
            t = times[mode, c]
            t["decode"] += [timed(lambda: steps.decode_step(m, kv, int(kv.last_logits.argmax()), greedy=True))
                            for _ in range(args.steps)]
            t["verify"] += [timed(lambda: verify(kv)) for _ in range(args.steps)]
            t["verify_rows_batched"] += [timed(lambda: batched_rows(kv)) for _ in range(args.steps)]
            if args.prefill_chunk:
                t["prefill_chunk"].append(timed(lambda: prefill_rows(kv)))
        print(f"round {r + 1}/{args.rounds}", flush=True)
    by_mode = {}
    for mode in modes:
        result = {}
        for c in contexts:
            med = {k: statistics.median(v) * 1000 for k, v in times[mode, c].items()}
            result[str(c)] = {f"{k}_ms_median": round(v, 3) for k, v in med.items()} | {
                "verify_vs_decode": round(med["verify"] / med["decode"], 3),
                "verify_rows_batched_vs_decode": round(med["verify_rows_batched"] / med["decode"], 3)}
            print(mode, c, result[str(c)], flush=True)
        by_mode[mode] = {"step": setups[mode][2], "by_context": result,
                         "met": all(v["verify_vs_decode"] <= 1.3 for v in result.values())}
    if len(modes) > 1:  # the modes' decode and verify times against the first's, same rounds
        base = by_mode[modes[0]]["by_context"]
        for mode in modes[1:]:
            for c, v in by_mode[mode]["by_context"].items():
                v[f"decode_speedup_vs_{modes[0]}"] = round(base[c]["decode_ms_median"] / v["decode_ms_median"], 3)
                v[f"verify_speedup_vs_{modes[0]}"] = round(base[c]["verify_ms_median"] / v["verify_ms_median"], 3)
                if args.prefill_chunk:
                    v[f"prefill_chunk_speedup_vs_{modes[0]}"] = round(
                        base[c]["prefill_chunk_ms_median"] / v["prefill_chunk_ms_median"], 3)
    doc = meta | {"strategy": strategy.describe(), "by_compile": by_mode,
                  "target": {"verify_vs_decode_le": 1.3, "met_by": [k for k, v in by_mode.items() if v["met"]]}}
    write_json(pathlib.Path(args.out), doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
