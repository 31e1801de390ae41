"""What one linear layer costs per number of rows, per weight format, on this CPU (issue 28: verify blocks and
batched decode cost far more than a decode step because torch's int4 kernel is linear in rows).

For SmolLM2-135M's four linear shapes (fused QKV, output projection, fused gate/up, down) and its LM head,
times y = linear(x) for x of M rows, M in --rows, through the runtime's own layers (backends/torch/linear.py:
int4 = torch's `_weight_int4pack_mm_for_cpu`, int8 = `_weight_int8pack_mm`, both with bf16 activations;
fp32 = F.linear) and a dense bf16 F.linear (oneDNN; fast only where the CPU has bf16 instructions), side by
side in one process. Weights are random of the right shapes: the kernels' time does not depend on the values.
Per shape and format: microseconds per call (median of --repeats timings of --calls calls), and the cost of
M rows over one row; per M the sum over a layer's four linears, and which format is fastest.

    .venv/bin/python scripts/research/linear_rows.py --threads 2
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, run_metadata, write_json  # noqa: E402

OUT = ROOT / "results" / "research" / "linear_rows.json"
# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, intermediate 1536, vocabulary 49152
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "head": (576, 49152)}
LAYER = ("qkv", "o", "gate_up", "down")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,3,4,5,8,16,32")
    ap.add_argument("--formats", default="int4,int8,bf16,fp32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from inference_engine.backends.torch.linear import make_linear

    torch.set_num_threads(args.threads)
    meta = run_metadata(vars(args))
    rows = [int(r) for r in args.rows.split(",")]
    formats = args.formats.split(",")
    gen = torch.Generator().manual_seed(0)
    table: dict = {}
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, generator=gen) * 0.05
        layers = {}
        for fmt in formats:
            if fmt == "bf16":
                wb = w.to(torch.bfloat16)
                layers[fmt] = lambda x, wb=wb: F.linear(x.to(torch.bfloat16), wb).float()
            else:
                layers[fmt] = make_linear(fmt, w, None)
        table[name] = {}
        for fmt, layer in layers.items():
            per_m = {}
            for m in rows:
                x = torch.randn(m, k, generator=gen)
                with torch.inference_mode():
                    for _ in range(5):
                        layer(x)
                    times = []
                    for _ in range(args.repeats):
                        t = time.perf_counter()
                        for _ in range(args.calls):
                            layer(x)
                        times.append((time.perf_counter() - t) / args.calls * 1e6)
                per_m[str(m)] = round(statistics.median(times), 1)
            base = per_m[str(rows[0])]
            table[name][fmt] = {"us": per_m, "over_one_row": {m: round(v / base, 2) for m, v in per_m.items()}}
            print(name, fmt, per_m, flush=True)
    layer_sum = {fmt: {str(m): round(sum(table[s][fmt]["us"][str(m)] for s in LAYER), 1) for m in rows} for fmt in formats}
    fastest = {str(m): min(formats, key=lambda f: layer_sum[f][str(m)]) for m in rows}
    doc = meta | {"shapes": {k: {"in": v[0], "out": v[1]} for k, v in SHAPES.items()}, "linears": table,
                  "layer_us": layer_sum, "layer_fastest_format": fastest,
                  "layer_rows_over_one_row": {f: {m: round(v / layer_sum[f][str(rows[0])], 2) for m, v in s.items()}
                                              for f, s in layer_sum.items()}}
    write_json(pathlib.Path(args.out), doc)
    print({"layer_us": layer_sum, "fastest": fastest})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
