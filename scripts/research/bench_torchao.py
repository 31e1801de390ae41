"""torch's CPU weight-only kernels (what backends/torch/linear.py calls) vs torchao's, on
SmolLM2-135M's linear shapes (30 layers: fused qkv, o_proj, fused gate/up, down), one run.

torchao is not a dependency: install it beside torch without letting pip touch torch,
    .venv/bin/python -m pip install --no-deps torchao==0.18.0
then run this script. Per format: whether torchao's CPU path exists (the error when it does
not), the time of 30 layers' linears for 1 and 3 rows (interleaved rounds, median), and the
largest output difference between the two. Writes results/research/bench_torchao.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, run_metadata, write_json  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer


def timed(fns, xs, rounds, reps):
    """Median seconds of running every fn over its x `reps` times, arms interleaved per round."""
    out = {name: [] for name in fns}
    for _ in range(rounds):
        for name, layers in fns.items():
            t = time.perf_counter()
            for _ in range(reps):
                for f, x in zip(layers, xs[name]):
                    f(x)
            out[name].append((time.perf_counter() - t) / reps)
    return {name: sorted(v)[len(v) // 2] for name, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results" / "research" / "bench_torchao.json"))
    args = ap.parse_args()

    import pathlib

    import torch

    from inference_engine.backends.torch.linear import Int4Linear, Int8Linear

    try:
        import torchao
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
        from torchao.quantization.quantize_.workflows.int4.int4_packing_format import Int4PackingFormat
    except ImportError as e:
        raise SystemExit(f"torchao is not installed ({e}); see this script's docstring") from e

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen) * 0.05 for _ in range(args.layers) for o, i in SHAPES]

    def torchao_linear(w, config):
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).to(torch.bfloat16)
        lin.weight.data.copy_(w)
        quantize_(lin, config)
        return lin

    result = {"torchao": torchao.__version__, "formats": {}}
    ours = {"int8": Int8Linear.from_float, "int4": Int4Linear.from_float}
    configs = {"int8": [("default", Int8WeightOnlyConfig())],
               "int4": [(f.name, Int4WeightOnlyConfig(group_size=32, int4_packing_format=f)) for f in Int4PackingFormat]}
    for fmt in ("int8", "int4"):
        entry = {"torchao_cpu_paths": {}}
        mine = [ours[fmt](w) for w in weights]
        theirs = None
        for name, cfg in configs[fmt]:
            try:
                lins = [torchao_linear(w, cfg) for w in weights]
                with torch.inference_mode():
                    lins[0](torch.randn(1, SHAPES[0][1], dtype=torch.bfloat16))
                entry["torchao_cpu_paths"][name] = "ok"
                theirs = theirs or lins
            except Exception as e:  # noqa: BLE001 - recorded: which torchao layouts run on this CPU
                entry["torchao_cpu_paths"][name] = f"{type(e).__name__}: {e}"[:200]
        for rows in (1, 3):
            xs = [torch.randn(rows, w.shape[1], generator=gen) for w in weights]
            fns = {"torch_kernel": mine}
            inputs = {"torch_kernel": xs}
            if theirs is not None:
                fns["torchao"] = [lambda x, f=f: f(x) for f in theirs]
                inputs["torchao"] = [x.to(torch.bfloat16) for x in xs]
            with torch.inference_mode():
                t = timed(fns, inputs, args.rounds, args.reps)
                diff = None
                if theirs is not None:
                    diff = max(float((m(x) - f(x.to(torch.bfloat16)).float()).abs().max()) for m, f, x in zip(mine, theirs, xs))
            entry[f"rows_{rows}"] = {"ms": {k: round(v * 1e3, 3) for k, v in t.items()},
                                     "torchao_over_torch_kernel": round(t["torchao"] / t["torch_kernel"], 3) if "torchao" in t else None,
                                     "max_abs_output_diff": diff}
            print(fmt, rows, entry[f"rows_{rows}"], flush=True)
        result["formats"][fmt] = entry
    out = run_metadata(vars(args)) | result
    write_json(pathlib.Path(args.out), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
