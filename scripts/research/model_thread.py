"""Does it matter which OS thread runs the forwards? (engine/model_thread.py)

Each arm runs in its own process (torch's OpenMP pools are per process and per thread), loads
SmolLM2 int4, prefills --context tokens and greedily generates --tokens through Engine.generate;
decode tok/s = (tokens - 1) / (time after the first token), best of --reps:

  main        load and generate on the main thread (in-process reference)
  second      load on the main thread, generate on a second thread (the daemon before the fix:
              gRPC workers ran the forwards)
  model_thread  the daemon now: load and every forward on a ModelThread, the generate loop on
              a second thread, other threads isolated to one torch thread

Writes results/research/model_thread.json. Run it on an idle machine: the effect is about how
OpenMP workers wait, and other load changes it.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, run_metadata, write_json  # noqa: E402

ARMS = ("main", "second", "model_thread")


def run_arm(arm: str, context: int, tokens: int, reps: int, threads: int) -> dict:
    import torch

    from inference_engine.engine.events import TokenGenerated
    from inference_engine.engine.generate import Engine
    from inference_engine.engine.model_thread import ModelThread, isolate_other_threads
    from inference_engine.engine.requests import GenerateParams, SamplingParams
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.model_store import resolve_model

    torch.set_num_threads(threads)

    def build(model_thread=None):
        model = TorchCausalLM.load(resolve_model("smollm2-135m-instruct"), device="cpu", weights="int4")
        return Engine(model, KVStrategy("sink_window"), max_threads=threads, batching="on", model_thread=model_thread)

    def decode(engine) -> list:
        rates = []
        for _ in range(reps):
            kv = engine.new_session_kv()
            history = [100 + (i * 37) % 20000 for i in range(context)]
            n, t1 = 0, None
            for ev in engine.generate(kv, history, GenerateParams(tokens, SamplingParams(), ())):
                if isinstance(ev, TokenGenerated):
                    n += 1
                    if n == 1:
                        t1 = time.perf_counter()
            rates.append((n - 1) / (time.perf_counter() - t1))
        return rates

    out: dict = {}
    if arm == "main":
        out["rates"] = decode(build())
    elif arm == "second":
        engine = build()
        th = threading.Thread(target=lambda: out.update(rates=decode(engine)))
        th.start()
        th.join()
    elif arm == "model_thread":
        mt = ModelThread()
        engine = mt.call(lambda: build(mt))
        isolate_other_threads()
        th = threading.Thread(target=lambda: out.update(rates=decode(engine)))
        th.start()
        th.join()
    else:
        raise ValueError(arm)
    return {"arm": arm, "decode_tok_s": [round(r, 1) for r in out["rates"]], "best_tok_s": round(max(out["rates"]), 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="arms alternate this many times (each a fresh process)")
    ap.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "results" / "research" / "model_thread.json")
    a = ap.parse_args()
    if a.arm:
        print(json.dumps(run_arm(a.arm, a.context, a.tokens, a.reps, a.threads)))
        return 0
    load_at_start = os.getloadavg()
    rows = []
    for r in range(a.rounds):
        for arm in ARMS:
            cmd = [sys.executable, os.path.abspath(__file__), "--arm", arm, "--context", str(a.context), "--tokens",
                   str(a.tokens), "--reps", str(a.reps), "--threads", str(a.threads)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
            row = json.loads(res.stdout.strip().splitlines()[-1])
            row["round"] = r
            rows.append(row)
            print(row, flush=True)
    best = {arm: max(x["best_tok_s"] for x in rows if x["arm"] == arm) for arm in ARMS}
    meta = run_metadata({"context": a.context, "tokens": a.tokens, "reps": a.reps, "threads": a.threads, "rounds": a.rounds,
                         "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg()})
    write_json(a.out, meta | {
        "experiment": "decode speed by the OS thread that runs the forwards (SmolLM2 int4, sink_window, Engine.generate)",
        "runs": rows,
        "best_tok_s": best,
        "ratios": {"second_vs_main": round(best["second"] / best["main"], 3),
                   "model_thread_vs_main": round(best["model_thread"] / best["main"], 3)},
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
