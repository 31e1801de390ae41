"""What a speculative verify block costs against one decode step, on this CPU (issue 28's gate:
a 5-row verify block <= 1.3x one decode step).

One model, sessions of the daemon's default strategy at each --contexts length; per round and
context: --steps decode steps (`steps.decode_step`), then --steps verify blocks of 1 + (--rows - 1)
drafted tokens (`steps.verify_block`, greedy, drafts that are all rejected, so each block commits
one token and the context stays put), interleaved in rounds so a loaded machine slows both alike.
Records the median ms of each and their ratio, and the split of a verify block's time: the same
forward with row_exact off (rows attend batched, as a prefill chunk does) shows what row-exact
attention costs.

    python scripts/research/verify_cost.py --threads 2 --out results/research/verify_cost.json
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_common import ROOT, run_metadata, write_json  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--weights", default="int4", choices=("fp32", "int8", "int4"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", default="128,1024")
    p.add_argument("--rows", type=int, default=5, help="rows of a verify block: the fed token + rows - 1 drafts")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compile", default="off", choices=("off", "on"))
    p.add_argument("--out", default=str(ROOT / "results" / "research" / "verify_cost.json"))
    args = p.parse_args(argv)

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
    m.use_step_graphs(args.compile)
    cfg = ServeConfig()
    strategy = KVStrategy(cfg.kv_strategy, cfg.sink, cfg.window)
    contexts = [int(c) for c in args.contexts.split(",")]
    engine = Engine(m, strategy, prefill_chunk=256)
    greedy = SamplingParams()
    sessions = {}
    for c in contexts:
        kv = engine.new_session_kv()
        prompt = [(7 * i + 3) % 1000 + 100 for i in range(c)]
        for i in range(0, c, 256):
            steps.prefill_chunk(m, kv, prompt[i : i + 256])
        sessions[c] = kv

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

    times: dict = {c: {"decode": [], "verify": [], "verify_rows_batched": []} for c in contexts}
    for kv in sessions.values():  # warm-up
        steps.decode_step(m, kv, int(kv.last_logits.argmax()), greedy=True)
        verify(kv)
        batched_rows(kv)
    for r in range(args.rounds):
        for c, kv in sessions.items():
            t = times[c]
            t["decode"] += [timed(lambda: steps.decode_step(m, kv, int(kv.last_logits.argmax()), greedy=True))
                            for _ in range(args.steps)]
            t["verify"] += [timed(lambda: verify(kv)) for _ in range(args.steps)]
            t["verify_rows_batched"] += [timed(lambda: batched_rows(kv)) for _ in range(args.steps)]
        print(f"round {r + 1}/{args.rounds}", flush=True)
    result = {}
    for c in contexts:
        med = {k: statistics.median(v) * 1000 for k, v in times[c].items()}
        result[str(c)] = {f"{k}_ms_median": round(v, 3) for k, v in med.items()} | {
            "verify_vs_decode": round(med["verify"] / med["decode"], 3),
            "verify_rows_batched_vs_decode": round(med["verify_rows_batched"] / med["decode"], 3)}
        print(c, result[str(c)], flush=True)
    doc = meta | {"strategy": strategy.describe(), "by_context": result,
                  "target": {"verify_vs_decode_le": 1.3,
                             "met": all(v["verify_vs_decode"] <= 1.3 for v in result.values())}}
    write_json(pathlib.Path(args.out), doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
