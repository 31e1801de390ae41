"""Where a verify block's time goes, against one decode row (issue 28: a 5-row verify block <= 1.3x one decode step;
8 sessions' rows in one forward >= 3x one row's throughput).

One int4 model with the daemon's native CPU row step (csrc/row_step.cpp); per round, for each R in --rows:
  forward      one forward of R rows of one session (row-exact, greedy scoring: a decode step at R = 1, a verify block
               of the fed token and R - 1 drafts otherwise) at --context tokens, then aborted (steps.forward_batch)
  layers       the step's 4 x layers int4 matmuls (q4_matmul, the step's own packed blocks, in layer order so the
               weights stream from memory as in a step) for R rows of seeded random activations (the kernel's time does
               not depend on their values), three ways: `default` as the daemon's step runs them (its activation
               planes, native.PLANES, with outlier channels exact where it takes one plane: `--activations int8`, the
               default until 2026-11-29), `one_plane` (one int8 plane, no outlier channels) and `two_planes`
  head         the greedy head's scoring (linear.RefinedHead.greedy_kernel: the 4-bit pass and its exact top 64) of R rows
  rest         forward - layers default - head: attention, norms, RoPE, SiLU, quantizing activations and the glue
  *_chain      (on an AVX-512 VNNI CPU) forward and layers_two_planes with the kernel's rows in its runtime loop, one
               dot chain a row (q4_vnni_tiles 0: the kernel before 2026-12-01; the same bits)
All interleaved in --rounds, so a drift in the box's speed lands on every cell alike. Records the median ms of each
cell, each cell's time per row beyond the first ((t(R) - t(1)) / (R - 1)), and t(R) / t(1). Python calls each matmul
of the `layers` cells (~7 us a call), the step calls them from C++: the split is approximate; the forward is the step.

    python scripts/research/verify_split.py --threads 2 --out results/research/verify_split_avx2.json
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_common import ROOT, run_metadata, write_json  # noqa: E402

CELLS = ("forward", "layers_default", "layers_one_plane", "layers_two_planes", "head")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=128, help="tokens the session holds before the rows")
    p.add_argument("--rows", default="1,2,5,8", help="rows per forward (1 first: the decode row the others divide by)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=5, help="timed calls per cell and round")
    p.add_argument("--out", default=str(ROOT / "results" / "research" / "verify_split.json"))
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if rows[0] != 1:
        raise SystemExit("verify_split: --rows must start with 1 (the decode row)")

    import torch

    from inference_engine.backends.torch import native
    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine import steps
    from inference_engine.engine.generate import Engine
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model
    from inference_engine.server.config import ServeConfig

    torch.set_num_threads(args.threads)
    meta = run_metadata(vars(args))
    m = TorchCausalLM.load(resolve_model(args.model), weights="int4")
    m.use_step_graphs("auto")
    step = m.native_step
    if step is None or not step.q4:
        raise SystemExit("verify_split: needs the native CPU row step with its int4 kernel (a C++ compiler, AVX2)")
    mod = step.module
    channels = native.cached_outlier_channels(m, native.OUTLIERS) if step.outliers else {}
    mats = []  # (inputs, blocks, outlier channels or None) per linear, in step order
    for i, layer in enumerate(m.layers):
        for kind, lin in zip(native.LINEAR_KINDS, (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)):
            mats.append((lin.shape[1], native.q4_pack(mod, lin), channels.get((i, kind))))
    gen = torch.Generator().manual_seed(0)
    xs = {k: torch.randn(max(rows), k, generator=gen) for k in {k for k, _, _ in mats}}
    hx = torch.randn(max(rows), m.spec.hidden_size, generator=gen)

    def layers(r: int, planes: int, with_channels: bool) -> None:
        for k, w, ch in mats:
            mod.q4_matmul(xs[k][:r], w, 0, planes, ch if with_channels else None)

    cfg = ServeConfig()
    engine = Engine(m, KVStrategy(cfg.kv_strategy, cfg.sink, cfg.resolved_window), prefill_chunk=256)
    kv = engine.new_session_kv()
    span = min(1000, m.spec.vocab_size - 100)
    prompt = [(7 * i + 3) % span + 100 for i in range(args.context)]
    for i in range(0, len(prompt), 256):
        steps.prefill_chunk(m, kv, prompt[i:i + 256])

    def forward(r: int) -> None:
        best = int(kv.last_logits.argmax())
        ids = [best] + [(best + 1 + j) % m.spec.vocab_size for j in range(r - 1)]
        start = kv.cache.next_position
        steps.forward_batch(m, [steps.StepInput(m.tensor(ids), range(start, start + r), kv.cache, "all",
                                                row_exact=True, greedy=True)])
        kv.cache.abort()

    planes = step.planes
    run = {"forward": forward,
           "layers_default": lambda r: layers(r, planes, bool(step.outliers)),
           "layers_one_plane": lambda r: layers(r, 1, False),
           "layers_two_planes": lambda r: layers(r, 2, False),
           "head": lambda r: m.head.greedy_kernel(hx[:r])}
    cells = CELLS
    if mod.q4_isa() == 2:  # the AVX-512 kernel: its row tiles against the loop before them

        def chained(fn):
            def go(r: int) -> None:
                was = mod.q4_vnni_tiles(0)
                try:
                    fn(r)
                finally:
                    mod.q4_vnni_tiles(was)
            return go

        run |= {"forward_chain": chained(forward), "layers_two_planes_chain": chained(run["layers_two_planes"])}
        cells = CELLS + ("forward_chain", "layers_two_planes_chain")
    times = {(c, r): [] for c in cells for r in rows}
    for c, r in times:  # warm-up
        run[c](r)
    for rnd in range(args.rounds):
        for c, r in times:
            for _ in range(args.steps):
                t = time.perf_counter()
                run[c](r)
                times[c, r].append(time.perf_counter() - t)
        print(f"round {rnd + 1}/{args.rounds}", flush=True)
    med = {key: statistics.median(v) * 1000 for key, v in times.items()}
    by_rows = {}
    for r in rows:
        cell = {f"{c}_ms_median": round(med[c, r], 4) for c in cells}
        cell["rest_ms"] = round(med["forward", r] - med["layers_default", r] - med["head", r], 4)
        if r > 1:
            for c in cells:
                cell[f"{c}_vs_1"] = round(med[c, r] / med[c, 1], 3)
                cell[f"{c}_ms_per_extra_row"] = round((med[c, r] - med[c, 1]) / (r - 1), 3)
            cell["rest_ms_per_extra_row"] = round((cell["rest_ms"] - by_rows["1"]["rest_ms"]) / (r - 1), 3)
        by_rows[str(r)] = cell
        print(r, cell, flush=True)
    doc = meta | {"step": m.describe_step(), "planes": planes, "outliers": step.outliers,
                  "what": "ms medians per cell; layers_* time the step's int4 matmuls called from Python; rest = "
                          "forward - layers_default - head", "by_rows": by_rows}
    write_json(pathlib.Path(args.out), doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
