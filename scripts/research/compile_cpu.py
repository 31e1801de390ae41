"""Does `--compile on` (the step's dense segments through inductor's C++ backend) decode faster than
the eager pieces on this CPU? Decides what `--compile auto` does on the CPU.

One model, one session per arm, the arms interleaved in rounds (a loaded machine slows both alike);
records per-round ms per decode step, the first compiled step's time (the compile, cold or from the
cache in TORCHINDUCTOR_CACHE_DIR), and whether the two arms' logits are bit-equal.

    python scripts/research/compile_cpu.py --weights int4 --threads 2 --out results/research/compile_cpu.json
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
    p.add_argument("--context", type=int, default=128, help="tokens prefilled before the timed decode steps")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=16, help="decode steps per arm per round")
    p.add_argument("--out", default=str(ROOT / "results" / "research" / "compile_cpu.json"))
    args = p.parse_args(argv)

    import torch

    from inference_engine.backends.torch.graphs import StepGraphs
    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine import steps
    from inference_engine.engine.generate import Engine
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model

    torch.set_num_threads(args.threads)
    meta = run_metadata(vars(args))
    m = TorchCausalLM.load(resolve_model(args.model), weights=args.weights)
    arms = {"eager": None, "inductor": StepGraphs(m, capture=False, compiled=True, buckets=(1,))}
    prompt = [(7 * i + 3) % 1000 + 100 for i in range(args.context)]
    sessions, first_step_s = {}, {}
    for name, graphs in arms.items():
        m.graphs = graphs
        kv = Engine(m, KVStrategy("sink_window", 4, 1020), prefill_chunk=args.context).new_session_kv()
        steps.prefill_chunk(m, kv, prompt)
        t0 = time.perf_counter()
        steps.decode_step(m, kv, 5, greedy=True)  # the compiled arm compiles here
        first_step_s[name] = time.perf_counter() - t0
        sessions[name] = kv
        print(f"{name}: first step {first_step_s[name]:.2f} s", flush=True)
    per_round = {name: [] for name in arms}
    equal = True
    for r in range(args.rounds):
        last = {}
        for name, graphs in arms.items():
            m.graphs, kv = graphs, sessions[name]
            t0 = time.perf_counter()
            for i in range(args.steps):
                steps.decode_step(m, kv, 11 + r * args.steps + i, greedy=True)
            per_round[name].append(1000 * (time.perf_counter() - t0) / args.steps)
            last[name] = kv.last_logits
        equal = equal and torch.equal(last["eager"], last["inductor"])
        print(f"round {r}: " + ", ".join(f"{n} {v[-1]:.2f} ms" for n, v in per_round.items()), flush=True)
    med = {name: statistics.median(v) for name, v in per_round.items()}
    write_json(pathlib.Path(args.out), {
        **meta,
        "first_step_s": first_step_s,
        "ms_per_decode_step": {"per_round": per_round, "median": med},
        "inductor_speedup": med["eager"] / med["inductor"],
        "logits_bit_equal": equal,
        "decision": "compile auto on the CPU = inductor" if med["inductor"] < 0.95 * med["eager"] and equal
        else "compile auto on the CPU = eager (inductor not >= 5 % faster, or not bit-equal)",
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
