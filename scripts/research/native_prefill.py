"""Prefill chunks through the native CPU row step (model.row_step_takes_prefill) against the Python pieces, side by side.

Arms, one int4 model (the GGUF's Q4_1 blocks):
  python   prefill chunks through the layer pieces driven from Python (torch's int4 kernel, bf16 activations,
           batched SDPA): what `--compile auto` did before prefill went native; decode rows still native
  native   prefill chunks through the native row step (one C++ call per forward, the project's int4 kernel, rows
           attending as one-token steps): `--compile auto` now
Measured:
  1. prefill: seconds to prefill a prompt of each --lengths in chunks of --chunk (the daemon's default 256), arms
     interleaved in --rounds, per --threads; tok/s and the ratio.
  2. the shared step: one forward of --sessions decode rows plus a --shared-chunk-token prefill chunk (the engine loop's
     step while a long append lands and others decode), at --shared-context tokens of context; median ms per arm, and
     the same rows without the chunk (what the chunk adds).
  3. quality: teacher-forced top-1 agreement with fp32 over the held-out prompts (bench_weights.py), each sequence as
     one prefill forward through the arm (every position's logits), as bench_weights measures the int4 prefill path.
Writes results/research/native_prefill.json.

    python scripts/research/native_prefill.py --threads 1,2
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_common import ROOT, run_metadata, write_json  # noqa: E402

ARMS = ("python", "native")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--lengths", default="512,2048,4096")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=8, help="decode rows in the shared step")
    ap.add_argument("--shared-chunk", type=int, default=32, help="the shared step's prefill chunk (--prefill-chunk-shared)")
    ap.add_argument("--shared-context", type=int, default=1024)
    ap.add_argument("--shared-steps", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=40, help="held-out prompts for quality (half chat, half code)")
    ap.add_argument("--tokens", type=int, default=64, help="fp32 greedy continuation tokens per prompt")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "results" / "research" / "native_prefill.json"))
    args = ap.parse_args(argv)

    import torch

    from inference_engine.backends.torch import native
    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine import steps
    from inference_engine.engine.generate import Engine
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model

    meta = run_metadata(vars(args))
    threads = [int(t) for t in args.threads.split(",")]
    path = resolve_model(args.model)
    if native.load() is None:
        raise SystemExit(f"the native row step did not build here: {native.unavailable_reason()}")
    m = TorchCausalLM.load(path, weights="int4")
    assert m.use_native_step() is True
    nat = m.native_step

    def use(arm):
        nat.prefill = arm == "native"

    out = meta | {"build_dir": str(native.build_dir())}
    strategy = KVStrategy("full")
    lengths = [int(n) for n in args.lengths.split(",")]
    vocab = m.spec.vocab_size
    base = 100 if vocab > 1100 else 3  # the benches' synthetic prompt; a tiny test model's vocabulary is smaller
    prompt = [(7 * i + 3) % min(1000, vocab - base) + base for i in range(max(lengths + [args.shared_context]))]

    # 1. prefill
    prefill: dict = {}
    for nt in threads:
        torch.set_num_threads(nt)
        engine = Engine(m, strategy, prefill_chunk=args.chunk)
        times: dict = {(arm, n): [] for arm in ARMS for n in lengths}
        for _ in range(args.rounds):
            for n in lengths:
                for arm in ARMS:
                    use(arm)
                    kv = engine.new_session_kv()
                    t = time.perf_counter()
                    engine.prefill(kv, prompt[:n])
                    times[arm, n].append(time.perf_counter() - t)
        row = {}
        for n in lengths:
            s = {arm: statistics.median(times[arm, n]) for arm in ARMS}
            row[str(n)] = {"seconds_median": {a: round(v, 3) for a, v in s.items()},
                           "tok_s": {a: round(n / v, 1) for a, v in s.items()},
                           "native_speedup": round(s["python"] / s["native"], 3)}
            print(f"prefill threads {nt} n {n}", row[str(n)], flush=True)
        prefill[str(nt)] = row
    out["prefill"] = prefill

    # 2. the shared step: decode rows + one short prefill chunk in one forward
    shared: dict = {}
    for nt in threads:
        torch.set_num_threads(nt)
        engine = Engine(m, strategy, prefill_chunk=args.chunk)
        decoders = []
        for _ in range(args.sessions):
            kv = engine.new_session_kv()
            engine.prefill(kv, prompt[:args.shared_context])
            decoders.append(kv)
        times = {key: [] for key in ("rows_only", *ARMS)}
        for i in range(args.shared_steps + 1):
            for key in times:
                use("native" if key == "rows_only" else key)
                tasks = [steps.decode_step_task(m, kv, 100 + i, greedy=True) for kv in decoders]
                if key != "rows_only":
                    appender = engine.new_session_kv()
                    engine.prefill(appender, prompt[:args.shared_context])
                    tasks.append(steps.prefill_chunk_task(m, appender, prompt[:args.shared_chunk]))
                inputs = [t.send(None) for t in tasks]
                t0 = time.perf_counter()
                outs = steps.forward_batch(m, inputs)
                dt = time.perf_counter() - t0
                for task, o in zip(tasks, outs):
                    try:
                        task.send(o)
                    except StopIteration:
                        pass
                if i:  # the first round warms up
                    times[key].append(dt)
        ms = {key: round(statistics.median(v) * 1e3, 2) for key, v in times.items()}
        shared[str(nt)] = {"step_ms_median": ms,
                           "with_chunk_vs_rows_only": {a: round(ms[a] / ms["rows_only"], 3) for a in ARMS},
                           "native_speedup": round(ms["python"] / ms["native"], 3)}
        print(f"shared step threads {nt}", shared[str(nt)], flush=True)
    out["shared_step"] = shared

    # 3. quality
    if not args.skip_quality:
        from bench_weights import fp32_references, full_logits

        torch.set_num_threads(threads[-1])
        seqs = fp32_references(path, args.prompts, args.tokens)
        quality = {}
        for arm in ARMS:
            use(arm)
            agree = total = 0
            for p, cont, want in seqs:
                got = full_logits(m, p + cont)[len(p) - 1: len(p) - 1 + len(cont)].argmax(-1).tolist()
                agree += sum(a == b for a, b in zip(got, want))
                total += len(want)
            quality[arm] = {"top1_agreement_with_fp32": round(agree / total, 5), "positions": total,
                            "passes_99_gate": agree / total >= 0.99}
            print(arm, quality[arm], flush=True)
        out["quality"] = quality
    use("native")
    write_json(pathlib.Path(args.out), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
