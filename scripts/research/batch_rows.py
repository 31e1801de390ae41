"""What a forward of several sessions' decode rows costs against one, in-process (issue 28: aggregate decode at 8
sessions >= 3x one session): the engine's own batched forward (`steps.forward_batch`, as EngineLoop runs it), no
gRPC, no sampling, so what the daemon adds on top is not in these figures (scripts/bench_agentic/bench_load.py
measures that).

--sessions sessions of the daemon's default strategy, each prefilled with --context token ids; per round, for each
arm and each batch size n in --batches, one forward of the first n sessions' next decode rows (row-exact, greedy
scoring, as a decode step), then aborted, so every forward sees the same history. Arms and batch sizes interleave
in --rounds, so a drift in the box's speed lands on every cell alike. Arms are settings of the native CPU row step
(csrc/row_step.cpp), to time what each is worth:
  before  every row scans all of its mask's columns, per-row loops on one thread, SiLU in plain floats
          (trim_columns 0, rows_apart 0, silu_vectors 0: the step before 39c54e0)
  trim    rows end at their last visible column (trim_columns 1)
  apart   trim, and a step of several rows shares its per-row loops and short attention out to the threads
  silu    apart, and the MLP's SiLU in AVX2 vectors (silu_vectors 1; rounds differently: not the same bits as the
          others, each row-exact)
  head    silu, and the greedy head's exact top 64 chosen and rescored in the C++ call that scores (refined_head)
          instead of topk / gather / einsum / scatter from Python after it (the arms above) - the default settings
  rowmem  head, but the int4 kernel's AVX2 path runs a one-row tile as a tile of up to 8 rows, its sums in memory
          (q4_row_registers 0: the kernel before f45bac2; the same bits)
  planes2 head, with the int4 kernel's activations as two int8 planes everywhere (native.PLANES, built explicitly)
  outliers  head, with one plane and each linear's native.OUTLIERS outlier channels exact
  vnnichain  head, but the int4 kernel's AVX-512 path runs its rows in the runtime loop, each row's dot one chain
          (q4_vnni_tiles 0: the kernel before 2026-12-01; the same bits)
  kvfp16  head, over sessions whose resident K/V is fp16 (--kv-dtype fp16: the slabs half the bytes; the other arms'
          sessions hold fp32 K/V); with --context 1024 each row reads what a steady-state sink_window session reads
The other arms run the daemon's default step (use_step_graphs("auto"): activations as native.PLANES planes).
Records the median ms per forward, tokens per second (n / median) and the speedup at n over n = 1 per arm, and
each arm's speedup over `before` per n. Writes results/research/batch_rows.json.

    python scripts/research/batch_rows.py --threads 2 --out results/research/batch_rows_avx2.json
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_common import ROOT, run_metadata, write_json  # noqa: E402

# trim_columns, rows_apart, silu_vectors, the greedy head's refinement in C++ (csrc/row_step.cpp refined_head)
# (and q4_row_registers: a one-row tile's sums in registers)
# (and q4_vnni_tiles: the AVX-512 kernel's rows in tiles of a fixed count, their dot chains interleaved)
ARMS = {"before": (0, 0, 0, 0, 0, 0), "trim": (1, 0, 0, 0, 0, 0), "apart": (1, 1, 0, 0, 0, 0), "silu": (1, 1, 1, 0, 0, 0),
        "rowmem": (1, 1, 1, 1, 0, 1), "head": (1, 1, 1, 1, 1, 1), "planes2": (1, 1, 1, 1, 1, 1),
        "outliers": (1, 1, 1, 1, 1, 1), "kvfp16": (1, 1, 1, 1, 1, 1), "vnnichain": (1, 1, 1, 1, 1, 0)}
KV_DTYPE = {"kvfp16": "fp16"}  # the arms whose sessions hold other K/V than fp32


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--weights", default="int4", choices=("int8", "int4"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=32, help="tokens each session holds before its decode row")
    p.add_argument("--batches", default="1,2,4,8", help="sessions per forward")
    p.add_argument("--arms", default="before,trim,apart,silu,head")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default=str(ROOT / "results" / "research" / "batch_rows.json"))
    args = p.parse_args(argv)
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:  # before anything loads
        raise SystemExit(f"batch_rows: unknown arms {unknown}; choose from {sorted(ARMS)}")

    import torch

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine import steps
    from inference_engine.engine.generate import Engine
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model
    from inference_engine.server.config import ServeConfig

    torch.set_num_threads(args.threads)
    meta = run_metadata(vars(args))
    m = TorchCausalLM.load(resolve_model(args.model), weights=args.weights)
    m.use_step_graphs("auto")
    if m.native_step is None:
        raise SystemExit("batch_rows: the native CPU row step is not available here (no C++ compiler, or not a CPU)")
    mod = m.native_step.module
    from inference_engine.backends.torch import native

    default_step = m.native_step
    activations = {}  # arm -> the native step built with its activations
    if "planes2" in args.arms.split(","):
        m.use_native_step(planes=2, outliers=0)
        activations["planes2"] = m.native_step
    if "outliers" in args.arms.split(","):
        m.use_native_step(planes=1, outliers=native.OUTLIERS)
        activations["outliers"] = m.native_step
    m.native_step = default_step
    batches = [int(b) for b in args.batches.split(",")]
    cfg = ServeConfig()
    strategy = KVStrategy(cfg.kv_strategy, cfg.sink, cfg.resolved_window)
    span = min(1000, m.spec.vocab_size - 100)
    sessions = {}  # kv dtype -> the sessions (the same token ids in each)
    for dt in sorted({KV_DTYPE.get(a, "fp32") for a in arms}):
        engine = Engine(m, KVStrategy(cfg.kv_strategy, cfg.sink, cfg.resolved_window, kv_dtype=dt), prefill_chunk=256)
        sessions[dt] = []
        for s in range(max(batches)):
            kv = engine.new_session_kv()
            ids = [(7 * i + 13 * s) % span + 100 for i in range(args.context)]
            for i in range(0, len(ids), 256):
                steps.prefill_chunk(m, kv, ids[i:i + 256])
            sessions[dt].append(kv)
    kvs = sessions[min(sessions)]

    def forward(n: int) -> float:
        inputs = []
        for kv in kvs[:n]:
            start = kv.cache.next_position
            inputs.append(steps.StepInput(m.tensor([int(kv.last_logits.argmax())]), range(start, start + 1), kv.cache,
                                          "last", row_exact=True, greedy=True))
        t = time.perf_counter()
        steps.forward_batch(m, inputs)
        dt = time.perf_counter() - t
        for kv in kvs[:n]:
            kv.cache.abort()
        return dt

    head = m.head
    fused = head.greedy_kernel
    python_refine = None
    if fused is not None:
        from inference_engine.backends.torch.native import q4_pack

        packed, r = q4_pack(mod, head.greedy_approx), min(head.greedy_refine, head.w.shape[0])

        def python_refine(x):  # the greedy head before refined_head: the kernel's scores, the top r refined from Python
            y = mod.q4_matmul(x.float().contiguous(), packed, 0, 1)
            idx = y.topk(r, dim=-1).indices
            return y.scatter(-1, idx, torch.einsum("mh,mrh->mr", x.float(), head.w[idx]))

    def use(arm: str) -> None:
        nonlocal kvs
        kvs = sessions[KV_DTYPE.get(arm, "fp32")]
        trim, apart, silu, in_cpp, registers, tiles = ARMS[arm]
        mod.q4_row_registers(registers)
        mod.q4_vnni_tiles(tiles)
        m.native_step = activations.get(arm, default_step)
        mod.trim_columns(trim)
        mod.rows_apart(apart)
        mod.silu_vectors(int(bool(silu) and mod.q4_isa() != 0))
        head.greedy_kernel = fused if in_cpp or python_refine is None else python_refine

    cells = [(a, n) for a in arms for n in batches]
    for a, n in cells:  # warm-up
        use(a)
        forward(n)
    times: dict = {c: [] for c in cells}
    for _ in range(args.rounds):
        for a, n in cells:
            use(a)
            times[a, n].append(forward(n))
    use("head")  # the default again
    by_arm: dict = {}
    for a in arms:
        med = {n: statistics.median(times[a, n]) for n in batches}
        by_arm[a] = {str(n): {"forward_ms_median": round(med[n] * 1000, 3), "tok_s": round(n / med[n], 1),
                              "speedup_vs_1": round(n * med[batches[0]] / med[n], 3) if batches[0] == 1 else None}
                     for n in batches}
        print(a, {n: v["forward_ms_median"] for n, v in by_arm[a].items()}, flush=True)
    if "before" in by_arm:
        for a in arms:
            for n, v in by_arm[a].items():
                v["speedup_vs_before"] = round(by_arm["before"][n]["forward_ms_median"] / v["forward_ms_median"], 3)
    settings = {a: dict(zip(("trim_columns", "rows_apart", "silu_vectors", "refined_head", "q4_row_registers",
                             "q4_vnni_tiles"), ARMS[a]))
                | {"planes": activations.get(a, default_step).planes, "outliers": activations.get(a, default_step).outliers,
                   "kv_dtype": KV_DTYPE.get(a, "fp32")}
                for a in arms}
    doc = meta | {"strategy": strategy.describe(), "step": m.describe_step(), "arms": settings, "by_arm": by_arm,
                  "what": "one forward of n sessions' decode rows (engine forward_batch, in-process), median of --rounds "
                          "interleaved rounds; the daemon's sampling, streaming and gRPC are not in it"}
    write_json(pathlib.Path(args.out), doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
